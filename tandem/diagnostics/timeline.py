"""Per-step timeline: host time spent planning, launching and processing, and device time
of each forward from CUDA events. Events are read only after the step's result was
processed (its copy_done completed), with `query()` as a guard: never a blocking read.

Derived per step (CUDA only; None on the CPU, where the "device" work runs inside launch):
- `gpu_idle_before_ms`: device gap between the previous forward's end and this one's start.
- `cpu_lead_ms`: how far ahead of the GPU the host was with this step. Positive: the step was
  already queued when the previous forward finished (the host then waited about this long
  for the previous result). Negative: the GPU sat idle this long waiting for the step.
  Measured as host time from "this step queued" (end of its launch) to "previous result seen"
  (end of the previous step's wait); where the device shows a real gap before the forward,
  that gap (negated) is used instead, because a wait that did not block only bounds the
  moment the previous step finished.
"""
import gc
import json
import os
from collections import deque
from dataclasses import asdict, dataclass
from pathlib import Path
from time import perf_counter

# Device gaps at or below this are kernel-to-kernel noise, not a starved GPU (ms).
IDLE_EPS_MS = 0.02


@dataclass
class StepRecord:
    step: int
    batch_size: int
    num_tokens: int
    is_decode: bool
    context_tokens: int  # sum over rows of tokens in cache after the step (KV read by attention)
    attn_pairs: int  # query-key pairs attention computes (causal), for FLOP counts
    host_start: float  # perf_counter when planning began (seconds)
    schedule_ms: float
    launch_ms: float
    process_ms: float = 0.0  # processing this step's result (in a later engine call)
    host_wait_ms: float = 0.0  # part of process_ms spent in the one sanctioned wait
    gpu_forward_ms: float | None = None  # None on the CPU or when events were not ready
    gpu_idle_before_ms: float | None = None  # device gap since the previous forward ended
    host_done: float | None = None  # perf_counter when the host had this step's result (wait end)
    cpu_lead_ms: float | None = None  # see the module docstring; CUDA only
    num_sampled: int | None = None  # rows that sampled a token (the lm_head ran for them)
    gpu_mask_stall_ms: float | None = None  # inside the forward span: waiting for grammar masks
    # Speculative decoding: a verify step's proposal slots (sum of its rows' k; 0: none), and
    # once processed the proposals it checked and accepted. None: a plain step.
    verify_k: int | None = None
    proposed: int | None = None
    accepted: int | None = None
    # The prefix cache's host tier: tokens this step's plan queued for loading back and for
    # writing back (its forward waits for both on the device). None: no host tier.
    host_load_tokens: int | None = None
    host_write_back_tokens: int | None = None
    gpu_tier_stall_ms: float | None = None  # before the forward span: waiting for host-tier copies
    tier_stall_cause: str | None = None  # why it waited (`KVTierCopier.require`: "load", "slot_reuse")
    tier_stall_pending_mb: float | None = None  # copies it waited for not yet done when it was queued
    tier_window_ms: float | None = None  # host time queueing host-tier copies after this step's launch
    # Host ms of this step's plan made in the wait for an earlier step (Scheduler.plan_ahead);
    # schedule_ms is then only its hand-over. None: planned when due.
    plan_ahead_ms: float | None = None
    # Host ms of this step's inputs staged in that wait (ModelRunner.stage_ahead); launch_ms is
    # then only its queueing. None: staged at its launch.
    stage_ahead_ms: float | None = None
    # Host ms the garbage collector ran between the previous step's launch and this one's (a
    # pause there delays this launch), and the oldest generation it collected (-1: none).
    gc_ms: float = 0.0
    gc_generation: int = -1

    @property
    def launch_end(self) -> float:
        """perf_counter when this step was fully queued (submitted)."""
        return self.host_start + (self.schedule_ms + self.launch_ms) / 1e3


class CollectorTime:
    """A `gc.callbacks` entry: the garbage collector's passes, as (end time, ms, generation),
    until a launch takes the ones that delayed it (`take`). A collection stops the host wherever
    it allocates, so a long one can idle the GPU whatever the step was doing."""

    def __init__(self):
        self.passes: list[tuple[float, float, int]] = []
        self._start = 0.0

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = perf_counter()
        else:
            end = perf_counter()
            self.passes.append((end, (end - self._start) * 1e3, info["generation"]))

    def take(self, until: float) -> tuple[float, int]:
        """(ms, oldest generation; -1: none) of the passes that ended by `until`, taken."""
        done = [p for p in self.passes if p[0] <= until]
        self.passes = self.passes[len(done):]  # in end order: the rest ended later
        return sum(p[1] for p in done), max((p[2] for p in done), default=-1)


class Timeline:
    """Records every launched step (`add`) and fills it in when its result was processed
    (`completed`). `max_records` bounds memory in long-running servers (oldest dropped);
    `steps_recorded` keeps counting. While open, it times the garbage collector (each record's
    `gc_ms`)."""

    def __init__(self, path: str | Path | None = None, max_records: int | None = None,
                 flush_every: int = 64, recent_window: int = 256):
        self.records: list[StepRecord] = []
        self.max_records, self.flush_every = max_records, flush_every
        self.steps_recorded = 0
        self._file = open(path, "w") if path else None
        self._unflushed = 0
        self._previous_done: float | None = None  # host_done of the last completed step
        # Running sums over the last `recent_window` completed steps, for cheap live gauges:
        # (host ms, forward ms or None, idle ms or None, lead ms or None)
        self._recent: deque = deque(maxlen=recent_window)
        self._sums = [0.0, 0.0, 0.0, 0.0]
        self._counts = [0, 0, 0, 0]
        self._collector = CollectorTime()
        gc.callbacks.append(self._collector)  # removed by close()

    def add(self, record: StepRecord) -> None:
        # Added once its step's processing window is over: the passes in that window delayed the
        # next launch, not this one.
        record.gc_ms, record.gc_generation = self._collector.take(record.launch_end)
        self.records.append(record)
        self.steps_recorded += 1
        if self.max_records is not None and len(self.records) > 2 * self.max_records:
            del self.records[:len(self.records) - self.max_records]

    def completed(self, record: StepRecord, start, end, previous_end, mask_wait=None, tier_wait=None) -> None:
        """Fill device times once the step's forward is known complete (its result was read:
        `process_ms` and `host_wait_ms` are already set). `mask_wait`: events around the
        forward stream's wait for the step's grammar masks; that stall counts as idle.
        `tier_wait`: its wait for host-tier copies (`TierWait`), before the forward span
        (already in the idle gap before it: recorded to say why)."""
        now = perf_counter()
        record.host_done = now - max(0.0, record.process_ms - record.host_wait_ms) / 1e3
        if start is not None and end is not None and end.query():
            record.gpu_forward_ms = start.elapsed_time(end)
            if previous_end is not None and previous_end.query():
                record.gpu_idle_before_ms = max(0.0, previous_end.elapsed_time(start))
            record.cpu_lead_ms = cpu_lead_ms(record, self._previous_done)
            if mask_wait is not None and mask_wait[1].query():
                record.gpu_mask_stall_ms = mask_wait[0].elapsed_time(mask_wait[1])
            if tier_wait is not None and tier_wait.after.query():
                record.gpu_tier_stall_ms = tier_wait.before.elapsed_time(tier_wait.after)
                record.tier_stall_cause = tier_wait.cause
                record.tier_stall_pending_mb = round(tier_wait.pending_bytes / 2**20, 1)
        self._previous_done = record.host_done
        self._push_recent((record.schedule_ms + record.launch_ms + record.process_ms - record.host_wait_ms,
                           record.gpu_forward_ms, record.gpu_idle_before_ms, record.cpu_lead_ms))
        if self._file:
            self._file.write(json.dumps(asdict(record)) + "\n")
            self._unflushed += 1
            if self._unflushed >= self.flush_every:
                self._file.flush()
                self._unflushed = 0

    def _push_recent(self, values: tuple) -> None:
        if len(self._recent) == self._recent.maxlen:
            for i, v in enumerate(self._recent[0]):
                if v is not None:
                    self._sums[i] -= v
                    self._counts[i] -= 1
        self._recent.append(values)
        for i, v in enumerate(values):
            if v is not None:
                self._sums[i] += v
                self._counts[i] += 1

    def recent(self) -> dict:
        """O(1) gauges over the last `recent_window` completed steps (for a server's /metrics):
        steps, mean_host_ms, and on CUDA gpu_busy_fraction and mean_cpu_lead_ms."""
        (host, fwd, idle, lead), (n_host, n_fwd, _, n_lead) = self._sums, self._counts
        out = {"steps": len(self._recent), "mean_host_ms": host / n_host if n_host else 0.0}
        if n_fwd and fwd + idle > 0:
            out["gpu_busy_fraction"] = fwd / (fwd + idle)
        if n_lead:
            out["mean_cpu_lead_ms"] = lead / n_lead
        return out

    def summary(self, skip: int = 0, last: int | None = None) -> dict:
        """Means over records[skip:] (or the last `last` records). GPU busy fraction =
        forward time / (forward time + device gaps between forwards); CUDA only."""
        window = self.records[skip:]
        if last is not None:
            window = window[-last:] if last > 0 else []
        recs = [r for r in window if r.gpu_forward_ms is not None]
        out = {"steps": len(window),
               "mean_host_ms": _mean([r.schedule_ms + r.launch_ms + r.process_ms - r.host_wait_ms
                                      for r in window]),
               "mean_host_wait_ms": _mean([r.host_wait_ms for r in window])}
        tier_windows = [r.tier_window_ms for r in window if r.tier_window_ms is not None]
        if tier_windows:  # outside mean_host_ms: the window runs after the step's processing
            out["mean_tier_window_ms"] = _mean(tier_windows)
        if recs:
            stall = sum(r.gpu_mask_stall_ms or 0.0 for r in recs)
            busy = sum(r.gpu_forward_ms for r in recs) - stall
            idle = sum(r.gpu_idle_before_ms or 0.0 for r in recs[1:]) + stall
            out["gpu_busy_fraction"] = busy / (busy + idle) if busy + idle > 0 else None
            out["mean_gpu_forward_ms"] = busy / len(recs)
            out["mean_gpu_idle_ms"] = idle / max(len(recs) - 1, 1)
            tier = [r.gpu_tier_stall_ms for r in recs[1:] if r.gpu_tier_stall_ms is not None]
            if tier:
                out["gpu_tier_stall_ms"] = sum(tier)  # of the idle time: forwards waiting for copies
            leads = [r.cpu_lead_ms for r in recs[1:] if r.cpu_lead_ms is not None]
            if leads:
                out["mean_cpu_lead_ms"] = _mean(leads)
                out["gpu_starved_steps"] = sum(x < 0 for x in leads)
        if os.environ.get("CUDA_LAUNCH_BLOCKING") == "1":
            out["launch_blocking"] = True  # every launch waited: these timings say nothing
        return out

    def close(self) -> None:
        if self._collector in gc.callbacks:
            gc.callbacks.remove(self._collector)
        if self._file:
            self._file.close()
            self._file = None


def cpu_lead_ms(record: StepRecord, previous_done: float | None) -> float | None:
    """How far ahead of the GPU the host was with `record`'s step (see the module docstring)."""
    if record.gpu_idle_before_ms is not None and record.gpu_idle_before_ms > IDLE_EPS_MS:
        return -record.gpu_idle_before_ms
    if previous_done is None:
        return None
    return (previous_done - record.launch_end) * 1e3


def read_timeline(path: str | Path) -> list[dict]:
    """The JSON lines written by a Timeline (one dict per step)."""
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else 0.0
