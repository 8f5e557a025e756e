"""`tandem bench spec` on the CPU: both sides (plain, speculative) run in fresh processes by
default and in this one with `--same-process`; either way each row has both sides' figures
and greedy speculation emits plain decoding's tokens (float32)."""
import json

import pytest

from tandem.bench import spec_tasks


@pytest.mark.parametrize("same_process", [False, True])
def test_rows_have_both_sides(tiny_text_model, tmp_path, same_process):
    out = tmp_path / "spec.json"
    argv = ["--model", str(tiny_text_model), "--tasks", "copy,chat", "--batch-sizes", "1,2", "--max-tokens", "10",
            "--repeat", "1", "--device", "cpu", "--dtype", "float32", "--json", str(out)]
    spec_tasks.main(argv + (["--same-process"] if same_process else []))
    report = json.loads(out.read_text())
    assert report["same_process"] is same_process
    rows = report["rows"]
    assert [(r["task"], r["batch"]) for r in rows] == [("copy", 1), ("copy", 2), ("chat", 1), ("chat", 2)]
    for r in rows:
        assert r["plain_tok_s"] > 0 and r["spec_tok_s"] > 0 and r["identical"]
        assert r["output_tokens"] == 10 * r["batch"]
        assert len(r["plain_runs_ms"]) == len(r["spec_runs_ms"]) == 1  # --repeat 1
        # The reported rate is the median run's: here the one run.
        assert r["plain_tok_s"] == pytest.approx(r["output_tokens"] / (r["plain_runs_ms"][0] / 1e3), rel=1e-3)


def test_experiments_reach_both_sides_engines(tiny_text_model, tmp_path, monkeypatch):
    """`--experiment NAME=VALUE` builds each side's engine with that switch (the H200 A/B of the
    verify rule: spec_verify_min_match=1 against the default), and the report names it."""
    seen = []

    class Recording(spec_tasks.LLM):
        def __init__(self, *args, **kw):
            super().__init__(*args, **kw)
            seen.append(self.engine.cfg.experiments.spec_verify_min_match)

    monkeypatch.setattr(spec_tasks, "LLM", Recording)
    out = tmp_path / "spec.json"
    spec_tasks.main(["--model", str(tiny_text_model), "--tasks", "copy", "--batch-sizes", "1", "--max-tokens", "4",
                     "--repeat", "1", "--device", "cpu", "--dtype", "float32", "--same-process",
                     "--experiment", "spec_verify_min_match=1", "--json", str(out)])
    assert seen == [1, 1]
    assert json.loads(out.read_text())["experiments"] == ["spec_verify_min_match=1"]
    with pytest.raises(ValueError, match="--experiment takes NAME=VALUE"):
        spec_tasks.main(["--experiment", "no_such_switch=1", "--device", "cpu"])


@pytest.mark.parametrize("coupled", [False, True])
def test_sampled_rows_with_a_draft_are_plain_decodings_when_coupled(tiny_text_model, tmp_path, coupled):
    """`--temperature` samples each row with its own seed; with a
    model drafting for itself, coupled draws (`spec_coupled_draft`) emit plain decoding's tokens,
    rejection sampling other ones, and the row says which ('identical')."""
    out = tmp_path / "spec.json"
    spec_tasks.main(["--model", str(tiny_text_model), "--tasks", "chat", "--batch-sizes", "2", "--max-tokens", "24",
                     "--repeat", "1", "--device", "cpu", "--dtype", "float32", "--same-process", "--temperature", "1.0",
                     "--speculative-config", json.dumps({"model": str(tiny_text_model), "num_speculative_tokens": 3}),
                     "--experiment", f"spec_coupled_draft={str(coupled).lower()}", "--json", str(out)])
    report = json.loads(out.read_text())
    assert report["temperature"] == 1.0
    (row,) = report["rows"]
    assert row["identical"] is coupled and row["output_tokens"] == 48
