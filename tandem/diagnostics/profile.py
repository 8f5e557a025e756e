"""`tandem profile`: the same short workload with overlap on and with overlap off, each under
`torch.profiler`, written as Chrome traces, plus one PNG of CPU and GPU lanes for both runs
one above the other (see `plot.py`).

The engine's phases are marked in the traces as `tandem::schedule`, `tandem::launch`,
`tandem::process` and `tandem::wait` (the one sanctioned wait, inside process). The marks are
installed on this engine instance only, for the profiled runs (no cost elsewhere).

Out directory:
    trace_overlap_on.json, trace_overlap_off.json   Chrome traces (chrome://tracing, Perfetto)
    steps_overlap_on.jsonl, steps_overlap_off.jsonl  the engine's step timeline of each run
    timeline.png                                     CPU/GPU lanes, overlap on above off
    summary.json                                     timeline summaries and the plotted window
"""
from __future__ import annotations

import argparse
import contextlib
import json
import logging
from dataclasses import asdict
from pathlib import Path

import torch

from tandem.diagnostics import plot, workload

log = logging.getLogger("tandem")

PHASES = ("schedule", "launch", "process", "wait")


@contextlib.contextmanager
def annotate(engine):
    """Mark the engine's phases with `record_function` (instance attributes, removed after)."""
    from torch.profiler import record_function

    def marked(name, fn):
        def wrapper(*args, **kwargs):
            with record_function(f"tandem::{name}"):
                return fn(*args, **kwargs)
        return wrapper

    process = engine._process

    def process_marked(pending):
        wait = pending.host.wait
        pending.host.wait = marked("wait", wait)
        try:
            with record_function("tandem::process"):
                return process(pending)
        finally:
            del pending.host.wait

    engine.scheduler.schedule = marked("schedule", engine.scheduler.schedule)
    engine.runner.launch = marked("launch", engine.runner.launch)
    engine._process = process_marked
    try:
        yield
    finally:
        del engine.scheduler.schedule, engine.runner.launch, engine._process


def profile_run(engine, prompts, params, overlap: bool, trace_path: Path) -> dict:
    """One profiled run; returns the timeline summary of its steps."""
    from torch.profiler import ProfilerActivity, profile
    engine.cfg.disable_overlap = not overlap
    activities = [ProfilerActivity.CPU]
    if engine.device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
        torch.cuda.synchronize()
    first = len(engine.timeline.records)
    with profile(activities=activities) as prof, annotate(engine):
        steps = workload.drive(engine, prompts, params)
        if engine.device.type == "cuda":
            torch.cuda.synchronize()  # outside the loop: every kernel lands in the trace
    prof.export_chrome_trace(str(trace_path))
    records = engine.timeline.records[first:]
    summary = engine.timeline.summary(skip=first)
    summary["engine_steps"] = steps
    with open(trace_path.with_name(f"steps_overlap_{'on' if overlap else 'off'}.jsonl"), "w") as f:
        for r in records:
            f.write(json.dumps(asdict(r)) + "\n")
    return summary


def host_profile(run, top: int = 40) -> str:
    """cProfile of `run()` (host work: Python and the calls that queue device work), the top
    functions by cumulative time as text. Run it after a benchmark's timed part: the profiler
    slows every Python call several times over."""
    start, table = _host_profiler(top)
    start()
    try:
        run()
    finally:
        text = table()  # stops the profiler
    return text


@contextlib.contextmanager
def step_window(engine, first: int, count: int, rows: int = 25, host: bool = False):
    """Profile engine steps [first, first + count) of the block, kernels included; yields a list
    that then holds the table of ops by device time (by host time on the CPU). For a steady
    window inside a long run, where a whole-run profile costs more than the run. With `host`,
    a cProfile of the window's Python instead (top functions by cumulative time): where the
    host time of those steps goes."""
    cuda = engine.device.type == "cuda"
    start, table = _host_profiler(rows) if host else _device_profiler(cuda, rows)
    step, seen, tables = engine.step, [0], []

    def stop() -> None:
        if cuda:
            torch.cuda.synchronize()  # every kernel of the window lands in it
        tables.append(table())

    def stepped(*args, **kwargs):
        if seen[0] == first:
            if cuda:
                torch.cuda.synchronize()
            start()
        try:
            return step(*args, **kwargs)
        finally:
            seen[0] += 1
            if seen[0] == first + count:
                stop()

    engine.step = stepped  # an instance attribute, removed after
    try:
        yield tables
    finally:
        del engine.step
        if first < seen[0] < first + count:
            stop()  # the block ended inside the window


def _device_profiler(cuda: bool, rows: int):
    """(start, stop-and-tabulate) of torch.profiler: ops by device time (host time on the CPU)."""
    from torch.profiler import ProfilerActivity, profile
    prof = profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else []))

    def table() -> str:
        prof.stop()
        return prof.key_averages().table(sort_by="self_cuda_time_total" if cuda else "self_cpu_time_total",
                                         row_limit=rows, max_name_column_width=60)
    return prof.start, table


def _host_profiler(rows: int):
    """(start, stop-and-tabulate) of cProfile: functions by cumulative host time."""
    import cProfile
    import io
    import pstats
    prof = cProfile.Profile()

    def table() -> str:
        prof.disable()
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats("cumulative").print_stats(rows)
        return text.getvalue()
    return prof.enable, table


def profile_main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="tandem profile", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    workload.add_workload_args(ap)
    ap.add_argument("--out", required=True, metavar="DIR", help="where traces and the PNG go")
    ap.add_argument("--window", type=int, default=8, help="engine steps shown in the PNG (steady decode)")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    from tandem.diagnostics.errors import launch_blocking_active
    if launch_blocking_active():
        log.warning("CUDA_LAUNCH_BLOCKING=1: every launch waits for its kernel; this profile "
                    "shows no overlap and its timings are meaningless")
    engine = workload.build_engine(args, timeline=True)
    prompts, params = workload.make_workload(args, engine)
    workload.warm_up(engine, args)
    results, lanes = {}, []
    for overlap in (True, False):
        name = "on" if overlap else "off"
        trace = out / f"trace_overlap_{name}.json"
        results[name] = profile_run(engine, prompts, params, overlap, trace)
        lanes.append(plot.load_lanes(trace, f"overlap {name}", args.window))
    device = torch.cuda.get_device_name() if engine.device.type == "cuda" else "CPU"
    model = Path(args.model).name if args.model else workload.preset_name(args, engine.device)
    title = (f"{model} on {device} (torch {torch.__version__}): "
             f"{args.num_requests} requests x {args.max_tokens} tokens, {args.window} steady steps")
    plot.plot_runs(lanes, out / "timeline.png", title=title)
    results["window"] = {l.label: l.stats() for l in lanes}
    (out / "summary.json").write_text(json.dumps(results, indent=1))
    for lane in lanes:
        s = lane.stats()
        busy = "n/a (CPU)" if s["gpu_busy"] is None else f"{s['gpu_busy']:.1%}"
        print(f"{lane.label}: {s['steps']} steps in {s['span_ms']:.2f} ms "
              f"({s['ms_per_step']:.3f} ms/step), GPU busy in window {busy}")
    for name in ("on", "off"):
        print(f"timeline, overlap {name}: " + json.dumps({k: round(v, 4) if isinstance(v, float) else v
                                                          for k, v in results[name].items()}))
    print(f"wrote {out}/timeline.png, trace_overlap_on.json, trace_overlap_off.json, summary.json")
    return 0


if __name__ == "__main__":
    raise SystemExit(profile_main())
