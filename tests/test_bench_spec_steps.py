"""`tandem bench spec-steps` on the CPU: the built-in model's copy task groups its timed
steps by kind (plain: decode steps only; speculative: verify steps that accepted proposals),
and the report has each group's figures."""
import json

import pytest

from tandem.bench import spec_steps


@pytest.mark.slow  # ~35 s: the built-in model, four generations
def test_steps_are_grouped_by_kind_with_their_figures(tmp_path):
    out = tmp_path / "steps.json"
    assert spec_steps.main(["--task", "copy", "--max-tokens", "12", "--host-profile", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    plain, spec = report["plain"], report["spec"]
    assert set(plain["groups"]) == {"decode"} and set(plain["kinds"]) <= {"p", "d"}
    assert plain["groups"]["decode"]["steps"] == plain["kinds"].count("d")
    verify = spec["groups"]["verify"]
    assert 0 < verify["accepted"] <= verify["proposed"] and verify["steps"] == spec["kinds"].count("V")
    assert verify["launch_ms"] > 0 and verify["schedule_ms"] > 0
    assert verify["gpu_forward_ms"] is None  # CUDA events only
    assert "_queue_verify" in spec["host_profile"] and "_queue_verify" not in plain["host_profile"]
