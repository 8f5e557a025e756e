"""Verify steps as CUDA graphs: one per (batch-size bucket, staging ring slot).

A graphed verify step has a fixed shape: every row scores k + 1 query tokens (its last token
and k proposal slots) whatever its own k_row; the queries past k_row write their KV to the
dummy slot 0 and their samples are never emitted (the verdict accepts at most k_row). The
captured work is the proposal (n-gram over the device history), the inputs, positions and KV
locations, the forward and the logits; the slots reserved this step are written into the
table before the replay, and sampling and the verdict run after it, as for decode graphs.
Padding rows use request slot 0, k_row 0: they read the padding row and write slot 0.

Two layouts of the same queries: buckets up to `extend_max_rows` run each row's k + 1 queries
as new tokens after its cache (`fixed_extend_batch`: one extend attention launch a layer),
larger ones as one decode row per query (`query_rows_batch`). On the H200 at one row, 512
cached tokens, the extend layout's forward took 0.89x the other's at k 4 and 0.85-0.89x at
k 7-15 (docs/benchmarks.md, session 34); at more rows it lost in session 7 (older kernels).

A second set (`queries=1`) runs the verify steps where no row proposes (the step after a
verify, when the host's guess finds no match: the lengths are still on the device only):
one query a row, the cost of a plain decode step instead of k + 1 queries' (on an H100 a
k 15 step with no proposal took 1.35 ms of GPU against 0.68 for a plain step, 10 of 59 steps
of the copy task). Its result has the same packed rows (k + 3 ints: no proposal, no acceptance).
"""
from __future__ import annotations

import logging

import torch

from tandem.cuda_graph import capture_all, warm_and_capture
from tandem.forward_batch import fixed_extend_batch, query_rows_batch
from tandem.speculative.state import SpecState, SpecStep
from tandem.speculative.verify import Verdict

log = logging.getLogger("tandem")


def settle(spec: SpecState, future_map, step: SpecStep, slots: torch.Tensor, verdict: Verdict) -> torch.Tensor:
    """After the verdict (from the target's samples or the rejection step): the new lengths
    and history, each row's last emitted token relayed to the next step. Returns the packed
    result: row b is [accepted, proposed, tokens[0..k]], it emits tokens[:accepted + 1]."""
    accepted, tokens = spec.finish(step, slots, verdict)
    future_map.stash(slots, tokens.gather(1, accepted[:, None]).squeeze(1))
    return torch.cat([accepted[:, None], step.proposal.count[:, None], tokens], dim=1).flatten()


def query_inputs(spec: SpecState, step: SpecStep, last: torch.Tensor, slots: torch.Tensor, k_rows: torch.Tensor,
                 table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A fixed-shape step's query tokens: (ids, positions, KV locations), each [B * q] int64.
    On CUDA one launch (`tandem.kernels.verify_inputs`); this torch form elsewhere, and the
    kernel's reference."""
    if slots.is_cuda:
        from tandem.kernels.verify_inputs import verify_inputs  # triton is optional: imported where it runs
        queries = step.token_row.shape[0] // slots.shape[0]
        return verify_inputs(step.proposal.tokens, last, step.lengths, k_rows, slots, table, queries)
    r, j = step.token_row, step.token_offset
    input_ids, positions = spec.inputs(step, last)
    positions = positions.clamp(min=0)  # padding rows (length 0)
    # Queries past a row's k_row have no reserved slot: their KV goes to the dummy slot.
    live = j <= k_rows[r]
    locs = torch.where(live, table[slots[r], positions.clamp(max=table.shape[1] - 1)].to(torch.int64), 0)
    return input_ids, positions, locs


# The fixed fields a graph reads from the staging ring, in this order at the ring slot's start.
VERIFY_FIELDS = ("req_slots", "k_rows")


class VerifyGraphs:
    def __init__(self, model, kv, table, backend, future_map, streams, stager, spec: SpecState,
                 buckets: list[int], max_seq_len: int, capture: bool = True, extend_max_rows: int = 1,
                 queries: int | None = None):
        self.model, self.kv, self.table, self.backend = model, kv, table, backend
        self.future_map, self.streams, self.stager, self.spec = future_map, streams, stager, spec
        self.buckets, self.max_seq_len, self.k = buckets, max_seq_len, spec.k
        self.use_graphs = capture  # False: the same fixed-shape work, run eagerly (CPU tests)
        self.extend_max_rows = extend_max_rows  # Experiments.verify_extend_max_rows
        # Query tokens a row: k + 1, or 1 for the steps where no row proposes (`queries=1`).
        self.q = self.k + 1 if queries is None else queries
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.outputs: dict[tuple[int, int], tuple[torch.Tensor, SpecStep]] = {}
        self.tails: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        # Host-side views reused across steps (captured graphs only: their inputs and outputs
        # sit at fixed addresses for the graphs' lifetime, so a view made once stays valid):
        # ring slot views by (ring, bucket); trimmed outputs by (bucket, ring, rows).
        self._views: dict[tuple[int, int], dict[str, torch.Tensor]] = {}
        self._trimmed: dict[tuple[int, int, int], tuple[torch.Tensor, SpecStep]] = {}
        self.memory_bytes = 0
        dev, q = streams.device, self.q
        # The debug FutureMap's device assert cannot be captured: its gather runs eagerly.
        self.resolve_in_graph = not future_map.debug
        self.last_tokens = {b: torch.zeros(b, dtype=torch.int64, device=dev) for b in buckets}
        rows = {b: torch.arange(b, device=dev) for b in buckets}
        self.token_row = {b: rows[b].repeat_interleave(q) for b in buckets}
        self.token_offset = {b: torch.arange(q, device=dev).repeat(b) for b in buckets}
        # One logits buffer for every graph; replays and the sampling reading them are all on
        # the forward stream, so a replay never overwrites logits still to be read.
        self.logits = torch.empty(self.max_batch * q, model.config.vocab_size, dtype=torch.float32, device=dev)

    @property
    def max_batch(self) -> int:
        return self.buckets[-1]

    def bucket(self, batch_size: int) -> int:
        return next(b for b in self.buckets if b >= batch_size)

    def forward(self, views: dict[str, torch.Tensor], bucket: int) -> tuple[torch.Tensor, SpecStep]:
        """The captured work: logits [bucket * (k + 1), V] and the step's device facts."""
        slots, k_rows = views["req_slots"], views["k_rows"]
        r, j = self.token_row[bucket], self.token_offset[bucket]
        last = self.future_map.resolve(slots) if self.resolve_in_graph else self.last_tokens[bucket]
        # The one-query set runs only steps where no row proposes (`_verify_graphs_for`): its
        # proposal is empty by construction, so it skips the search.
        prepare = self.spec.prepare_unproposed if self.q == 1 else self.spec.prepare
        step = prepare(slots, k_rows, r, j, last, self.max_seq_len)
        # Ordering: the table entries reserved for this step were written before the replay on
        # this (forward) stream (`ModelRunner` via `write_on_device`), so the locations see them.
        input_ids, positions, locs = query_inputs(self.spec, step, last, slots, k_rows, self.table.table)
        # Dead queries' lengths are clamped into the table; what they read is never used.
        if bucket <= self.extend_max_rows and self.q > 1:
            fb = fixed_extend_batch(input_ids, positions, locs, slots, self.q, self.table.table, self.max_seq_len)
        else:
            rows = slots if self.q == 1 else slots[r]  # each query's request slot (r is 0..B-1 at one query)
            fb = query_rows_batch(input_ids, positions, locs, rows, self.table.table, self.max_seq_len)
        hidden = self.model(fb, self.kv, self.backend)
        logits = self.model.compute_logits(hidden, out=self.logits[:bucket * self.q])
        return logits, step

    @torch.no_grad()
    def capture(self) -> None:
        if not self.use_graphs:
            return
        forward = self.streams.forward

        def one(ring: int, bucket: int, views: dict[str, torch.Tensor], pool) -> None:
            graph, (logits, step) = warm_and_capture(lambda: self.forward(views, bucket), pool, forward)
            self.graphs[(bucket, ring)] = graph
            self.outputs[(bucket, ring)] = (logits, step)
            # The tail reads the forward graph's outputs at their fixed addresses: a replay makes
            # them real before the tail's warm-up reads them (all padding rows, slot 0).
            with torch.cuda.stream(forward):
                graph.replay()
            self.tails[(bucket, ring)] = warm_and_capture(
                lambda: self.greedy_tail(logits, step, views["req_slots"]), pool, forward)
        self.memory_bytes = capture_all(self.streams, self.buckets, self.stager.depth, self.views, one)
        log.info("captured %d verify graphs and their greedy tails (buckets up to %d, k=%d, %d queries a row) "
                 "using %.0f MiB", len(self.graphs), self.max_batch, self.k, self.q, self.memory_bytes / 2**20)

    def views(self, ring: int, bucket: int) -> dict[str, torch.Tensor]:
        """The graph's inputs in staging ring slot `ring` (the stager's device buffers live as
        long as it does, so the views are made once per (ring, bucket))."""
        views = self._views.get((ring, bucket))
        if views is None:
            views = self._views[(ring, bucket)] = self.stager.views(ring, {name: bucket for name in VERIFY_FIELDS})
        return views

    def replay(self, bucket: int, ring: int) -> tuple[torch.Tensor, SpecStep]:
        """Queue the step on the current (forward) stream; returns its logits and facts."""
        if not self.resolve_in_graph:
            self.last_tokens[bucket].copy_(self.future_map.resolve(self.views(ring, bucket)["req_slots"]))
        if not self.use_graphs:
            return self.forward(self.views(ring, bucket), bucket)
        self.graphs[(bucket, ring)].replay()
        return self.outputs[(bucket, ring)]

    def trimmed(self, bucket: int, ring: int, rows: int, logits: torch.Tensor,
                step: SpecStep) -> tuple[torch.Tensor, SpecStep]:
        """The first `rows` rows of the step `replay(bucket, ring)` returned (`logits`, `step`):
        their logits [rows * (k + 1), V] and facts. A captured graph's outputs keep their
        addresses until `close`, so its views are made once per (bucket, ring, rows) and reused
        (no step mutates a SpecStep); eager outputs are new each step and are cut each time."""
        key = (bucket, ring, rows)
        out = self._trimmed.get(key) if self.use_graphs else None
        if out is None:
            t = rows * self.q
            out = logits[:t], SpecStep(step.lengths[:rows], step.proposal.rows(rows), step.token_row[:t],
                                       step.token_offset[:t])
            if self.use_graphs:
                self._trimmed[key] = out
        return out

    def greedy_tail(self, logits: torch.Tensor, step: SpecStep, slots: torch.Tensor) -> torch.Tensor:
        """A greedy-only step's sampling and settling, fixed-shape: packed [bucket * (k + 3)].
        No penalty counts: a greedy-only step has no row with penalties, and a request with
        them resets its slot's counts when admitted."""
        sampled = logits.argmax(dim=-1)
        # Ordering: on the forward stream after the forward; it reads the step's gathered
        # `lengths` (not `length`, which it overwrites), and the next step's `prepare` reads
        # what it writes in stream order (docs/async-model.md, "Device state").
        if sampled.is_cuda:  # one launch instead of ~25 small ones (tandem.kernels.spec_settle)
            from tandem.kernels.spec_settle import settle_greedy  # triton is optional: imported where it runs
            return settle_greedy(sampled, self.q, step.proposal.tokens, step.proposal.count, step.lengths, slots,
                                 self.spec.history, self.spec.length, self.future_map.stash_buffers())
        return settle(self.spec, self.future_map, step, slots, self.spec.point_mass_verdict(step, sampled))

    def replay_tail(self, bucket: int, ring: int, rows: int, logits: torch.Tensor, step: SpecStep) -> torch.Tensor:
        """Queue the greedy tail of the step `replay(bucket, ring)` just queued (its untrimmed
        `logits` and `step`, which a captured tail reads at their fixed addresses): packed
        results of the first `rows` rows."""
        if self.use_graphs:
            graph, packed = self.tails[(bucket, ring)]
            graph.replay()
        else:
            packed = self.greedy_tail(logits, step, self.views(ring, bucket)["req_slots"])
        return packed[:rows * (self.k + 3)]

    def close(self) -> None:
        for graph in self.graphs.values():
            graph.reset()
        for graph, _ in self.tails.values():
            graph.reset()
        self.graphs.clear()
        self.tails.clear()
        self.outputs.clear()
        self._views.clear()
        self._trimmed.clear()
        self.logits = None
