"""Host phase timers: where an engine iteration's host time goes, phase by phase.

`phase_timers(engine)` wraps named methods of the engine's parts (scheduler, prefix cache and
its tree, host-tier copier, runner, the engine's own loop steps) on their instances for the
block, and times every call (inclusive milliseconds, summed per iteration), plus the garbage
collector. Each engine iteration (`Engine._run_step`: plan step N+1, launch it, run the tier
window, process step N) becomes one record, labelled by the kind of step it planned. The
summary gives, per phase, the median and mean per iteration for iterations that planned a
prefill step, for the iteration before each of them (whose wait the prefill's plan follows),
and for decode-only iterations.

For a steady window of a long run, like `profile.step_window`, but cheap enough to leave on
for a whole benchmark run (a perf_counter pair per wrapped call) and split by phase rather
than by function. The wrappers are instance attributes, removed on exit.
"""
from __future__ import annotations

import gc
import statistics
from contextlib import contextmanager
from dataclasses import dataclass, field
from time import perf_counter
from typing import Iterator

# (path from the engine to the part, methods timed). Inclusive times: a phase that calls another
# counts the callee's time too (`Scheduler.schedule` holds `_plan`, which holds `_prefill_rows`).
PHASES: list[tuple[str, tuple[str, ...]]] = [
    ("scheduler", ("schedule", "_plan", "_prune_running", "_prefill_rows", "_decode_rows", "_chunk",
                   "on_step_completed", "prepare_waiting", "plan_ahead")),
    ("prefix_cache", ("admit", "prefetch_hold", "alloc", "undo_admit", "cache_prefill", "release", "prefetch",
                      "write_ahead", "evict_ahead")),
    ("prefix_cache.tree", ("evict", "match", "insert")),
    ("kv_tier", ("_copy", "collect", "fence")),
    ("runner", ("launch", "stage_ahead", "_stage")),
    # A staged step's pieces: a prefill graph's fields, then the ring slot's host write and copy
    # (issue 23: on the H100 the tier's prefills staged ahead for 3.2 ms, median, session 35).
    ("runner.prefill_graphs", ("metadata",)),
    ("runner.stager", ("stage",)),
    ("", ("_process", "_process_in_flight", "_tier_window", "_move_between_tiers", "_plan_ahead",
          "_admit_compiled", "add_request")),
]
# A call between two iterations (the caller's `add_request` after `step()` returned) counts in
# the iteration before it: the one whose processing finished the requests it follows.


@dataclass
class PhaseLog:
    """One record per engine iteration: {phase: ms, "kind": the step it planned}."""

    iterations: list[dict] = field(default_factory=list)

    def summary(self, slowest: int = 6) -> dict:
        """Per-phase [median, mean] ms per iteration, by the kind of step planned; and the
        `slowest` iterations (their own time plus the caller's before them), whole."""
        its = self.iterations
        prefill = [i for i, it in enumerate(its) if it.get("kind") == "prefill"]
        slow = sorted(its, key=lambda it: it.get("iteration", 0.0) + it.get("caller", 0.0), reverse=True)[:slowest]
        return {"iterations": len(its), "prefill_iterations": len(prefill),
                "prefill": _medians([its[i] for i in prefill]),
                "before_prefill": _medians([its[i - 1] for i in prefill if i > 0]),
                "decode": _medians([it for it in its if it.get("kind") == "decode"]),
                "slowest": [{k: (round(v, 2) if isinstance(v, float) else v) for k, v in it.items()} for it in slow]}


def _medians(records: list[dict]) -> dict[str, list[float]]:
    if not records:
        return {}
    keys = sorted({k for r in records for k in r if k != "kind"})
    return {k: [round(statistics.median(r.get(k, 0.0) for r in records), 3),
                round(statistics.mean(r.get(k, 0.0) for r in records), 3)] for k in keys}


def _part(engine, path: str):
    obj = engine
    for name in filter(None, path.split(".")):
        obj = getattr(obj, name, None)
    return obj


@contextmanager
def phase_timers(engine) -> Iterator[PhaseLog]:
    log, current = PhaseLog(), [{}]
    wrapped: list[tuple[object, str]] = []

    def wrap(obj, name: str, label: str, around=None) -> None:
        fn = getattr(obj, name)

        def timed(*args, **kwargs):
            t = perf_counter()
            try:
                result = fn(*args, **kwargs)
                if around is not None:
                    around(result)
                return result
            finally:
                rec = current[0]
                rec[label] = rec.get(label, 0.0) + (perf_counter() - t) * 1e3

        setattr(obj, name, timed)  # an instance attribute: shadows the method until deleted
        wrapped.append((obj, name))

    def kind(batch) -> None:
        current[0]["kind"] = None if batch is None else ("prefill" if batch.has_prefill else "decode")

    for path, names in PHASES:
        obj = _part(engine, path)
        if obj is None:
            continue  # no host tier, say
        for name in names:
            if hasattr(obj, name):
                wrap(obj, name, f"{type(obj).__name__}.{name}", kind if (path, name) == ("scheduler", "schedule") else None)
    run_step = engine._run_step

    last_end = [None]

    def iteration(outputs):
        t = perf_counter()
        # The caller's time since the last iteration (its own code between step() calls).
        current[0] = {} if last_end[0] is None else {"caller": (t - last_end[0]) * 1e3}
        try:
            return run_step(outputs)
        finally:
            last_end[0] = perf_counter()
            current[0]["iteration"] = (last_end[0] - t) * 1e3
            log.iterations.append(current[0])

    engine._run_step = iteration
    wrapped.append((engine, "_run_step"))
    gc_start = [0.0]

    def on_gc(phase: str, info: dict) -> None:
        if phase == "start":
            gc_start[0] = perf_counter()
        else:
            rec = current[0]
            rec["gc"] = rec.get("gc", 0.0) + (perf_counter() - gc_start[0]) * 1e3

    gc.callbacks.append(on_gc)
    try:
        yield log
    finally:
        gc.callbacks.remove(on_gc)
        for obj, name in reversed(wrapped):
            delattr(obj, name)
