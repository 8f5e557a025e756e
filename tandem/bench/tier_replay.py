"""`tandem bench tier-replay`: issue 23's host path on the CPU, at the GPU run's sizes.

The host-tier suite run (`tandem bench suite --parts host_tier`: 64 conversations x 8 turns of
1,024 tokens, 128 outputs, 12 running, a 147,456-token pool, a 48 GB host tier) replayed on a
tiny model with dummy weights: the same plans, the same tree, the same copies' bookkeeping
(every copy completes as it is queued: no device), so the host's own work can be timed where
the GPU run only shows its idle. It reports

- the plans made in the wait (`Scheduler.plan_ahead`) that planned a prefill, all of them and
  those admitting a cached prefix of >= 4,096 tokens, and the staging that follows them
  (`ModelRunner.stage_ahead`): wall ms, median / p90;
- the garbage collector: its passes by generation (count, total and worst ms) over the run; what
  a full pass walks mid-run (`--full-pass-at`: `diagnostics.gc_census`, one pass timed) and one
  full pass timed at the end (the tree at its largest).

Run it on both sides of a change, alternating (this box drifts by tens of percent between
runs). The hit tokens must match between sides that should plan alike.

`--modeled` replays on a modeled device clock instead (`tier_clock.ModeledClock`: steps and
host-tier copies take the GPU's time, so a load still runs when the next plans are made) and
adds the modeled run time, output tok/s and TTFT p50 / p90 / p99: a scheduling change's effect
on the tail, predicted on the CPU (`--experiment NAME=VALUE` for its A/B, `--host-tokens 0` for
the tier off).
"""
from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from tandem.bench.prefix import MultiTurn, _percentile, census_at, drive
from tandem.bench.presets import PRESETS
from tandem.bench.tier_clock import ClockModel, ModeledClock
from tandem.config import EngineConfig, Experiments
from tandem.diagnostics.gc_census import full_pass_ms
from tandem.diagnostics.timeline import CollectorTime
from tandem.engine import Engine
from tandem.memory.host_kv import HostKVPool

LONG_MATCH = 4096  # a plan "long-match" when a row reuses at least this many cached tokens


def build_engine(args: argparse.Namespace) -> Engine:
    model = Path(tempfile.mkdtemp(prefix="tandem-tier-replay-"))
    (model / "config.json").write_text(json.dumps({**PRESETS["tiny"], "max_position_embeddings": 16384}))
    common = dict(model=str(model), dummy_weights=True, device="cpu", dtype="float32",
                  max_running_requests=args.running, seed=0,
                  experiments=Experiments.from_overrides(args.experiment))
    probe = Engine(EngineConfig(max_total_tokens=256, **common))
    token_bytes = HostKVPool.bytes_per_token([probe.kv])
    probe.close()
    return Engine(EngineConfig(max_total_tokens=args.pool, host_kv_cache_gb=args.host_tokens * token_bytes / 2**30,
                               **common))


class Probes:
    """Instance wrappers around the plan made in the wait and its staging, and the collector's
    passes (a `CollectorTime` in `gc.callbacks`); `close()` removes them all."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self.plans: list[tuple[float, int]] = []  # (ms, longest cached prefix among its rows)
        self.stages: list[float] = []
        self.collector = CollectorTime()  # its passes: (end time, ms, generation)
        sched, runner = engine.scheduler, engine.runner
        plan, stage = sched.plan_ahead, runner.stage_ahead

        def plan_ahead(n):
            t0 = time.perf_counter()
            batch = plan(n)
            if batch is not None:
                longest = max((len(r.cached_prefix) for r in batch.rows if r.cached_prefix is not None), default=0)
                self.plans.append(((time.perf_counter() - t0) * 1e3, longest))
            return batch

        def stage_ahead(batch):
            t0 = time.perf_counter()
            stage(batch)
            self.stages.append((time.perf_counter() - t0) * 1e3)

        sched.plan_ahead, runner.stage_ahead = plan_ahead, stage_ahead
        gc.callbacks.append(self.collector)

    def close(self) -> None:
        gc.callbacks.remove(self.collector)
        for obj, name in ((self.engine.scheduler, "plan_ahead"), (self.engine.runner, "stage_ahead")):
            delattr(obj, name)


def _summary(ms: list[float]) -> dict:
    if not ms:
        return {"n": 0}
    return {"n": len(ms), "median_ms": round(statistics.median(ms), 3), "p90_ms": round(_percentile(ms, 90), 3)}


def replay(args: argparse.Namespace) -> dict:
    engine = build_engine(args)
    vocab = engine.model_config.vocab_size
    drive(engine, MultiTurn(2, 2, args.turn_len, args.turn_len, 8, vocab, seed=1000), "warm")
    engine.reset_prefix_cache()
    probes = Probes(engine)
    clock = (ModeledClock(engine, ClockModel(args.step_ms, args.prefill_us, args.copy_gb_s or None))
             if args.modeled else None)
    try:
        with census_at(engine, args.full_pass_at) as mid:
            t0 = time.perf_counter()
            _, outputs, _, firsts = drive(engine, MultiTurn(args.conversations, args.turns, args.turn_len,
                                                            args.turn_len, args.output_len, vocab, seed=0),
                                          "run", clock.clock if clock else time.perf_counter)
            wall = time.perf_counter() - t0
    finally:
        probes.close()
        if clock is not None:
            clock.close()
    stats = engine.stats()
    full_pass_end = full_pass_ms()  # the tree at its largest: what a full pass walks
    passes = [(g, ms) for _, ms, g in probes.collector.passes]
    by_generation = {str(g): {"n": sum(1 for x, _ in passes if x == g),
                              "total_ms": round(sum(ms for x, ms in passes if x == g), 1),
                              "worst_ms": round(max((ms for x, ms in passes if x == g), default=0.0), 2)}
                     for g in (0, 1, 2)}
    engine.close()
    modeled = {} if clock is None else modeled_figures(clock, outputs, [f.ttft_ms / 1e3 for f in firsts])
    return {**modeled, "wall_s": round(wall, 1), "outputs": outputs, "hit_tokens": stats["prefix_cache_hit_tokens"],
            "host_hit_tokens": stats["host_cache_hit_tokens"],
            "prefill_plans": _summary([ms for ms, _ in probes.plans]),
            "long_match_plans": _summary([ms for ms, longest in probes.plans if longest >= LONG_MATCH]),
            "stage_ahead": _summary(probes.stages),
            "gc_passes": by_generation, "census_mid": mid.get("census"), "full_pass_end_ms": full_pass_end}


def modeled_figures(clock: ModeledClock, outputs: int, ttft_s: list[float]) -> dict:
    """The modeled run: its time, output tok/s, steps, TTFT percentiles and copy stall."""
    end = clock.end()
    return {"modeled_s": round(end, 2), "modeled_output_tok_s": round(outputs / end) if end else None,
            "modeled_steps": clock.steps, "modeled_stall_s": round(clock.stall_s, 3),
            "modeled_ttft_s": {f"p{q}": round(_percentile(ttft_s, q), 2) for q in (50, 90, 99)}}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="tandem bench tier-replay", description=__doc__.split("\n\n")[0])
    ap.add_argument("--conversations", type=int, default=40)
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--turn-len", type=int, default=1024)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--running", type=int, default=12)
    ap.add_argument("--pool", type=int, default=147456, help="KV pool tokens (the GPU run's)")
    ap.add_argument("--host-tokens", type=int, default=450_000, help="host tier tokens (~the GPU run's 48 GB)")
    ap.add_argument("--full-pass-at", type=int, default=1500,
                    help="engine step at which what a full pass walks is counted and one pass timed")
    ap.add_argument("--experiment", action="append", default=[], metavar="NAME=VALUE",
                    help="an Experiments switch for an A/B run, e.g. host_kv_held_places=0 (repeatable)")
    ap.add_argument("--modeled", action="store_true",
                    help="replay on a modeled device clock (steps and copies take the GPU's time) and "
                         "report the modeled run time and TTFT percentiles")
    ap.add_argument("--step-ms", type=float, default=ClockModel.step_ms, help="--modeled: a step's fixed cost")
    ap.add_argument("--prefill-us", type=float, default=ClockModel.prefill_us_per_token,
                    help="--modeled: the cost of each token of a step with prefill rows")
    ap.add_argument("--copy-gb-s", type=float, default=ClockModel.copy_gb_s,
                    help="--modeled: the copy stream's rate, each way (0: copies complete as queued)")
    args = ap.parse_args(argv)
    print(json.dumps(replay(args)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
