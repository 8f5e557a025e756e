"""FCFS admission, chunked prefill, decode of all running requests, preemption by recompute.

The scheduler only does host bookkeeping. It never reads a device value: under overlap the
newest sampled token of every request is still on the GPU when the next step is planned.
"""
from collections import deque
from dataclasses import dataclass
from typing import Callable

from tandem.memory.allocator import SlotAllocator
from tandem.memory.req_to_token import ReqToTokenTable
from tandem.request import Request, Status
from tandem.scheduler.batch import Row, ScheduledBatch


@dataclass
class SchedulerConfig:
    max_running_requests: int
    max_prefill_tokens: int
    chunked_prefill_size: int | None
    enable_mixed_batch: bool


class Scheduler:
    def __init__(self, cfg: SchedulerConfig, kv_slots: SlotAllocator, req_slots: SlotAllocator,
                 table: ReqToTokenTable, on_admit: Callable[[Request], None]):
        self.cfg = cfg
        self.kv_slots, self.req_slots, self.table = kv_slots, req_slots, table
        self.on_admit = on_admit  # engine hook: reset per-slot device state (penalties)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._deferred: list[Request] = []  # finished, but queued GPU work may still read their KV
        self.num_preemptions = 0

    # ---- queue ----
    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting) or any(not r.finished for r in self.running)

    def finish(self, req: Request, completed_step: int) -> None:
        """Take a finished request out; its KV is released once no launched step can read it."""
        if req in self.waiting:
            self.waiting.remove(req)
        if req.slot == 0:
            return
        if req.last_step <= completed_step:
            self._release(req)
        else:
            self._deferred.append(req)

    def on_step_completed(self, step: int) -> None:
        """Every step up to `step` finished on the device: free what only they could read."""
        still = []
        for req in self._deferred:
            (self._release(req) if req.last_step <= step else still.append(req))
        self._deferred = still

    def _release(self, req: Request) -> None:
        self.kv_slots.free(req.kv_slots)
        self.req_slots.free([req.slot])
        req.kv_slots, req.slot = [], 0
        if req in self.running:
            self.running.remove(req)

    # ---- planning a step ----
    def schedule(self, step: int, drain: Callable[[], None]) -> ScheduledBatch | None:
        """Plan the next step. `drain` processes the in-flight result; it is called only when
        memory runs out and preemption may be needed (preempting needs every token known)."""
        rows = self._plan(step, drain)
        if not rows and self.has_work():
            drain()  # results may finish requests or free memory
            rows = self._plan(step, drain)
            # Partial prefills can hold all memory between them: recompute the newest.
            while not rows and len(self.running) > 1:
                self._preempt(self.running[-1])
                rows = self._plan(step, drain)
        if not rows:
            return None
        for row in rows:
            self._commit(row, step)
        return ScheduledBatch(step=step, rows=rows)

    def _plan(self, step: int, drain: Callable[[], None]) -> list[Row]:
        self.running = [r for r in self.running if not r.finished]
        if self.cfg.enable_mixed_batch:
            decode = self._decode_rows(step, drain)
            return decode + self._prefill_rows(self.cfg.max_prefill_tokens - len(decode))
        return self._prefill_rows(self.cfg.max_prefill_tokens) or self._decode_rows(step, drain)

    def _commit(self, row: Row, step: int) -> None:
        req = row.req
        req.kv_slots.extend(row.kv_slots)
        req.num_computed += row.num_new
        if row.sample_index is not None:
            req.num_scheduled_samples += 1
        req.last_step = step

    def _decode_rows(self, step: int, drain: Callable[[], None]) -> list[Row]:
        reqs = [r for r in self.running if r.can_decode]
        if len(reqs) > self.kv_slots.num_free:
            drain()  # finishes may free enough; if not, nothing is in flight for preemption
            self.running = [r for r in self.running if not r.finished]
            while sum(r.can_decode for r in self.running) > self.kv_slots.num_free:
                self._preempt(self.running[-1])
            reqs = [r for r in self.running if r.can_decode]
        slots = self.kv_slots.alloc(len(reqs))
        return [Row(r, r.num_computed, [s], None, r.num_scheduled_samples) for r, s in zip(reqs, slots)]

    def _preempt(self, req: Request) -> None:
        """Recompute later: drop the KV, keep the known outputs, go back to the queue's head."""
        self.running.remove(req)
        self.kv_slots.free(req.kv_slots)
        self.req_slots.free([req.slot])
        req.kv_slots, req.slot, req.num_computed = [], 0, 0
        req.status = Status.WAITING
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def _prefill_rows(self, budget: int) -> list[Row]:
        rows: list[Row] = []
        reserve = sum(r.can_decode for r in self.running)  # keep room for next decodes
        for req in [r for r in self.running if not r.prefill_done]:
            row = self._chunk(req, budget, reserve)
            if row is None:
                return rows
            rows.append(row)
            budget -= row.num_new
        while self.waiting and budget > 0 and len(self.running) < self.cfg.max_running_requests:
            req = self.waiting[0]
            if self.req_slots.num_free == 0:
                break
            fill = len(req.fill_ids)
            whole = self.cfg.chunked_prefill_size is None
            if whole and fill > budget and rows:
                break  # an unchunked prompt waits for a step of its own
            if self.kv_slots.num_free - reserve < min(fill, self._chunk_limit(budget)):
                break
            self.waiting.popleft()
            self._admit(req)
            row = self._chunk(req, budget, reserve)
            rows.append(row)
            budget -= row.num_new
        return rows

    def _chunk_limit(self, budget: int) -> int:
        size = self.cfg.chunked_prefill_size
        return budget if size is None else min(size, budget)

    def _admit(self, req: Request) -> None:
        req.slot = self.req_slots.alloc(1)[0]
        req.status = Status.RUNNING
        req.prefill_target = len(req.prompt_token_ids) + len(req.output_token_ids)
        req.num_scheduled_samples = len(req.output_token_ids)
        self.running.append(req)
        self.on_admit(req)

    def _chunk(self, req: Request, budget: int, reserve: int) -> Row | None:
        left = req.prefill_target - req.num_computed
        n = left if self.cfg.chunked_prefill_size is None else min(left, self._chunk_limit(budget))
        n = min(n, self.kv_slots.num_free - reserve)
        if n <= 0:
            return None
        fill = req.fill_ids
        ids = fill[req.num_computed:req.num_computed + n]
        sample = req.num_scheduled_samples if req.num_computed + n == req.prefill_target else None
        return Row(req, req.num_computed, self.kv_slots.alloc(n), ids, sample)
