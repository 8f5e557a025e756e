"""`tandem bench suite`: every GPU test and the benchmark matrix, one run, one record.

Parts (`--parts`, default all): tests (every `gpu`-marked test and every test module that runs
on TANDEM_TEST_DEVICE, with TANDEM_TEST_DEVICE=cuda), offline (the standard workload through
the engine, Qwen3-0.6B and Llama-3.1-8B shapes, with the roofline fraction), latency (decode at
batch 1/16/64, overlap on and off), prefix (shared-prefix workload, cache on and off), grammar
(JSON-schema constrained vs unconstrained), fp8 (FP8 weights, and an FP8 KV cache, against the
bf16 figures: *.fp8_over_bf16.*, *.kvfp8_over_bf16.*) and
serve (`tandem serve` with default flags under Poisson load at 16 and 128 req/s, from a cold
start, and the engine on the same load in-process) and host_tier (multi-turn histories four times
the GPU pool, the prefix cache's host tier on and off: throughput, TTFT, GPU busy, the prefill
plan and the GPU's idle before prefill steps). Each configuration runs in its own
subprocess with its own time budget, so one failure or hang cannot hide the rest.

Writes one JSON record to --out (default docs/bench-records/; named by date and commit) and
prints a table; compares every figure with the newest earlier record of the same device and
preset in --history that holds one of its figures (a tests-only record is passed over). Exit
status 1 when a part failed, a test failed, or a figure regressed by more than --tolerance;
else 0. `--quick --device cpu` runs the same code on the tiny preset.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from tandem.bench import suite_record as rec
from tandem.bench.suite_runs import PARTS, Ctx, Figure, RunSpec, derived, plan

# The debug checks cost throughput (the server once shipped with them on): benchmarks measure
# what users get. The tests set them again themselves (tests/conftest.py).
_SCRUBBED_ENV = ("TANDEM_DEBUG_FUTURE_MAP", "TANDEM_DEBUG_PREFIX_CACHE")
# Multi-GPU hosts of the device tool: never NVLink multicast (KINDS.md).
_FIXED_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1",
              "PYTHONUNBUFFERED": "1"}


@dataclass
class RunResult:
    name: str
    part: str
    status: str  # ok, failed, timeout, skipped
    duration_s: float
    budget_s: float
    returncode: int | None
    command: list[str]
    log_tail: str
    figures: dict = field(default_factory=dict)
    note: str = ""
    host_load: float | None = None  # 1-minute load average at its start: host-bound figures move with it


def execute(run: RunSpec, ctx: Ctx, deadline: float) -> RunResult:
    """One configuration in its own session (its children die with it on a timeout)."""
    budget = min(run.budget_s, deadline - time.monotonic())
    if budget < 5:
        return RunResult(run.name, run.part, "skipped", 0.0, run.budget_s, None, run.argv, "",
                         note="no time left before the suite's deadline")
    log = ctx.raw / f"{run.name}.log"
    print(f"[suite] {run.name}: up to {budget:.0f} s", file=sys.stderr, flush=True)
    load, start = os.getloadavg()[0], time.monotonic()
    with open(log, "w") as out:
        proc = subprocess.Popen(run.argv, stdout=out, stderr=subprocess.STDOUT, env=_env(run.env),
                                start_new_session=True)
        rc, timed_out = _wait(proc, budget)
    duration = time.monotonic() - start
    leftovers = _end_leftovers(proc)
    tail = log.read_text(errors="replace")[-2500:]
    result = RunResult(run.name, run.part, "timeout" if timed_out else ("ok" if rc == 0 else "failed"),
                       duration, run.budget_s, rc, run.argv, tail, host_load=round(load, 2))
    _read_figures(run, ctx, log, result)
    if leftovers:
        result.note = (result.note + "; " if result.note else "") + "left processes running (killed)"
    print(f"[suite] {run.name}: {result.status} in {duration:.1f} s {result.note}", file=sys.stderr, flush=True)
    return result


def _wait(proc: subprocess.Popen, timeout: float) -> tuple[int | None, bool]:
    try:
        return proc.wait(timeout), False
    except subprocess.TimeoutExpired:
        for sig, grace in ((signal.SIGINT, 15), (signal.SIGKILL, 10)):  # SIGINT: servers stop cleanly
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                proc.wait(grace)
                break
            except subprocess.TimeoutExpired:
                continue
        return proc.returncode, True


def _end_leftovers(proc: subprocess.Popen) -> bool:
    """Kill whatever the finished run left in its session (a server, a worker), so that it
    cannot load the GPU or the host under the next run. True if there was something."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        return False
    return True


def _read_figures(run: RunSpec, ctx: Ctx, log: Path, result: RunResult) -> None:
    try:
        result.figures = {k: f.to_dict() for k, f in run.figures(ctx.raw / run.json, log).items()}
    except Exception as exc:  # a run that failed may have written nothing readable
        if result.status == "ok":
            result.status, result.note = "failed", f"figures unreadable: {type(exc).__name__}: {exc}"
        return
    if run.part == "tests":  # pytest's exit status alone would not say which tests failed
        bad = result.figures["tests.failed"]["value"] + result.figures["tests.errors"]["value"]
        if bad and result.status == "ok":
            result.status = "failed"
        result.note = ", ".join(f"{k[6:]} {int(v['value'])}" for k, v in result.figures.items())


def _env(extra: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in _SCRUBBED_ENV}
    return {**env, **_FIXED_ENV, **extra}


# ---- the record ----
def machine(device: str) -> str:
    """The GPU's name from nvidia-smi (no CUDA context in this process), else the CPU's."""
    if device != "cpu":
        try:
            out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                                 capture_output=True, text=True, timeout=20)
            names = [s.strip() for s in out.stdout.splitlines() if s.strip()]
            if out.returncode == 0 and names:
                return names[0] + (f" x{len(names)}" if len(names) > 1 else "")
        except (OSError, subprocess.TimeoutExpired):
            pass
    return f"cpu: {host_cpu()}"


def host_cpu() -> str:
    """The host CPU's model and core count: host-bound figures (start-up, the prefix cache's
    run, TTFT near saturation) move with it from one lent machine to the next."""
    try:
        model = re.search(r"^model name\s*:\s*(.+)$", Path("/proc/cpuinfo").read_text(), re.M)
    except OSError:
        model = None
    return f"{model.group(1).strip() if model else 'unknown'} ({os.cpu_count()} cores)"


def versions() -> dict[str, str | None]:
    import importlib.metadata as md
    out: dict[str, str | None] = {"python": sys.version.split()[0]}
    for name in ("torch", "triton", "transformers", "xgrammar", "fastapi", "uvicorn"):
        try:
            out[name] = md.version(name)
        except md.PackageNotFoundError:
            out[name] = None
    return out


def git_commit(given: str | None) -> tuple[str, bool | None]:
    """(short commit, uncommitted changes?); the GPU machine's copy has no .git: --commit."""
    if given:
        return given, None
    try:
        sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10)
        if sha.returncode == 0:
            return sha.stdout.strip(), bool(dirty.stdout.strip())
    except (OSError, subprocess.TimeoutExpired):
        pass
    return os.environ.get("TANDEM_COMMIT", "unknown"), None


def build_record(args: argparse.Namespace, results: list[RunResult]) -> dict:
    commit, dirty = git_commit(args.commit)
    parts = {p: _part(p, [r for r in results if r.part == p], args.parts) for p in PARTS}
    figures = {k: v for r in results for k, v in r.figures.items()}
    extra = derived({k: Figure(**v) for k, v in figures.items()})
    figures.update({k: f.to_dict() for k, f in extra.items()})
    tests = next((r for r in results if r.part == "tests"), None)
    return {"schema": rec.SCHEMA, "commit": commit, "dirty": dirty,
            "date": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "device": machine(args.device), "preset": "quick" if args.quick else "full",
            "host_cpu": host_cpu(), "versions": versions(), "argv": sys.argv[1:], "tolerance": args.tolerance,
            "tests": _tests_section(tests), "parts": parts, "figures": dict(sorted(figures.items())),
            "derived": sorted(extra)}


def _part(name: str, runs: list[RunResult], selected: list[str]) -> dict:
    if not runs:
        return {"status": "skipped", "duration_s": 0.0, "runs": {},
                "note": "not selected" if name not in selected else "no runs"}
    bad = [r for r in runs if r.status != "ok"]
    return {"status": "ok" if not bad else ("timeout" if all(r.status == "timeout" for r in bad) else "failed"),
            "duration_s": sum(r.duration_s for r in runs),
            "note": "; ".join(f"{r.name}: {r.status} {r.note}".strip() for r in runs if r.status != "ok" or r.note),
            "runs": {r.name: {"status": r.status, "duration_s": r.duration_s, "budget_s": r.budget_s,
                              "host_load": r.host_load, "returncode": r.returncode, "command": r.command,
                              "note": r.note,
                              "log_tail": r.log_tail} for r in runs}}


def _tests_section(run: RunResult | None) -> dict:
    if run is None:
        return {"status": "skipped", "passed": 0, "failed": 0, "errors": 0, "skipped": 0, "failing": []}
    from tandem.bench.suite_tests import read_summary
    raw = Path(run.command[run.command.index("--raw") + 1])
    return {"status": run.status, **read_summary(raw).to_dict()}


# ---- comparison and exit status ----
def judge(record: dict, previous: Path | None, args: argparse.Namespace) -> list[rec.Change]:
    """Compare with the previous record; the result goes into the record's comparison section."""
    changes = [] if previous is None else rec.compare(record, json.loads(previous.read_text()),
                                                      args.tolerance, args.tolerance_for)
    record["comparison"] = {"previous": None if previous is None else previous.name,
                            "tolerance": args.tolerance, "tolerance_for": args.tolerance_for,
                            "regressions": [c.to_dict() for c in changes if c.regression],
                            "changes": [c.to_dict() for c in changes]}
    return changes


def verdict(record: dict, changes: list[rec.Change]) -> tuple[int, list[str]]:
    """(exit status, reasons): a failed part, a failed test, a regression each make it 1."""
    reasons = [f"part {p}: {v['status']}" for p, v in record["parts"].items() if v["status"] not in ("ok", "skipped")]
    reasons += [f"test failed: {t}" for t in record["tests"].get("failing", [])]
    reasons += [f"REGRESSION {c.figure}: {c.old:,.4g} -> {c.new:,.4g} ({c.rel:+.1%}; tolerance {c.tolerance:.0%}, "
                f"{c.better} is better)" for c in changes if c.regression]
    return (1 if reasons else 0), reasons


def report(record: dict, changes: list[rec.Change], every_figure: bool = False) -> int:
    print(rec.format_table(record, changes, every_figure))
    code, reasons = verdict(record, changes)
    prev = record["comparison"]["previous"]
    print(f"\ncompared with {prev}" if prev else "\nno earlier record of this device and preset to compare with")
    for line in reasons:
        print(line)
    print("suite: " + ("FAILED" if code else "ok"))
    return code


def compare_only(args: argparse.Namespace) -> int:
    """--compare-only NEW [--against OLD]: judge an existing record again, running nothing."""
    path = Path(args.compare_only)
    record = json.loads(path.read_text())
    old = Path(args.against) if args.against else rec.previous_record(
        Path(args.history), record["device"], record["preset"], exclude=path, figures=set(record["figures"]))
    return report(record, judge(record, old, args), args.all_figures)


# ---- command line ----
def _pairs(text: str) -> tuple[str, float]:
    key, sep, value = text.rpartition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected NAME=NUMBER, got {text!r}")
    return key, float(value)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="tandem bench suite", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of: {','.join(PARTS)}")
    ap.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"])
    ap.add_argument("--quick", action="store_true", help="tiny preset and workloads (the CPU run in CI)")
    ap.add_argument("--out", help="where the record goes (default: docs/bench-records; quick: out/bench-records)")
    ap.add_argument("--history", help="earlier records to compare with (default: docs/bench-records; quick: --out)")
    ap.add_argument("--tolerance", type=float, default=0.07,
                    help="relative change beyond which a figure regresses (choose from run-to-run noise)")
    ap.add_argument("--tolerance-for", type=_pairs, action="append", default=[], metavar="GLOB=FRACTION",
                    help="another tolerance for figures matching GLOB, e.g. 'serve.*.ttft_p99_ms=0.25'")
    ap.add_argument("--budget", type=_pairs, action="append", default=[], metavar="RUN=SECONDS",
                    help="another time budget for one run (names as in the record's parts)")
    ap.add_argument("--deadline", type=float, help="seconds for the whole suite (default 590: one device call; quick 300)")
    ap.add_argument("--tests", nargs="+", help="test paths (default: tests; quick: tests/test_gpu_diagnostics.py)")
    ap.add_argument("--test-workers", type=int, help="processes for the tests' shared pass "
                    "(default: one per ~2.5 cores, at most 6, with pytest-xdist on a GPU; else 1)")
    ap.add_argument("--tokenizer", default=".model/tokenizer", help="saved tokenizer (tandem bench wheels)")
    ap.add_argument("--commit", help="the commit measured (the GPU machine's copy has no .git)")
    ap.add_argument("--all-figures", action="store_true", help="print every figure, not the headline ones")
    ap.add_argument("--compare-only", metavar="RECORD", help="judge this record again; run nothing")
    ap.add_argument("--against", metavar="RECORD", help="with --compare-only: the record to compare with")
    return ap


def _defaults(args: argparse.Namespace) -> None:
    args.parts = [p for p in args.parts.split(",") if p]
    unknown = set(args.parts) - set(PARTS)
    if unknown:
        raise SystemExit(f"tandem bench suite: unknown parts {sorted(unknown)}; choose from {','.join(PARTS)}")
    args.out = args.out or ("out/bench-records" if args.quick else "docs/bench-records")
    args.history = args.history or (args.out if args.quick else "docs/bench-records")
    args.deadline = args.deadline or (300.0 if args.quick else 590.0)
    args.tests = args.tests or (["tests/test_gpu_diagnostics.py"] if args.quick else ["tests"])
    args.tolerance_for = dict(args.tolerance_for)
    args.budget = dict(args.budget)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    _defaults(args)
    if args.compare_only:
        return compare_only(args)
    if args.quick:  # tiny models on a few shared cores: more OpenMP threads only contend (8-15x slower steps seen)
        os.environ.setdefault("OMP_NUM_THREADS", "1")
    out = Path(args.out)
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    raw = out / f"raw-{stamp}"
    raw.mkdir(parents=True, exist_ok=True)
    tokenizer = str(Path(args.tokenizer).resolve()) if Path(args.tokenizer).is_dir() else None
    ctx = Ctx(args.quick, args.device, raw.resolve(), tokenizer, args.tests, args.test_workers)
    runs = [r for r in plan(ctx) if r.part in args.parts]
    for r in runs:
        r.budget_s = args.budget.get(r.name, r.budget_s)
    deadline = time.monotonic() + args.deadline
    results = [execute(r, ctx, deadline) for r in runs]
    record = build_record(args, results)
    path = out / rec.record_name(record["date"], record["commit"])
    record["raw"] = raw.name
    previous = rec.previous_record(Path(args.history), record["device"], record["preset"], path,
                                   figures=set(record["figures"]))
    changes = judge(record, previous, args)
    code = report(record, changes, args.all_figures)
    path.write_text(json.dumps(record, indent=1) + "\n")
    print(f"record: {path}\nfor docs/benchmarks.md: {rec.summary_line(record, path.name)}")
    return code


if __name__ == "__main__":
    raise SystemExit(main())
