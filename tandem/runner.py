"""Turns a scheduled batch into queued device work: inputs, forward, sampling, async results.

`launch` only queues work and returns at once; nothing in it reads a device value. Streams:
metadata is staged on the schedule stream, the forward stream waits for it (read-after-
write), runs the model and the sampler, and the copy stream brings results to pinned memory.
"""
from collections.abc import Sequence
from dataclasses import dataclass, field
from time import perf_counter

import torch

from tandem.cuda_graph import DECODE_FIELDS, DecodeGraphs
from tandem.forward_batch import ForwardBatch, query_rows_batch
from tandem.memory.kv_cache import KVCache
from tandem.memory.req_to_token import ReqToTokenTable
from tandem.models.decoder import DecoderModel
from tandem.overlap.future_map import FutureMap
from tandem.overlap.results import HostResult, ResultCopier
from tandem.overlap.staging import InputStager, ragged_columns
from tandem.overlap.streams import StreamSet, device_int64
from tandem.prefill_graphs import PrefillBucket, PrefillGraphs
from tandem.request import Request
from tandem.sampling import Sampler, SamplingInputs, SamplingParams
from tandem.sampling.inputs import SampleOutput, seed_to_int64
from tandem.sampling.noise import row_keys
from tandem.sampling.prompt_logprobs import PromptLogprobs, compute_prompt_logprobs
from tandem.scheduler.batch import ScheduledBatch
from tandem.scheduler.cascade import FIELDS as CASCADE_FIELDS
from tandem.scheduler.cascade import CascadeMemo, CascadePlan, CascadeRule, plan_cascade, staged_inputs
from tandem.speculative.graphs import VERIFY_FIELDS, VerifyGraphs, settle
from tandem.speculative.state import SpecState, SpecStep
from tandem.speculative.verify import Verdict, accept_rejection


@dataclass
class PendingResult:
    """A launched step whose result the host has not read yet."""

    batch: ScheduledBatch
    host: HostResult
    # Lifetime: per-step device tensors made on the schedule stream and read on the forward
    # stream stay referenced here until the result is processed (which implies the forward
    # completed), so the caching allocator cannot hand their memory out early.
    keepalive: list = field(default_factory=list)
    forward_start: object = None
    forward_end: object = None
    record: object = None  # the step's timeline record, when a timeline is kept
    unsampled: tuple | None = None  # (logits, sample slots, sampling inputs) until `sample` ran
    mask_wait: tuple | None = None  # timing events around the forward stream's wait for the masks
    tier_wait: object | None = None  # its wait for host-tier copies (the fence's `TierWait`)
    verify: SpecStep | None = None  # a verify step's proposals and lengths, until `sample` ran
    # A greedy graphed verify step: (bucket, ring slot, untrimmed logits, untrimmed SpecStep)
    # for its captured tail, until `sample` ran.
    verify_tail: tuple | None = None
    verify_queries: list[int] | None = None  # a verify step: query tokens per row (their logprobs' layout)
    # Speculative decoding, plain steps: the positions of the sampled rows' inputs (the
    # history appends each sampled token after its input).
    sampled_input_positions: torch.Tensor | None = None
    # Prompt logprobs of the step's scored prefill rows (forward stream), until `sample` hands
    # them to the result copy with the step's tokens.
    prompt_logprobs: PromptLogprobs | None = None
    staged_ahead_ms: float | None = None  # host ms its inputs' staging took in an earlier wait (stage_ahead)


@dataclass
class StagedStep:
    """A step's inputs in its staging ring slot, and the graph choices that laid them out."""

    batch: ScheduledBatch
    bucket: int | None  # a decode or verify graph's rows; None: no such graph
    prefill: PrefillBucket | None  # a prefill graph's bucket; None: no prefill graph
    fields: dict[str, Sequence[int]]  # the host lists (or int64 arrays) staged
    dev: dict[str, torch.Tensor]  # their device views
    ahead_ms: float | None = None  # host ms staging it took in an earlier wait; None: staged at launch


class ModelRunner:
    def __init__(self, model: DecoderModel, kv: KVCache, table: ReqToTokenTable, backend,
                 sampler: Sampler, future_map: FutureMap, streams: StreamSet,
                 stager: InputStager, copier: ResultCopier, graphs: DecodeGraphs | None = None,
                 timing: bool = False, mirror=None, spec: SpecState | None = None,
                 verify_graphs: VerifyGraphs | None = None, single_query_graphs: VerifyGraphs | None = None,
                 cascade: CascadeRule | None = None,
                 prefill_graphs: PrefillGraphs | None = None):
        self.model, self.kv, self.table, self.backend = model, kv, table, backend
        self.prefill_graphs = prefill_graphs  # small prefill-only steps replay these; None: eager
        self.spec = spec  # speculative decoding's device state; None: off
        self.verify_graphs = verify_graphs
        # Verify steps where no row proposes: one query a row (same buckets as verify_graphs).
        self.single_query_graphs = single_query_graphs
        self.sampler, self.future_map, self.streams = sampler, future_map, streams
        self.stager, self.copier, self.graphs, self.timing = stager, copier, graphs, timing
        # Tensor parallelism, rank 0: the same admits and steps go to the workers (StepSender).
        self.mirror = mirror
        self.cascade = cascade  # decode steps group rows by shared prefix (cascade attention); None: off
        self.cascade_steps = self.cascade_rows = 0  # planned so far (stats)
        self.cascade_memo = CascadeMemo()  # the planner's: the rows' tree paths and its last plan
        self.staged_ahead: StagedStep | None = None  # the next step's inputs, staged in a wait (stage_ahead)
        self.steps_staged_ahead = 0  # steps launched with inputs staged ahead (stats)

    def launch(self, batch: ScheduledBatch, defer_sampling: bool = False) -> PendingResult:
        """Queue the step. With `defer_sampling` only the forward is queued; `sample` queues the
        rest once the host has the step's token masks (they need the previous step's tokens)."""
        if self.mirror is not None:
            # Workers sample at once: masks do not travel to them (the engine refuses constrained
            # requests under tensor parallelism).
            assert not defer_sampling, "token masks under tensor parallelism"
            self.mirror.launch(batch)  # first: the workers start while this rank stages
        staged, self.staged_ahead = self.staged_ahead, None
        if staged is None or staged.batch is not batch:  # none, or a plan since dropped: stage now
            staged = self._stage(batch, defer_sampling)
        else:
            self.steps_staged_ahead += 1
        try:
            if batch.is_verify:
                return self._queue_verify(batch, staged.fields, staged.dev, staged.bucket, defer_sampling)
            pending = self._queue_step(batch, staged.bucket, staged.prefill, staged.fields, staged.dev,
                                       defer_sampling)
            pending.staged_ahead_ms = staged.ahead_ms
            return pending
        except BaseException:
            # Write-after-read on every path: a retry of this step number stages into the same
            # ring slot behind whatever this attempt queued on the forward stream.
            self.stager.mark_consumed(batch.step)
            raise

    def stage_ahead(self, batch: ScheduledBatch) -> None:
        """In the wait for the step in flight: stage a prefill step planned ahead
        (`Scheduler.plan_ahead`) into its ring slot now, so that its launch, after that wait,
        only queues work. Ordering: the copy waits on the device for the ring slot's last
        forward, and the host buffer is rewritten only after its last copy ran (InputStager).
        `launch` uses it if it launches this very plan; a dropped plan's staging is written
        over. A failure leaves the staging to the launch, whose failure path handles it."""
        if batch.is_decode or batch.is_verify:  # their inputs follow results not read yet
            return
        started = perf_counter()
        try:
            staged = self._stage(batch, defer_sampling=False)
        except Exception:  # noqa: BLE001 (the launch stages it again and fails where failures are handled)
            return
        staged.ahead_ms = (perf_counter() - started) * 1e3
        self.staged_ahead = staged

    def _stage(self, batch: ScheduledBatch, defer_sampling: bool) -> "StagedStep":
        """The step's graph choices and its metadata, staged into its ring slot."""
        verify = batch.is_verify
        cascade = self._cascade_plan(batch)
        bucket = self._verify_bucket(batch, defer_sampling) if verify else self._graph_bucket(batch, cascade)
        prefill = self._prefill_bucket(batch) if not verify and bucket is None else None
        if verify:
            fields = _verify_metadata(batch, bucket)
        elif prefill is not None:  # the graph's fields first, then the cached prefixes' table rows
            fields = self.prefill_graphs.metadata(batch, prefill) | _cached_prefix_fields(batch.rows)
        else:
            fields = _metadata(batch) if bucket is None else _decode_metadata(batch, bucket)
        if cascade is not None:  # staged in the same copy as the rest of the step's inputs
            fields.update(cascade.fields() if bucket is None else
                          cascade.padded_fields(bucket, *self.cascade.graph_capacity(bucket)))
        return StagedStep(batch, bucket, prefill, fields, self.stager.stage(batch.step, fields))

    def _queue_step(self, batch: ScheduledBatch, bucket: int | None, prefill: PrefillBucket | None,
                    fields: dict[str, Sequence[int]], dev: dict[str, torch.Tensor], defer_sampling: bool
                    ) -> PendingResult:
        """Sampling inputs, then the forward (eager, a decode graph's replay (`bucket`) or a
        prefill graph's (`prefill`)), then the sampling."""
        size, sampled = batch.size, batch.num_sampled
        sampling = None
        if sampled and all(r.plain_greedy for r in batch.sampled[0]):  # ~0.2 ms of host less at 256 rows
            sampling = SamplingInputs.plain_greedy()
        elif sampled:
            sample_rows = batch.sample_rows
            sampling = SamplingInputs.from_rows(
                [r.req.sampling_row for r in sample_rows],
                [r.sample_index for r in sample_rows], [r.req.slot for r in sample_rows],
                pin_memory=self.streams.pin(), biases=[r.req.bias_at(r.sample_index) for r in sample_rows])
            if not _greedy_only(sampling):  # greedy argmax reads no per-row tensors: skip the copy
                with self.streams.use(self.streams.schedule):
                    sampling = sampling.to(self.streams.device, non_blocking=True)
        forward = self.streams.forward
        pending = PendingResult(batch, None, keepalive=[sampling])
        with self.streams.use(forward):
            forward.wait_stream(self.streams.schedule)  # read-after-write: staged inputs
            if self.timing:
                pending.forward_start = self.streams.event(timing=True)
                pending.forward_start.record(forward)
            if prefill is not None:
                logits, sample_slots = self._replay_prefill(batch, prefill, fields, dev)
            elif bucket is None:
                logits, pending.prompt_logprobs = self._eager_logits(batch, fields, dev)
                sample_slots = dev["sample_slots"]
            else:
                logits = self.graphs.replay(bucket, batch.step % self.stager.depth, dev["req_slots"],
                                            cascade=CASCADE_FIELDS[0] in fields)[:size]
                sample_slots = dev["req_slots"][:size]
            if self.spec is not None:  # the sampled rows' input positions (a decode graph samples every row)
                pending.sampled_input_positions = (
                    dev["positions"][:size] if bucket is not None
                    else dev["positions"][dev["sample_token_idx"][:sampled]])  # prefill graphs: padded
        pending.unsampled = (logits, sample_slots, sampling)
        if not defer_sampling:
            self.sample(pending)
        return pending

    def sample(self, pending: PendingResult, bitmask: torch.Tensor | None = None, mask_ready=None) -> None:
        """Queue the step's sampling behind its forward, and the copy of its results."""
        (logits, sample_slots, sampling), pending.unsampled = pending.unsampled, None
        batch, forward = pending.batch, self.streams.forward
        with self.streams.use(forward):
            if mask_ready is not None:
                before = self.streams.event(timing=True) if self.timing else None
                if before is not None:
                    before.record(forward)
                forward.wait_event(mask_ready)  # read-after-write: the mask, copied on the schedule stream
                if before is not None:
                    pending.mask_wait = (before, self.streams.event(timing=True))
                    pending.mask_wait[1].record(forward)
            try:
                if pending.verify is not None:
                    result = self._finish_verify(pending, logits, sample_slots, sampling, bitmask)
                elif batch.num_sampled:
                    out = self.sampler.sample(logits, sampling, bitmask)
                    self.future_map.stash(sample_slots, out.token_ids)
                    if sampling.need_penalties:  # only a request with penalties reads its slot's counts
                        self.sampler.record(sample_slots, out.token_ids)
                    if pending.sampled_input_positions is not None:
                        self.spec.record(sample_slots, pending.sampled_input_positions, out.token_ids)
                    result = (out.token_ids, out.logprobs, out.top_ids, out.top_logprobs)
                else:  # only partial prefill chunks: nothing sampled
                    result = (torch.empty(0, dtype=torch.int64, device=self.streams.device), None, None, None)
            finally:  # write-after-read, on every path: the last read of the staged inputs
                self.stager.mark_consumed(batch.step)
            if self.timing:
                pending.forward_end = self.streams.event(timing=True)
                pending.forward_end.record(forward)
            sampled = self.streams.event()
            sampled.record(forward)
        prompt, pending.prompt_logprobs = pending.prompt_logprobs, None
        pending.host = self.copier.copy(batch.step, *result, sampled, prompt)

    def _queue_verify(self, batch: ScheduledBatch, fields: dict[str, list[int]], dev: dict[str, torch.Tensor],
                      bucket: int | None, defer_sampling: bool) -> PendingResult:
        """A verify step: each row's last token and its proposals, at positions derived on the
        device from the lengths the previous steps left there (the host has only bounds).
        `bucket`: the fixed-shape layout (k + 1 queries a row, a graph replay); None: ragged
        (k_row + 1 queries a row, eager)."""
        rows, spec = batch.rows, self.spec
        graphs = self._verify_graphs_for(rows) if bucket is not None else None
        q = [graphs.q if graphs is not None else row.spec_k + 1 for row in rows]
        per_token = [i for i, n in enumerate(q) for _ in range(n)]
        sampling = SamplingInputs.from_rows(
            [rows[i].req.sampling_row for i in per_token], [0] * len(per_token),
            [rows[i].req.slot for i in per_token], pin_memory=self.streams.pin(),
            biases=[rows[i].req.bias_at(rows[i].sample_index) for i in per_token])
        greedy = _greedy_only(sampling)
        if not greedy:
            with self.streams.use(self.streams.schedule):
                sampling = sampling.to(self.streams.device, non_blocking=True)
        forward = self.streams.forward
        pending = PendingResult(batch, None, keepalive=[sampling], verify_queries=q)
        with self.streams.use(forward):
            forward.wait_stream(self.streams.schedule)  # read-after-write: staged inputs
            if self.timing:
                pending.forward_start = self.streams.event(timing=True)
                pending.forward_start.record(forward)
            if fields["reserved_locs"]:  # slots reserved for this and later steps: into the table first
                self.table.write_on_device(dev["reserved_req_slots"], dev["reserved_positions"],
                                           dev["reserved_locs"])
            if graphs is not None:
                ring = batch.step % self.stager.depth
                logits, step = graphs.replay(bucket, ring)
                if greedy:
                    pending.verify_tail = (graphs, bucket, ring, logits, step)
                logits, step = graphs.trimmed(bucket, ring, len(rows), logits, step)
                slots = dev["req_slots"][:len(rows)]
            else:
                logits, step = self._eager_verify(batch, fields, dev)
                slots = dev["req_slots"]
            if not greedy:  # the noise of output index (length + j - prompt length): plain decoding's
                r = step.token_row
                out_index = step.lengths[r] + step.token_offset - dev["prompt_lens"][r]
                sampling.ints[1] = row_keys(dev["seeds"][r], out_index)
        pending.verify = step
        pending.keepalive.append(step)
        pending.unsampled = (logits, slots, sampling)
        if not defer_sampling:
            self.sample(pending)
        return pending

    def _eager_verify(self, batch: ScheduledBatch, fields: dict[str, list[int]],
                      dev: dict[str, torch.Tensor]) -> tuple[torch.Tensor, SpecStep]:
        """The ragged layout: row b scores k_row + 1 queries."""
        rows, spec = batch.rows, self.spec
        slots, r, k_rows = dev["req_slots"], dev["token_row"], dev["k_rows"]
        bound = max(row.length_bound + row.spec_k for row in rows)  # the host's bound on every query's length
        last = self.future_map.resolve(slots)
        step = spec.prepare(slots, k_rows, r, dev["token_offset"], last, bound)
        input_ids, positions = spec.inputs(step, last)
        locs = self.table.table[slots[r], positions].to(torch.int64)
        fb = query_rows_batch(input_ids, positions, locs, slots[r], self.table.table, bound)
        return self.model.compute_logits(self.model(fb, self.kv, self.backend)), step

    def _verify_graphs_for(self, rows: list) -> VerifyGraphs:
        """The graph set of a fixed-shape verify step: one query a row when no row proposes."""
        if self.single_query_graphs is not None and not any(row.spec_k for row in rows):
            return self.single_query_graphs
        return self.verify_graphs

    def _verify_bucket(self, batch: ScheduledBatch, defer_sampling: bool) -> int | None:
        """The fixed-shape (graphed) layout within the captured sizes. Also for a step whose
        rows all have k_row = 0 (the one after a verify when nothing speculates): a replay costs
        less than the eager forward. Not for steps with token masks (their sampling waits for
        the host; one query a row)."""
        graphs = self.verify_graphs
        if graphs is None or defer_sampling or len(batch.rows) > graphs.max_batch:
            return None
        return graphs.bucket(len(batch.rows))

    def _finish_verify(self, pending: PendingResult, logits: torch.Tensor, slots: torch.Tensor,
                       sampling: SamplingInputs, bitmask: torch.Tensor | None) -> tuple:
        """Sample every query token as plain decoding would, accept the matching proposals,
        leave the new lengths, history and last tokens on the device. The result row b is
        [accepted, proposed, tokens[0..k]]: it emits tokens[:accepted + 1]."""
        step, pending.verify = pending.verify, None
        tail, pending.verify_tail = pending.verify_tail, None
        if tail is not None and bitmask is None:
            graphs, bucket, ring, full_logits, full_step = tail
            packed = graphs.replay_tail(bucket, ring, len(pending.batch.rows), full_logits, full_step)
            return packed, None, None, None
        # Penalties position by position: query j counts the row's proposals before it.
        extra = self.spec.proposal_counts(step, self.sampler.vocab_size) if sampling.need_penalties else None
        if step.proposal.probs is not None and not sampling.all_greedy:  # a draft's, not coupled
            verdict, out = self._rejection_verdict(step, logits, sampling, bitmask, extra)
        else:
            out = self.sampler.sample(logits, sampling, bitmask, extra)  # a bitmask only when every k is 0
            verdict = self.spec.point_mass_verdict(step, out.token_ids)
        packed = settle(self.spec, self.future_map, step, slots, verdict)
        if sampling.need_penalties:  # only a request with penalties reads its slot's counts
            self.sampler.record_emitted(slots, verdict.tokens, verdict.accepted)
        return packed, out.logprobs, out.top_ids, out.top_logprobs

    def _rejection_verdict(self, step: SpecStep, logits: torch.Tensor, sampling: SamplingInputs,
                           bitmask: torch.Tensor | None, extra_counts: torch.Tensor | None
                           ) -> tuple[Verdict, SampleOutput]:
        """Draft-model proposals with sampled rows: rejection sampling against the draft's
        distributions (greedy rows' are point masses, which it treats exactly), keyed by
        each query's output index as plain decoding's draws are. The output's logprobs are
        those of each query's emitted token."""
        spec = self.spec
        probs, raw = self.sampler.distribution(logits, sampling, bitmask, extra_counts)
        verdict = accept_rejection(spec.per_row(step, probs), step.proposal.probs, step.proposal.tokens,
                                   step.proposal.count, spec.per_row(step, sampling.noise_key),
                                   self.sampler.token_hash)
        emitted = verdict.tokens[step.token_row, step.token_offset]
        return verdict, self.sampler.with_logprobs(raw, emitted, sampling)

    def _cascade_plan(self, batch: ScheduledBatch) -> CascadePlan | None:
        """Groups for a plain decode step (host facts only: the rows' tree paths and slots)."""
        if self.cascade is None or not batch.is_decode or batch.is_verify:
            return None
        plan = plan_cascade(batch.reqs, self.cascade, self.cascade_memo, batch.tree_splits)
        if plan is not None:
            self.cascade_steps += 1
            self.cascade_rows += len(plan.group_rows)
        return plan

    def _graph_bucket(self, batch: ScheduledBatch, cascade: CascadePlan | None) -> int | None:
        if self.graphs is None or not batch.is_decode or batch.size > self.graphs.max_batch:
            return None
        if cascade is not None and not self.graphs.has_cascade(self.graphs.bucket(batch.size)):
            return None
        return self.graphs.bucket(batch.size)

    def _prefill_bucket(self, batch: ScheduledBatch) -> PrefillBucket | None:
        return self.prefill_graphs.bucket(batch) if self.prefill_graphs is not None else None

    def _replay_prefill(self, batch: ScheduledBatch, bucket: PrefillBucket, fields: dict[str, Sequence[int]],
                        dev: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """The sampled rows' logits and slots of a graphed prefill step (on the forward stream)."""
        self._write_cached_prefixes(fields, dev)  # the graph's attention reads them
        logits = self.prefill_graphs.replay(bucket, batch.step % self.stager.depth)
        n = len(batch.sample_rows)
        return logits[:n], dev["sample_slots"][:n]

    def _write_cached_prefixes(self, fields: dict[str, Sequence[int]], dev: dict[str, torch.Tensor]) -> None:
        """Rows reusing cached prefixes: their table rows, on the forward stream before the attention."""
        if fields["cached_locs"]:
            self.table.write_prefixes_on_device(dev["cached_req_slots"], dev["cached_lens"],
                                                dev["cached_locs"], len(fields["cached_locs"]))

    def _eager_logits(self, batch: ScheduledBatch, fields: dict[str, Sequence[int]], dev: dict[str, torch.Tensor]
                      ) -> tuple[torch.Tensor | None, PromptLogprobs | None]:
        """The sampled rows' logits, and the prompt logprobs of the scored prefill rows."""
        input_ids = self._input_ids(batch, dev)
        self._write_cached_prefixes(fields, dev)
        self.table.write_on_device(dev["token_req_slots"], dev["positions"], dev["out_cache_loc"])
        fb = ForwardBatch(
            input_ids=input_ids, positions=dev["positions"], out_cache_loc=dev["out_cache_loc"],
            req_slots=dev["req_slots"], seq_lens=dev["seq_lens"], prefix_lens=dev["prefix_lens"],
            qo_indptr=dev["qo_indptr"], req_to_token=self.table.table,
            host_req_slots=fields["req_slots"], host_seq_lens=fields["seq_lens"],
            host_extend_lens=[r.num_new for r in batch.rows], is_decode=batch.is_decode,
            max_seq_len=max(fields["seq_lens"]), cascade=staged_inputs(fields, dev, self.cascade))
        hidden = self.model(fb, self.kv, self.backend)
        if self.spec is not None and self.spec.draft is not None:
            self.spec.draft.mirror(fb)  # the draft's KV is valid wherever the target's is
        prompt = None
        if fields["prompt_lp_token_idx"]:
            k = max(r.req.params.prompt_logprobs for r in batch.rows if r.prompt_logprobs is not None)
            prompt = compute_prompt_logprobs(hidden, dev["prompt_lp_token_idx"], dev["prompt_lp_targets"], k,
                                             self.model.compute_logits, self.sampler.vocab_size)
        if not batch.sample_rows:
            return None, prompt
        return self.model.compute_logits(hidden[dev["sample_token_idx"]]), prompt

    def _input_ids(self, batch: ScheduledBatch, dev: dict[str, torch.Tensor]) -> torch.Tensor:
        """Prefill ids come staged from the host; decode ids from the FutureMap."""
        if batch.is_decode:
            return self.future_map.resolve(dev["decode_slots"])
        ids = dev["input_ids"]
        if len(dev["decode_token_idx"]):
            ids[dev["decode_token_idx"]] = self.future_map.resolve(dev["decode_slots"])
        return ids

    def admit(self, req: Request) -> None:
        """The scheduler's hook for a (re)admitted request. A method, not a closure over the
        engine: no reference cycle, so a dropped engine is freed at once, even when frozen."""
        self.start_request(req.slot, req.prompt_token_ids, req.params, req.output_token_ids, req.seed)

    def stash_last_tokens(self, slots: list[int], token_ids: list[int]) -> None:
        """Host-known next decode inputs into the FutureMap (a failed step's rows, resynced)."""
        with self.streams.use(self.streams.forward):  # ordered before the retry's reads
            self.future_map.stash(device_int64(slots, self.streams.device), device_int64(token_ids, self.streams.device))

    def start_request(self, slot: int, prompt_ids: Sequence[int], params: SamplingParams,
                      outputs: list[int], seed: int = 0) -> None:
        """Reset per-slot sampling state; on the forward stream so it orders before sampling."""
        if self.mirror is not None:
            self.mirror.admit(slot, prompt_ids, params, outputs, seed)
        if self.spec is not None:
            with self.streams.use(self.streams.forward):  # ordered before the prefill's sample
                self.spec.admit(slot, device_int64([*prompt_ids, *outputs], self.streams.device), len(prompt_ids),
                                params.temperature, seed)
        if not params.uses_penalties:
            return
        with self.streams.use(self.streams.forward):
            self.sampler.start_request(slot, prompt_ids, params)
            if outputs:  # a preempted request brings its earlier outputs back
                ids = device_int64(outputs, self.streams.device)  # async: no host sync
                self.sampler.record(torch.full_like(ids, slot), ids)


def _metadata(batch: ScheduledBatch) -> dict[str, Sequence[int]]:
    """Every integer the step's device work needs, as host lists or int64 arrays (staged in one copy)."""
    input_ids, locs, lengths = [], [], []
    req_slots, seq_lens, prefix_lens, qo_indptr = [], [], [], [0]
    decode_idx, decode_slots, sample_idx, sample_slots = [], [], [], []
    lp_idx, lp_targets = [], []  # prompt logprobs: scored rows (flat token index) and their tokens
    for row in batch.rows:
        slot, start, n = row.req.slot, row.start, len(row.kv_slots)
        if row.prefill_ids is None:
            decode_idx.append(len(input_ids))
            decode_slots.append(slot)
            input_ids.append(0)
        else:
            if row.prompt_logprobs is not None:
                a, b = row.prompt_logprobs
                lp_idx += range(len(input_ids) + a - start, len(input_ids) + b - start)
                lp_targets += row.req.prompt_token_ids[a + 1:b + 1]
            input_ids += row.prefill_ids
        locs += row.kv_slots
        lengths.append(n)
        req_slots.append(slot)
        seq_lens.append(start + n)
        prefix_lens.append(start)
        qo_indptr.append(qo_indptr[-1] + n)
        if row.sample_index is not None:
            sample_idx.append(len(input_ids) - 1)
            sample_slots.append(slot)
    positions, token_req = ragged_columns(prefix_lens, lengths, req_slots)
    return {"input_ids": input_ids, "positions": positions, "out_cache_loc": locs,
            "token_req_slots": token_req, "req_slots": req_slots, "seq_lens": seq_lens,
            "prefix_lens": prefix_lens, "qo_indptr": qo_indptr, "decode_token_idx": decode_idx,
            "decode_slots": decode_slots, "sample_token_idx": sample_idx, "sample_slots": sample_slots,
            **_cached_prefix_fields(batch.rows), "prompt_lp_token_idx": lp_idx, "prompt_lp_targets": lp_targets}


def _cached_prefix_fields(rows: list) -> dict[str, list[int]]:
    """The table rows of prefixes reused from the cache: written before the step's attention."""
    locs, req_slots, lens = [], [], []
    for row in rows:
        if row.cached_prefix is not None:
            locs += row.cached_prefix
            req_slots.append(row.req.slot)
            lens.append(len(row.cached_prefix))
    return {"cached_locs": locs, "cached_req_slots": req_slots, "cached_lens": lens}


def _decode_metadata(batch: ScheduledBatch, bucket: int) -> dict[str, list[int]]:
    """A decode step's inputs in the CUDA-graph layout, padded to `bucket` rows with zeros
    (request slot 0, position 0, KV slot 0, length 0: harmless padding). Decode columns give
    three of the four fields as they are."""
    cols = batch.columns
    pad = [0] * (bucket - len(cols))
    fields = {
        "req_slots": [req.slot for req in cols.reqs] + pad,
        "positions": cols.positions + pad,
        "out_cache_loc": cols.kv_locs + pad,
        "seq_lens": [p + 1 for p in cols.positions] + pad,
    }
    assert tuple(fields) == DECODE_FIELDS
    return fields


def _verify_metadata(batch: ScheduledBatch, bucket: int | None) -> dict[str, list[int]]:
    """A verify step's host facts: per row its slot, k, prompt length and seed; the (slot,
    position, KV slot) entries reserved this step; ragged layout: per query token its row and
    offset. With a `bucket` (graphed) the graph's fields come first, padded (slot 0, k 0)."""
    rows = batch.rows
    pad = [0] * (bucket - len(rows)) if bucket is not None else []
    fields = {"req_slots": [r.req.slot for r in rows] + pad, "k_rows": [r.spec_k for r in rows] + pad}
    assert bucket is None or tuple(fields) == VERIFY_FIELDS
    reserved_req, reserved_pos, reserved_locs = [], [], []
    for row in rows:
        reserved_req += [row.req.slot] * len(row.kv_slots)
        reserved_pos += range(row.reserved_from, row.reserved_from + len(row.kv_slots))
        reserved_locs += row.kv_slots
    fields.update({"prompt_lens": [len(r.req.prompt_token_ids) for r in rows],
                   "seeds": [seed_to_int64(r.req.seed) for r in rows], "reserved_req_slots": reserved_req,
                   "reserved_positions": reserved_pos, "reserved_locs": reserved_locs})
    if bucket is None:
        token_row, token_offset = [], []
        for i, row in enumerate(rows):
            token_row += [i] * (row.spec_k + 1)
            token_offset += range(row.spec_k + 1)
        fields.update({"token_row": token_row, "token_offset": token_offset})
    return fields


def _greedy_only(sampling: SamplingInputs) -> bool:
    return (sampling.all_greedy and not sampling.need_penalties and not sampling.need_bias
            and sampling.max_logprobs is None)
