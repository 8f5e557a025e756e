"""The suite's test part: which tests run on the GPU, and what came of them.

Selection is by what the tests say about themselves, never a hand-kept list: a test runs if it
carries the `gpu` marker, or if its module takes its device from TANDEM_TEST_DEVICE (imports
`TEST_DEVICE` from tests/tiny_models.py, as the engine tests do). Used as a pytest plugin:
`pytest -p tandem.bench.suite_tests tests`.
"""
from __future__ import annotations

import re
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

    def to_dict(self) -> dict:
        return asdict(self)


def from_junit(path: Path) -> TestSummary:
    s = TestSummary()
    for case in ET.parse(path).getroot().iter("testcase"):
        tid = _test_id(case)
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
    return s


def _test_id(case: ET.Element) -> str:
    """tests/test_x.py::test_y from junit's classname (tests.test_x) and name."""
    classname, name = case.get("classname", ""), case.get("name", "")
    parts = classname.split(".")
    for i in range(len(parts), 0, -1):  # module path, then any test class
        if parts[i - 1].startswith("test_"):
            return "::".join(["/".join(parts[:i]) + ".py", *parts[i:], name])
    return f"{classname}::{name}"


_VERBOSE = re.compile(r"^(\S+::\S+) (PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\b", re.M)


def from_verbose_log(text: str) -> TestSummary:
    """`pytest -v` lines, for a run cut short before junit was written."""
    s = TestSummary(complete=False)
    for tid, outcome in _VERBOSE.findall(text):
        if outcome in ("PASSED", "XPASS"):
            s.passed += 1
        elif outcome in ("SKIPPED", "XFAIL"):
            s.skipped += 1
        else:
            s.failed += outcome == "FAILED"
            s.errors += outcome == "ERROR"
            s.failing.append(tid)
    return s


def summarize(junit: Path, log: Path) -> TestSummary:
    if junit.exists():
        try:
            return from_junit(junit)
        except ET.ParseError:
            pass
    return from_verbose_log(log.read_text(errors="replace") if log.exists() else "")
