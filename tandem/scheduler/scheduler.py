"""Admission (FCFS or longest-prefix-match first), prefix reuse, chunked prefill, decode of
all running requests, preemption by recompute.

The scheduler only does host bookkeeping. It never reads a device value: under overlap the
newest sampled token of every request is still on the GPU when the next step is planned.
KV slots come from the prefix cache, which evicts unused cached prefixes before the
scheduler considers preempting a running request.
"""
import itertools
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

from tandem.memory.allocator import SlotAllocator
from tandem.memory.prefix_cache import Hold, PrefixCache
from tandem.request import PROMPT_HASH_BLOCK, Request, Status
from tandem.scheduler.batch import DecodeColumns, Row, ScheduledBatch

if TYPE_CHECKING:  # the engine builds the planner; the scheduler only calls it
    from tandem.speculative.planner import VerifyPlanner


@dataclass
class SchedulerConfig:
    max_running_requests: int
    max_prefill_tokens: int
    chunked_prefill_size: int | None
    enable_mixed_batch: bool
    schedule_policy: str = "fcfs"  # or "lpm": longest cached prefix first
    # Table entries of reused prefixes one step may write (they travel in the staging buffer).
    max_reused_tokens_per_step: int = 1 << 16
    # Mixed batches, decode first: prefill tokens a step may carry beside its decodes. None:
    # one chunk (chunked_prefill_size) less the decodes. A step without decodes gets
    # max_prefill_tokens either way.
    mixed_prefill_budget: int | None = None
    # Separate batches: prefill-only steps in a row while requests wait to decode (see
    # Scheduler._decode_turn for why one).
    max_prefill_steps_between_decodes: int = 1
    # Separate batches: while requests decode, a prefill step is sized (from the measured
    # pace) to take about this long: the longest a running stream waits for a token.
    prefill_step_target_s: float = 0.5
    # A running request whose every sample is launched leaves its running place to an
    # admission before its finish is processed (`Scheduler._free_places`). Off: admissions wait
    # for the finish (Experiments.admit_beside_leaving).
    admit_beside_leaving: bool = True
    # Host tier: the first this many requests a plan holds for their prefetch loads keep a
    # running place (Experiments.host_kv_held_places).
    held_places: int = 0


# Request slots beyond max_running_requests: an admission beside a leaving request takes one
# while the leaving one still holds its own (the steps in flight read its table row, relay
# and penalty state until they complete).
MAX_SPARE_REQUEST_SLOTS = 8


def request_slot_count(max_running_requests: int) -> int:
    """Request slots (rows of the request->token table, the relay, the sampler's per-request
    state) an engine of `max_running_requests` keeps."""
    return max_running_requests + min(max_running_requests, MAX_SPARE_REQUEST_SLOTS)


@dataclass
class _Journal:
    """What one `schedule()` changed, so that a plan that never launched can be given back."""

    step: int
    prefill_steps_in_a_row: int  # the count before this plan
    kv_slots: list[int] = field(default_factory=list)  # allocated for the plan's rows
    admitted: list[Request] = field(default_factory=list)
    # (row, the request's last_step before, its len(kv_slots) before)
    committed: list[tuple[Row, int, int]] = field(default_factory=list)
    # A plan of decode columns, committed as columns: the columns, and per row the request's
    # last_step and len(kv_slots) before.
    decode: DecodeColumns | None = None
    decode_last_steps: list[int] = field(default_factory=list)
    decode_kv_lens: list[int] = field(default_factory=list)


@dataclass
class _Ahead:
    """A prefill step planned while the step before it was in flight (`Scheduler.plan_ahead`),
    until `schedule` takes it or something it assumed changes."""

    batch: ScheduledBatch
    journal: _Journal


class PrefillPace:
    """Seconds per prefill token, measured from a prefill-only step's plan to its completion
    (the scheduler sees no device time; this latency is what a waiting stream sees)."""

    MIN_TOKENS = 256  # the smallest step it sizes: below, the per-step fixed cost dominates
    MEASURED_TOKENS = 64  # steps this small or smaller are not measured (mostly fixed cost)

    def __init__(self, clock: Callable[[], float]):
        self.clock = clock
        self.seconds_per_token: float | None = None
        self._planned: dict[int, tuple[float, int]] = {}  # step -> (plan time, prefill tokens)

    def planned(self, step: int, tokens: int) -> None:
        if tokens > self.MEASURED_TOKENS:
            self._planned[step] = (self.clock(), tokens)  # a retried step number overwrites

    def forget(self, step: int) -> None:
        self._planned.pop(step, None)  # never launched: nothing to measure

    def completed(self, step: int) -> None:
        now = self.clock()
        for s in [s for s in self._planned if s <= step]:
            start, tokens = self._planned.pop(s)
            rate = (now - start) / tokens
            old = self.seconds_per_token
            self.seconds_per_token = rate if old is None else (old + rate) / 2

    def tokens_within(self, seconds: float, most: int) -> int:
        """Prefill tokens one step can carry in about `seconds`; MIN_TOKENS until measured."""
        if self.seconds_per_token is None:
            return min(most, self.MIN_TOKENS)  # a first step that measures the pace
        return max(min(most, int(seconds / max(self.seconds_per_token, 1e-9))), min(most, self.MIN_TOKENS))


SCHEDULE_POLICIES = ("fcfs", "lpm")
# Above this many waiting requests, lpm falls back to fcfs: matching each one costs host time.
LPM_MAX_WAITING = 128
# A waiting request that shares at least one more block of prompt tokens with a prompt being
# prefilled than that prompt has cached waits for the prefill instead of computing them again.
SHARED_PREFILL_MIN_TOKENS = PROMPT_HASH_BLOCK


class Scheduler:
    def __init__(self, cfg: SchedulerConfig, cache: PrefixCache, req_slots: SlotAllocator,
                 on_admit: Callable[[Request], None], clock: Callable[[], float] = time.monotonic,
                 verify: "VerifyPlanner | None" = None):
        if cfg.schedule_policy not in SCHEDULE_POLICIES:
            raise ValueError(f"schedule_policy must be one of {', '.join(SCHEDULE_POLICIES)}; "
                             f"got {cfg.schedule_policy!r}")
        if cfg.mixed_prefill_budget is not None and cfg.mixed_prefill_budget < 1:
            # 0 would never admit a request while any decodes: the queue would starve.
            raise ValueError(f"mixed_prefill_budget must be at least 1 or None; got {cfg.mixed_prefill_budget}")
        if cfg.max_prefill_steps_between_decodes < 1:
            raise ValueError("max_prefill_steps_between_decodes must be at least 1")
        self.cfg = cfg
        self.cache, self.req_slots = cache, req_slots
        self.on_admit = on_admit  # engine hook: reset per-slot device state (penalties)
        self.verify = verify  # speculative decoding: plans decode steps as verify steps
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._deferred: list[Request] = []  # finished, but queued GPU work may still read their KV
        self.num_preemptions = 0
        self._journal: _Journal | None = None  # the last plan's changes, until the next plan
        self._ahead: _Ahead | None = None  # the next step, planned early (plan_ahead)
        self.steps_planned_ahead = 0
        self._prefill_left = False  # the last pass over the running found prompts still prefilling
        self._prefill_steps_in_a_row = 0  # planned steps without a decode row since the last with one
        self.prefill_pace = PrefillPace(clock)

    # ---- queue ----
    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting) or any(not r.finished for r in self.running)

    def prepare_waiting(self) -> int:
        """While the host waits for the step in flight: the per-prompt work the next plans'
        admission scan would do for the requests at the queue's head, done once each (a
        prompt's block hashes: ~0.16 ms for 10k tokens on the CPU box), so that a plan after a
        short step does not pay it between two forwards. Returns how many were prepared."""
        if not self.cache.enabled:
            return 0
        prepared = 0
        for req in itertools.islice(self.waiting, self.cfg.max_running_requests):
            if "prompt_block_hashes" not in req.__dict__:  # a cached_property, computed once
                req.prompt_block_hashes  # noqa: B018 (computed for later)
                prepared += 1
        return prepared

    def finish(self, req: Request, completed_step: int) -> None:
        """Take a finished request out; its KV is released once no launched step can read it."""
        if self._ahead is not None and any(row.req is req for row in self._ahead.batch.rows):
            self._drop_ahead()  # it planned this request's rows: undone before the request leaves
        if req in self.waiting:
            self.waiting.remove(req)
        if req.slot == 0:
            return
        if req.last_step <= completed_step:
            self._release(req)
        else:
            self._deferred.append(req)

    def kv_holders(self) -> list[Request]:
        """Requests holding KV slots: running, or finished with their release deferred."""
        return list({id(r): r for r in self.running + self._deferred if r.slot != 0}.values())

    def on_step_completed(self, step: int) -> None:
        """Every step up to `step` finished on the device: free what only they could read."""
        self.prefill_pace.completed(step)
        still = []
        for req in self._deferred:
            (self._release(req) if req.last_step <= step else still.append(req))
        self._deferred = still

    def _release(self, req: Request) -> None:
        self.cache.cache_and_free(req)  # one-step lag: no launched step can touch its KV any more
        self.req_slots.free([req.slot])
        req.slot = 0
        if req in self.running:
            self.running.remove(req)

    # ---- planning a step ----
    def schedule(self, step: int, process_in_flight: Callable[[], None]) -> ScheduledBatch | None:
        """Plan the next step. `process_in_flight` processes the in-flight result; called only when
        memory runs out and preemption may be needed (preempting needs every token known).

        Transactional: if planning raises, everything it admitted or allocated is given back;
        if the plan's launch fails, `rollback` gives it back."""
        ahead = self._take_ahead(step)
        if ahead is not None:
            return ahead
        self._journal = _Journal(step, self._prefill_steps_in_a_row)
        self.cache.new_step()
        try:
            rows = self._plan(step, process_in_flight)
            if not rows and self.has_work():
                process_in_flight()  # results may finish requests or free memory
                rows = self._plan(step, process_in_flight)
                # Partial prefills can hold all memory between them: recompute the newest.
                while not rows and len(self.running) > 1:
                    self._preempt(self.running[-1])
                    rows = self._plan(step, process_in_flight)
            self._commit(rows, step)
            batch = _batch(step, rows, tree_splits=self.cache.tree.splits)
            self._count_prefill_steps(batch)
        except BaseException:
            self.rollback(step)
            raise
        return batch if rows else None

    def rollback(self, step: int) -> None:
        """Undo the plan of `step` (its launch failed, or planning itself did): as if it was
        never planned. Its requests keep their earlier state; those it admitted wait again at
        the queue's head. Lifetime: nothing launched wrote the plan's KV slots, so they are
        free at once (a partly queued forward's writes are ordered before any later reader)."""
        self._drop_ahead()  # planned after this plan, on top of it: undone first
        journal, self._journal = self._journal, None
        assert journal is not None and journal.step == step, "rollback of a plan that is not the last"
        self._undo(journal)

    def plan_ahead(self, step: int) -> ScheduledBatch | None:
        """While the host waits for the step in flight, plan step `step` now if it will be a
        prefill-only step (separate batches, no decode turn due, prompts to prefill): its
        admissions, prefix matches, host-tier loads and slots then cost nothing between the
        decode step just launched and the prefill, where only that short decode covers the
        host. Nothing here needs the unread results: prefill rows read no sampled token, and
        slots those results free serve the plans after this one. `schedule(step)` takes the
        plan; `finish` of one of its requests or a `rollback` undoes it, as a plan that never
        launched. Returns the step planned, or None."""
        if self._ahead is not None or self.cfg.enable_mixed_batch or self._decode_turn():
            return None
        if not self.waiting and not self._prefill_left:  # the steady decode: no pass over the running
            return None
        started = time.perf_counter()
        journal = _Journal(step, self._prefill_steps_in_a_row)
        outer, self._journal = self._journal, journal  # the plan in flight's journal is kept
        try:
            rows = self._prefill_ahead_rows()
            self._commit(rows, step)
        except BaseException:
            self._undo(journal)
            raise
        finally:
            self._journal = outer
        if not rows:
            self._undo(journal)  # an empty plan: the counters it reset go back
            return None
        ms = (time.perf_counter() - started) * 1e3
        self._ahead = _Ahead(ScheduledBatch(step=step, rows=rows, planned_ahead_ms=ms,
                                            tree_splits=self.cache.tree.splits), journal)
        self.steps_planned_ahead += 1
        return self._ahead.batch

    def _prefill_ahead_rows(self) -> list[Row]:
        """`_plan`'s separate-batch prefill branch, without the decode fallback."""
        prefilling, _ = self._prune_running()
        if not (self.waiting or prefilling):
            return []
        self.cache.new_step()
        return self._separate_prefill_rows(prefilling)

    def _take_ahead(self, step: int) -> ScheduledBatch | None:
        ahead = self._ahead
        if ahead is None:
            return None
        if ahead.batch.step != step:  # a step number retried since: plan it afresh
            self._drop_ahead()
            return None
        self._ahead, self._journal = None, ahead.journal
        self._count_prefill_steps(ahead.batch)
        return ahead.batch

    def _drop_ahead(self) -> None:
        ahead, self._ahead = self._ahead, None
        if ahead is not None:
            self._undo(ahead.journal)

    def _undo(self, journal: _Journal) -> None:
        step = journal.step
        self._prefill_steps_in_a_row = journal.prefill_steps_in_a_row
        self.prefill_pace.forget(step)
        if journal.decode is not None:
            for req, last_step, kv_len in zip(journal.decode.reqs, journal.decode_last_steps, journal.decode_kv_lens):
                del req.kv_slots[kv_len:]
                req.num_computed -= 1
                req.num_scheduled_samples -= 1
                req.last_step = last_step
        for row, last_step, kv_len in reversed(journal.committed):
            req = row.req
            del req.kv_slots[kv_len:]
            req.num_computed -= row.num_new if row.spec_k is None else 1
            req.spec_extra -= row.spec_k or 0
            if row.sample_index is not None:
                req.num_scheduled_samples -= 1
            if row.cached_prefix is not None:
                req.table_pending = len(row.cached_prefix)
            req.last_step = last_step
        self.cache.kv_slots.free(journal.kv_slots)
        for req in reversed(journal.admitted):  # each may have got part-way through _admit
            if req in self.running:
                self.running.remove(req)
            if req.slot:
                self.req_slots.free([req.slot])
            self.cache.undo_admit(req)
            req.slot, req.num_computed = 0, 0
            if req.finished:
                continue  # finished meanwhile (an abort undid a plan made ahead): not queued again
            req.status = Status.WAITING
            if req not in self.waiting:
                self.waiting.appendleft(req)

    def _plan(self, step: int, process_in_flight: Callable[[], None]) -> "list[Row] | DecodeColumns":
        """The step's rows; a plain decode step's as columns."""
        prefilling, decoding = self._prune_running()
        if self.cfg.enable_mixed_batch:
            decode = self._decode_rows(step, process_in_flight, decoding,
                                       beside_prefill=bool(self.waiting or prefilling))
            if not isinstance(decode, DecodeColumns):
                return decode  # a verify step carries no prefill
            prefill = self._prefill_rows(self._mixed_prefill_budget(len(decode)), prefilling)
            return decode.rows() + prefill if prefill else decode
        if self._decode_turn():
            return (self._decode_rows(step, process_in_flight, decoding)
                    or self._prefill_rows(self.cfg.max_prefill_tokens, prefilling))
        if not (self.waiting or prefilling):  # decode only: skip sizing a prefill step (a scan)
            return self._decode_rows(step, process_in_flight, decoding)
        return self._separate_prefill_rows(prefilling) or self._decode_rows(step, process_in_flight, decoding)

    def _prune_running(self) -> tuple[list[Request], list[Request]]:
        """Drop finished requests from the running list and cache the prompt chunks launched
        in earlier steps (they become reusable); returns the running requests with prefill
        left and those that can decode (`Request.can_decode`). One pass over the running
        requests, the only one a decode-only step makes before its rows: a request whose
        prompt is all cached is skipped (cache_prefill would do nothing for it)."""
        running, prefilling, decoding, caching = [], [], [], self.cache.enabled
        finished, live = Status.FINISHED, Status.RUNNING
        for req in self.running:  # per row per step: no properties (each a call)
            status = req.status
            if status is finished:
                continue
            running.append(req)
            if caching and req.cached_len < req.prefill_target:
                self.cache.cache_prefill(req)
            if req.num_computed < req.prefill_target:
                prefilling.append(req)
            elif status is live and req.num_scheduled_samples < req.max_samples:
                decoding.append(req)
        self.running = running
        self._prefill_left = bool(prefilling)
        return prefilling, decoding

    def _separate_prefill_rows(self, prefilling: list[Request]) -> list[Row]:
        """A prefill-only step (separate batches): its budget, then its rows."""
        return self._prefill_rows(self._separate_prefill_budget(), prefilling)

    def _separate_prefill_budget(self) -> int:
        """A stream decoding beside a burst waits one prefill step (see _decode_turn). Prefill
        steps of max_prefill_tokens take milliseconds on a GPU but seconds on the CPU (the
        built-in model: 8192 tokens, about 20 s), so while requests decode a step carries what
        fits in prefill_step_target_s at the measured pace. On a GPU that is more than
        max_prefill_tokens (no change); on the CPU, a few hundred tokens, where the matmuls
        are already as efficient per token as in bigger steps."""
        most = self.cfg.max_prefill_tokens
        if not any(r.can_decode for r in self.running):
            return most
        return self.prefill_pace.tokens_within(self.cfg.prefill_step_target_s, most)

    def _decode_turn(self) -> bool:
        """Separate batches: after `max_prefill_steps_between_decodes` prefill-only steps, the
        requests that can decode get a step, even while prompts wait. Prefill first without
        this bound lets a burst of arrivals take step after step while every running stream
        gets nothing. One is the bound: each prefill step still batches prompts up to its
        token budget, so a burst takes as many prefill steps as before, and the decode step
        between two is work the running requests need anyway, a small forward next to a full
        prefill one (a few ms on a GPU). The burst's first tokens come that much later; a
        running stream waits one prefill step, not all of them."""
        return (self._prefill_steps_in_a_row >= self.cfg.max_prefill_steps_between_decodes
                and any(r.can_decode for r in self.running))

    def _count_prefill_steps(self, batch: ScheduledBatch) -> None:
        if batch.decode is not None:  # decode rows only, no prefill tokens to pace
            if batch.decode.reqs:
                self._prefill_steps_in_a_row = 0
            return
        rows = batch.rows
        if any(r.prefill_ids is None for r in rows):
            self._prefill_steps_in_a_row = 0
        elif rows:
            self._prefill_steps_in_a_row += 1
        # A mixed step's decodes count as prefill time: the pace errs slow, the steps short.
        # A decode step (is_decode is cached: the runner and the step record read it too) has none.
        prefill_tokens = 0 if batch.is_decode else sum(r.num_new for r in rows if r.prefill_ids is not None)
        self.prefill_pace.planned(batch.step, prefill_tokens)

    def _mixed_prefill_budget(self, num_decodes: int) -> int:
        """Decode first: while requests decode, a step carries all of them plus at most
        `mixed_prefill_budget` prefill tokens, so the step (every decoding request's next
        token) stays short; alone, prefill gets the whole max_prefill_tokens. None: one chunk
        less the decodes, and no more than the measured pace fits in prefill_step_target_s
        (a slow device, as for separate batches); a set budget is exact (GPU sweeps set it)."""
        budget = self.cfg.max_prefill_tokens
        if not num_decodes:
            return budget
        if self.cfg.mixed_prefill_budget is not None:
            return min(budget, self.cfg.mixed_prefill_budget)
        if self.cfg.chunked_prefill_size is not None:
            budget = min(budget, self.cfg.chunked_prefill_size)
        return min(budget - num_decodes, self.prefill_pace.tokens_within(self.cfg.prefill_step_target_s, budget))

    def _commit(self, rows: "list[Row] | DecodeColumns", step: int) -> None:
        if isinstance(rows, DecodeColumns):
            self._commit_decode(rows, step)
            return
        committed = self._journal.committed
        for row in rows:  # per row per step: one loop, no call a row
            req = row.req
            kv_len = len(req.kv_slots)
            committed.append((row, req.last_step, kv_len))
            if row.spec_k is None:
                n = len(row.kv_slots)  # row.num_new, without the property
                if row.start == kv_len:  # the common row: its slots follow the request's
                    req.kv_slots += row.kv_slots
                else:  # a decode row may reuse a slot a verify reserved: then this assigns it in place
                    req.kv_slots[row.start:row.start + n] = row.kv_slots
                req.num_computed += n
            else:  # reserved past the table; the step computes at least its last token
                req.kv_slots.extend(row.kv_slots)
                req.num_computed += 1
                req.spec_extra += row.spec_k
            if row.sample_index is not None:
                req.num_scheduled_samples += 1
            if row.cached_prefix is not None:
                req.table_pending = 0
            req.last_step = step

    def _commit_decode(self, decode: DecodeColumns, step: int) -> None:
        """`_commit` of decode columns: one token a row, journaled as columns."""
        journal = self._journal
        journal.decode = decode
        journal.decode_last_steps = [req.last_step for req in decode.reqs]
        journal.decode_kv_lens = kv_lens = [len(req.kv_slots) for req in decode.reqs]
        for req, start, loc, kv_len in zip(decode.reqs, decode.positions, decode.kv_locs, kv_lens):
            if start == kv_len:  # the common row: its slot follows the request's
                req.kv_slots.append(loc)
            else:  # a slot a verify reserved at this position (the same slot: `_decode_rows`)
                req.kv_slots[start] = loc
            req.num_computed += 1
            req.num_scheduled_samples += 1
            req.last_step = step

    def _decode_rows(self, step: int, process_in_flight: Callable[[], None], decoding: list[Request],
                     beside_prefill: bool = False) -> "list[Row] | DecodeColumns":
        """The decode step's rows: verify rows, or plain rows as columns.
        `decoding`: the running requests that can decode, as `_prune_running` found them.
        Rule: nothing between that scan and this call processes the step in flight or
        preempts (a prefill plan only admits, and its new rows cannot decode yet); processing
        it here scans again."""
        reqs = decoding
        if self.verify is not None and reqs:
            rows = None if beside_prefill else self.verify.plan(reqs, self.cache.available(), self._alloc)
            if rows is not None:
                return rows
            if any(r.spec_extra for r in reqs):  # plain rows need every length: process the verify
                process_in_flight()
                self.running = [r for r in self.running if not r.finished]
                reqs = [r for r in self.running if r.can_decode]
        need = sum(map(_needs_slot, reqs))
        if need > self.cache.available():
            process_in_flight()  # finishes may free enough; if not, nothing is in flight for preemption
            self.running = [r for r in self.running if not r.finished]
            while sum(r.can_decode and _needs_slot(r) for r in self.running) > self.cache.available():
                self._preempt(self.running[-1])
            reqs = [r for r in self.running if r.can_decode]
            need = sum(map(_needs_slot, reqs))
        slots = self._alloc(need)
        if need < len(reqs):  # a slot a verify reserved at the next position is used as it is
            fresh = iter(slots)
            slots = [next(fresh) if _needs_slot(r) else r.kv_slots[r.num_computed] for r in reqs]
        # else every row takes a new slot (no verify reserved one): no second test a row
        return DecodeColumns(reqs, [r.num_computed for r in reqs], slots, [r.num_scheduled_samples for r in reqs])

    def _preempt(self, req: Request) -> None:
        assert not req.spec_extra, "preempting a request whose verify is in flight"
        """Recompute later: keep the known outputs, go back to the queue's head. Its computed KV
        goes to the prefix cache (nothing is in flight: preemption follows processing it), so the
        recompute is only what eviction took meanwhile."""
        self.running.remove(req)
        self.cache.cache_and_free(req)
        self.req_slots.free([req.slot])
        req.slot, req.num_computed = 0, 0
        req.status = Status.WAITING
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def _prefill_rows(self, budget: int, prefilling: list[Request]) -> list[Row]:
        """Chunks of the running prefills (`prefilling`: the plan's scan), then admissions."""
        # Processing the step in flight in this plan may have finished or preempted some since the scan.
        prefilling = [r for r in prefilling if r.status is Status.RUNNING]
        if not prefilling and not self.waiting:
            return []
        rows: list[Row] = []
        reserve = sum(r.can_decode for r in self.running)  # keep room for next decodes
        for req in prefilling:
            row = self._chunk(req, budget, reserve)
            if row is None:
                return rows
            rows.append(row)
            budget -= row.num_new
        if budget <= 0 or not self.waiting:
            return rows
        pending = self._pending_prefixes(prefilling)
        reused = sum(len(r.cached_prefix) for r in rows if r.cached_prefix is not None)
        prefetched = set(map(id, itertools.islice(self.waiting, self.cache.prefetch_requests)))  # its loads
        places = self._free_places()
        held_places = self.cfg.held_places
        for req in self._admission_order():
            if budget <= 0 or places <= 0:
                break
            if self.req_slots.num_free == 0:
                break
            if pending and req.max_cached_prefix and pending.shared_by(req):
                continue  # reuse that prefill once it is cached, a step or two from now
            hold = self.cache.prefetch_hold(req, id(req) in prefetched) if self.running else None
            if hold is Hold.SKIP:
                # Its prefix loads from the host tier beside the running steps first; the ones
                # behind it go ahead meanwhile (bounded: it waits MAX_PREFETCH_WAITS plans at most).
                # A `break` here emptied the batch while the copies ran (H200: 35% more steps).
                if held_places > 0 and id(req) in prefetched:
                    held_places -= 1
                    places -= 1  # kept for it: its load ends within a plan or two
                continue
            if hold is Hold.STOP:
                break  # its turn to be prefetched comes first (`PrefixCache.prefetch_hold`)
            matched = self.cache.admit(req)
            new = req.fill_len - matched
            whole = self.cfg.chunked_prefill_size is None
            if (whole and new > budget and rows) or \
                    self.cache.available() - reserve < min(new, self._chunk_limit(budget)) or \
                    (reused + matched > self.cfg.max_reused_tokens_per_step and rows):
                self.cache.undo_admit(req)  # it waits for a step with room
                break
            reused += matched
            self._admit(req, matched)
            places -= 1
            pending.add(req)
            row = self._chunk(req, budget, reserve)
            rows.append(row)
            budget -= row.num_new
        return rows

    def _free_places(self) -> int:
        """Running places an admission may take: max_running_requests less the running
        requests, not counting those whose every sample is launched (`admit_beside_leaving`).
        They finish, by length at the latest, when the steps in flight are processed, and get no
        row meanwhile (`_prune_running` leaves them out of the decoding), so no step has more than
        max_running_requests rows. Their request slots stay theirs until those steps complete:
        the admission takes a spare one (`request_slot_count`), or waits if none is free.
        A closed-loop workload at its running limit otherwise plans each next prefill only after
        the result that finishes a request (docs/benchmarks.md, session 34)."""
        taken = len(self.running)
        if self.cfg.admit_beside_leaving:
            live = Status.RUNNING
            taken -= sum(1 for r in self.running if r.status is live and r.num_computed >= r.prefill_target
                         and r.num_scheduled_samples >= r.max_samples)
        return self.cfg.max_running_requests - taken

    def _admission_order(self) -> list[Request]:
        """FCFS; with `lpm`, longest cached prefix first (stable), while the queue is short."""
        queue = list(self.waiting)
        if self.cfg.schedule_policy == "lpm" and self.cache.enabled and len(queue) <= LPM_MAX_WAITING:
            queue.sort(key=lambda r: -self.cache.match_length(r))
        return queue

    def _pending_prefixes(self, prefilling: list[Request]) -> "PendingPrefills":
        """The running prefills' prompt blocks still being computed (`PendingPrefills`)."""
        pending = PendingPrefills(self.cache.enabled)
        for req in prefilling:
            pending.add(req)
        return pending

    def _chunk_limit(self, budget: int) -> int:
        size = self.cfg.chunked_prefill_size
        return budget if size is None else min(size, budget)

    def _admit(self, req: Request, matched: int) -> None:
        self._journal.admitted.append(req)  # first: a failure from here on is rolled back
        self.waiting.remove(req)
        req.slot = self.req_slots.alloc(1)[0]
        req.status = Status.RUNNING
        req.num_computed = req.table_pending = matched  # the cached prefix counts as computed
        if req.num_preemptions == 0:
            req.num_cached_tokens = matched
        req.prefill_target = len(req.prompt_token_ids) + len(req.output_token_ids)
        req.num_scheduled_samples = len(req.output_token_ids)
        self.running.append(req)
        self.on_admit(req)

    def _chunk(self, req: Request, budget: int, reserve: int) -> Row | None:
        left = req.prefill_target - req.num_computed
        n = left if self.cfg.chunked_prefill_size is None else min(left, self._chunk_limit(budget))
        n = min(n, self.cache.available() - reserve)
        if n <= 0:
            return None
        ids = req.fill_slice(req.num_computed, req.num_computed + n)
        sample = req.num_scheduled_samples if req.num_computed + n == req.prefill_target else None
        cached = req.kv_slots[:req.table_pending] if req.table_pending else None
        return Row(req, req.num_computed, self._alloc(n), ids, sample, cached,
                   prompt_logprobs=req.prompt_logprob_span(req.num_computed, n))

    def _alloc(self, n: int) -> list[int]:
        slots = self.cache.alloc(n)
        self._journal.kv_slots += slots
        return slots


class PendingPrefills:
    """Per running prefill, the first prompt block k that ends SHARED_PREFILL_MIN_TOKENS or
    more past what it has cached: a waiting prompt with the same prefix hash at k shares that
    many tokens the prefill is still computing (`shared_by`), O(prefills) hash compares, no
    token compares.

    Kept by the prompts' first-block hashes, and the chained hashes (prompt_block_hashes, ~80 us
    for a 9k-token prompt on the CPU replay of issue 23, where they were a fifth of a prefill
    plan's time) compared only for a waiting prompt whose first block is a prefill's: a prefix
    hash equal at k with a different first block could only be a hash collision."""

    def __init__(self, enabled: bool = True):
        self.enabled = enabled  # no prefix cache: nothing is shared, nothing to hash
        self._by_first: dict[int, list[tuple[int, Request]]] = {}

    def __bool__(self) -> bool:
        return bool(self._by_first)

    def add(self, req: Request) -> None:
        """A prompt being prefilled (its cached_len as planned now)."""
        k = -(-req.cached_len // PROMPT_HASH_BLOCK)  # block k ends >= SHARED_PREFILL_MIN_TOKENS past it
        if self.enabled and k < len(req.prompt_token_ids) // PROMPT_HASH_BLOCK:  # len(prompt_block_hashes)
            self._by_first.setdefault(req.first_block_hash, []).append((k, req))

    def shared_by(self, req: Request) -> bool:
        """Would `req` compute tokens a running prefill is computing right now? Then it had
        better wait until they are cached (prompts in one batch sharing a prefix are
        prefilled once)."""
        prefills = self._by_first.get(req.first_block_hash)
        if not prefills:
            return False
        hashes = req.prompt_block_hashes
        return any(k < len(hashes) and hashes[k] == other.prompt_block_hashes[k] for k, other in prefills)


def _needs_slot(req: Request) -> bool:
    """Its next decode row needs a new KV slot (none was reserved at that position)."""
    return len(req.kv_slots) <= req.num_computed


def _batch(step: int, plan: "list[Row] | DecodeColumns", **facts) -> ScheduledBatch:
    """The batch of a plan: rows, or decode columns."""
    if isinstance(plan, DecodeColumns):
        return ScheduledBatch(step, decode=plan, **facts)
    return ScheduledBatch(step, plan, **facts)
