"""`tandem bench spec-overlap` on the CPU: the tiny preset drafting for itself decodes with
overlap on and off, every proposal accepted, and the report has each run's figures."""
import json

from tandem.bench import spec_overlap


def test_self_drafting_runs_overlap_on_and_off(tmp_path):
    out = tmp_path / "overlap.json"
    assert spec_overlap.main(["--preset", "tiny", "--speculative-config",
                              '{"model": "self", "num_speculative_tokens": 3}', "--batch-sizes", "1,2",
                              "--max-tokens", "12", "--prompt-len", "8", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["spec"], r["batch"], r["overlap"]) for r in rows] == \
           [(s, b, o) for s in (False, True) for b in (1, 2) for o in (True, False)]
    for r in rows:
        assert r["tok_s"] > 0 and r["gpu_busy"] is None  # CUDA events only
        if r["spec"]:
            assert r["verify_steps"] > 0 and r["mean_acceptance_length"] > 3.5  # k = 3: nearly 4
        else:
            assert r["verify_steps"] == 0 and r["mean_acceptance_length"] is None
