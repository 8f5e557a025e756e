"""Timeline PNG from torch.profiler Chrome traces: for each run a CPU lane (the engine's
phases, from the `tandem::*` marks) and, on CUDA, GPU lanes (kernels; copies and memsets),
runs stacked one above the other on a shared time axis, over a window of steady steps.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

PHASE_COLORS = {"schedule": "#4C72B0", "launch": "#55A868", "process": "#DD8452", "wait": "#C8C8C8"}
GPU_COLORS = {"kernel": "#8172B3", "HtoD": "#937860", "DtoH": "#DA8BC3", "other": "#8C8C8C"}

Span = tuple[float, float]  # (start, duration), milliseconds from the window start


@dataclass
class RunLanes:
    label: str
    t0_us: float
    t1_us: float
    steps: int
    cpu: dict[str, list[Span]] = field(default_factory=dict)  # phase -> spans
    gpu_kernels: list[Span] = field(default_factory=list)
    gpu_copies: dict[str, list[Span]] = field(default_factory=dict)  # HtoD / DtoH / other
    has_gpu: bool = False

    @property
    def span_ms(self) -> float:
        return (self.t1_us - self.t0_us) / 1e3

    def stats(self) -> dict:
        busy = None
        if self.has_gpu and self.span_ms > 0:
            busy = sum(d for _, d in _union(self.gpu_kernels)) / self.span_ms
        return {"steps": self.steps, "span_ms": self.span_ms,
                "ms_per_step": self.span_ms / max(self.steps, 1), "gpu_busy": busy}


def load_lanes(trace_path: str | Path, label: str, window: int = 8) -> RunLanes:
    """Lanes of `window` engine steps from the middle of the run (steady decode for the
    profile workload). Raises ValueError if the trace has no `tandem::launch` marks."""
    with open(trace_path) as f:
        events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X" and "dur" in e]
    marks: dict[str, list[Span]] = {p: [] for p in PHASE_COLORS}
    kernels, copies = [], {"HtoD": [], "DtoH": [], "other": []}
    for e in events:
        cat, name, ts, dur = e.get("cat", ""), e.get("name", ""), float(e["ts"]), float(e["dur"])
        if cat == "user_annotation" and name.startswith("tandem::"):
            phase = name.split("::", 1)[1]
            if phase in marks:
                marks[phase].append((ts, dur))
        elif cat == "kernel":
            kernels.append((ts, dur))
        elif cat in ("gpu_memcpy", "gpu_memset"):
            kind = "HtoD" if "HtoD" in name else "DtoH" if "DtoH" in name else "other"
            copies[kind].append((ts, dur))
    launches = sorted(marks["launch"])
    if not launches:
        raise ValueError(f"{trace_path}: no tandem::launch marks (was the engine annotated?)")
    schedules = sorted(marks["schedule"])
    starts = [max((s for s, _ in schedules if s <= ts), default=ts) for ts, _ in launches]
    n = len(launches)
    count = min(window, n)
    i0 = (n - count) // 2
    t0 = starts[i0]
    if i0 + count < n:
        t1 = starts[i0 + count]
    else:  # the window runs to the end: include the last step's processing and GPU work
        t1 = _end(events, t0)
    lanes = RunLanes(label, t0, t1, count, has_gpu=bool(kernels))
    lanes.cpu = {p: _clip(s, t0, t1) for p, s in marks.items()}
    lanes.gpu_kernels = _clip(_union(kernels), t0, t1)
    lanes.gpu_copies = {k: _clip(v, t0, t1) for k, v in copies.items()}
    return lanes


def _end(events: list[dict], t0: float) -> float:
    ends = [float(e["ts"]) + float(e["dur"]) for e in events
            if e.get("cat") in ("user_annotation", "kernel", "gpu_memcpy", "gpu_memset")
            and float(e["ts"]) >= t0]
    return max(ends, default=t0)


def _union(spans: list[Span]) -> list[Span]:
    """Merge overlapping (start, duration) spans."""
    out: list[list[float]] = []
    for s, d in sorted(spans):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], s + d)
        else:
            out.append([s, s + d])
    return [(a, b - a) for a, b in out]


def _clip(spans: list[Span], t0: float, t1: float) -> list[Span]:
    """Spans (microseconds, absolute) inside [t0, t1], as milliseconds from t0."""
    out = []
    for s, d in spans:
        a, b = max(s, t0), min(s + d, t1)
        if b > a:
            out.append(((a - t0) / 1e3, (b - a) / 1e3))
    return out


def plot_runs(runs: list[RunLanes], path: str | Path, title: str = "") -> Path:
    """One PNG, a panel per run (stacked), shared time axis in ms."""
    from matplotlib.figure import Figure  # no pyplot: no GUI backend, no global state
    from matplotlib.patches import Patch

    per_run = 3.6 if any(r.has_gpu for r in runs) else 1.8
    fig = Figure(figsize=(14, 1.4 + per_run * len(runs)))
    axes = fig.subplots(len(runs), 1, sharex=True, squeeze=False)
    xmax = max(r.span_ms for r in runs) or 1.0
    for ax, run in zip(axes[:, 0], runs):
        rows = [("CPU: engine", "cpu")]
        if run.has_gpu:
            rows += [("GPU: kernels", "kernels"), ("GPU: copies", "copies")]
        for i, (_, kind) in enumerate(rows):
            y = (len(rows) - 1 - i) * 10
            if kind == "cpu":
                for phase in ("schedule", "launch", "process"):
                    ax.broken_barh(run.cpu.get(phase, []), (y + 1, 8), color=PHASE_COLORS[phase])
                ax.broken_barh(run.cpu.get("wait", []), (y + 1, 8), facecolor=PHASE_COLORS["wait"],
                               edgecolor="#707070", hatch="///", linewidth=0.0)
            elif kind == "kernels":
                ax.broken_barh(run.gpu_kernels, (y + 1, 8), color=GPU_COLORS["kernel"])
            else:
                for k, spans in run.gpu_copies.items():
                    ax.broken_barh(spans, (y + 1, 8), color=GPU_COLORS[k])
        ax.set_yticks([(len(rows) - 1 - i) * 10 + 5 for i in range(len(rows))])
        ax.set_yticklabels([name for name, _ in rows])
        ax.set_ylim(0, 10 * len(rows))
        s = run.stats()
        busy = "" if s["gpu_busy"] is None else f", GPU busy {s['gpu_busy']:.0%}"
        ax.set_title(f"{run.label}: {s['steps']} steps in {s['span_ms']:.2f} ms "
                     f"({s['ms_per_step']:.3f} ms/step){busy}", loc="left", fontsize=10)
        ax.grid(axis="x", alpha=0.3)
    axes[-1, 0].set_xlim(0, xmax * 1.01)
    axes[-1, 0].set_xlabel("ms from the window's first step")
    handles = [Patch(color=PHASE_COLORS[p], label=f"CPU {p}") for p in ("schedule", "launch", "process")]
    handles.append(Patch(facecolor=PHASE_COLORS["wait"], edgecolor="#707070", hatch="///",
                         label="CPU wait (copy_done)"))
    if any(r.has_gpu for r in runs):
        handles += [Patch(color=GPU_COLORS["kernel"], label="GPU kernels"),
                    Patch(color=GPU_COLORS["HtoD"], label="H2D copy"),
                    Patch(color=GPU_COLORS["DtoH"], label="D2H copy")]
    fig.legend(handles=handles, loc="lower center", ncol=len(handles), fontsize=8, frameon=False)
    if title:
        fig.suptitle(title, fontsize=11)
    fig.tight_layout(rect=(0, 0.06, 1, 0.95 if title else 1))
    path = Path(path)
    fig.savefig(path, dpi=110)
    return path
