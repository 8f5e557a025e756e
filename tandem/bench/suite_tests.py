"""The suite's test part: which tests run on the GPU, and what came of them.

Selection is by what the tests say about themselves, never a hand-kept list: a test runs if it
carries the `gpu` marker, or if its module takes its device from TANDEM_TEST_DEVICE (imports
`TEST_DEVICE` from tests/tiny_models.py, as the engine tests do). Used as a pytest plugin:
`pytest -p tandem.bench.suite_tests tests`.

Run as a module it is the part's driver, two pytest passes into one summary (tests.json):
the shared pass spreads the selection over several worker processes on the one GPU
(pytest-xdist, a file per worker at a time: the tiny test models' pools are a few MiB, see
Engine._build_memory's cap), then the `whole_gpu` tests run alone, since they size pools from
or measure the whole device's memory. One process for everything took ~470 s on the H200.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from dataclasses import asdict, dataclass, field
from pathlib import Path


def selected(item) -> bool:
    """A GPU-marked test, or one whose module runs on TANDEM_TEST_DEVICE."""
    if item.get_closest_marker("gpu") is not None:
        return True
    module = getattr(item, "module", None)
    return module is not None and "TEST_DEVICE" in vars(module)


def pytest_collection_modifyitems(config, items) -> None:
    keep = [i for i in items if selected(i)]
    dropped = [i for i in items if not selected(i)]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
    items[:] = keep


@dataclass
class TestSummary:
    passed: int = 0
    failed: int = 0
    errors: int = 0  # errors in set-up, tear-down or collection
    skipped: int = 0
    failing: list[str] = field(default_factory=list)  # ids of failed and errored tests
    complete: bool = True  # False: read from a log cut short (the run timed out)
    # Where the part's device time goes, to split or spread what holds it up: each pass's wall
    # seconds, and the files whose tests took longest (a file runs on one worker: `--dist loadfile`).
    pass_seconds: dict[str, float] = field(default_factory=dict)
    # [[path, seconds], ...], longest first: every file in one pass's summary, the SLOWEST_FILES
    # longest in the merged one (ranked after summing a file's passes, so none loses its time).
    slowest_files: list[list] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


SLOWEST_FILES = 10


def _ranked(seconds_by_file: dict[str, float], limit: int | None = None) -> list[list]:
    ranked = sorted(seconds_by_file.items(), key=lambda kv: -kv[1])[:limit]
    return [[path, round(sec, 1)] for path, sec in ranked]


def from_junit(path: Path) -> TestSummary:
    s = TestSummary()
    seconds_by_file: dict[str, float] = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        tid = _test_id(case)
        file = tid.split("::", 1)[0]
        seconds_by_file[file] = seconds_by_file.get(file, 0.0) + float(case.get("time") or 0)
        if case.find("failure") is not None:
            s.failed += 1
            s.failing.append(tid)
        elif case.find("error") is not None:
            s.errors += 1
            s.failing.append(tid)
        elif case.find("skipped") is not None:
            s.skipped += 1
        else:
            s.passed += 1
    s.slowest_files = _ranked(seconds_by_file)
    return s


def _test_id(case: ET.Element) -> str:
    """tests/test_x.py::test_y from junit's classname (tests.test_x) and name."""
    classname, name = case.get("classname", ""), case.get("name", "")
    parts = classname.split(".")
    for i in range(len(parts), 0, -1):  # module path, then any test class
        if parts[i - 1].startswith("test_"):
            return "::".join(["/".join(parts[:i]) + ".py", *parts[i:], name])
    return f"{classname}::{name}"


_OUTCOMES = "PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS"
_VERBOSE = re.compile(rf"^(\S+::\S+) ({_OUTCOMES})\b", re.M)
_VERBOSE_XDIST = re.compile(rf"^\[gw\d+\] \[\s*\d+%\] ({_OUTCOMES}) (\S+::\S+)", re.M)


def from_verbose_log(text: str) -> TestSummary:
    """`pytest -v` lines (a single process's or xdist workers'), for a run cut short before
    junit was written."""
    s = TestSummary(complete=False)
    found = _VERBOSE.findall(text) + [(tid, outcome) for outcome, tid in _VERBOSE_XDIST.findall(text)]
    for tid, outcome in found:
        if outcome in ("PASSED", "XPASS"):
            s.passed += 1
        elif outcome in ("SKIPPED", "XFAIL"):
            s.skipped += 1
        else:
            s.failed += outcome == "FAILED"
            s.errors += outcome == "ERROR"
            s.failing.append(tid)
    return s


def merge(summaries: list[TestSummary]) -> TestSummary:
    out = TestSummary()
    seconds_by_file: dict[str, float] = {}
    for s in summaries:
        out.passed, out.failed, out.errors = out.passed + s.passed, out.failed + s.failed, out.errors + s.errors
        out.skipped += s.skipped
        out.failing += s.failing
        out.complete = out.complete and s.complete
        out.pass_seconds.update(s.pass_seconds)
        for path, sec in s.slowest_files:
            seconds_by_file[path] = seconds_by_file.get(path, 0.0) + sec
    out.slowest_files = _ranked(seconds_by_file, SLOWEST_FILES)
    return out


def summarize(junit: Path, log: Path) -> TestSummary:
    """One pass: its junit file, or its log's verbose lines when it was cut short."""
    if junit.exists():
        try:
            return from_junit(junit)
        except ET.ParseError:
            pass
    return from_verbose_log(log.read_text(errors="replace") if log.exists() else "")


# ---- the driver: two passes, one summary ----
PASSES = (("shared", "not whole_gpu"), ("whole-gpu", "whole_gpu"))


def summary_path(raw: Path) -> Path:
    return raw / "tests.json"


def read_summary(raw: Path) -> TestSummary:
    """The driver's summary; else (it was stopped) what each pass's junit or log holds."""
    try:
        return TestSummary(**json.loads(summary_path(raw).read_text()))
    except (OSError, ValueError, TypeError):
        return merge([summarize(raw / f"tests-{name}.xml", raw / f"tests-{name}.log") for name, _ in PASSES])


def default_workers(device: str) -> int:
    """Worker processes for the shared pass: one per ~2.5 cores, at most 6 (each holds a CUDA
    context and compiles its own Triton kernels); 1 on the CPU or without pytest-xdist."""
    if device == "cpu" or importlib.util.find_spec("xdist") is None:
        return 1
    return max(1, min(6, (os.cpu_count() or 1) * 2 // 5))


def pass_argv(paths: list[str], name: str, marks: str, workers: int, raw: Path) -> list[str]:
    argv = [sys.executable, "-m", "pytest", *paths, "-p", "tandem.bench.suite_tests", "-p", "no:cacheprovider",
            "-m", marks, "-v", "-rfE", "--continue-on-collection-errors", "--durations=15",
            f"--junitxml={raw / f'tests-{name}.xml'}"]
    if workers > 1:
        argv += ["-n", str(workers), "--dist", "loadfile"]
    return argv


def run_passes(paths: list[str], raw: Path, workers: int) -> int:
    """Both passes (the second even when the first failed), each into its own log; the
    summary goes to tests.json. Exit status 1 when a test failed or a pass did not finish."""
    codes, summaries = [], []
    for name, marks in PASSES:
        n = workers if name == "shared" else 1
        env = dict(os.environ)
        if n > 1:  # the workers share the cores: torch's default (a thread per core each) contends
            env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // n)))
        log = raw / f"tests-{name}.log"
        print(f"[tests] {name} pass ({marks}), {n} process(es): {log.name}", flush=True)
        started = time.monotonic()
        with open(log, "w") as out:
            code = subprocess.run(pass_argv(paths, name, marks, n, raw), stdout=out, stderr=subprocess.STDOUT,
                                  env=env).returncode
        s = summarize(raw / f"tests-{name}.xml", log)
        s.pass_seconds = {name: round(time.monotonic() - started, 1)}
        print(f"[tests] {name}: exit {code}, {s.passed} passed, {s.failed} failed, {s.errors} errors, "
              f"{s.skipped} skipped in {s.pass_seconds[name]} s; longest files: "
              + ", ".join(f"{path} {sec} s" for path, sec in s.slowest_files[:5]), flush=True)
        codes.append(0 if code == 5 else code)  # 5: the pass selected nothing
        summaries.append(s)
    total = merge(summaries)
    summary_path(raw).write_text(json.dumps(total.to_dict(), indent=1) + "\n")
    return 0 if not any(codes) and not total.failing else 1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tandem.bench.suite_tests", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("paths", nargs="+")
    ap.add_argument("--raw", required=True, type=Path, help="folder for the passes' logs, junit and tests.json")
    ap.add_argument("--workers", type=int, default=1, help="processes for the shared pass")
    args = ap.parse_args(argv)
    args.raw.mkdir(parents=True, exist_ok=True)
    return run_passes(args.paths, args.raw, args.workers)


if __name__ == "__main__":
    raise SystemExit(main())
