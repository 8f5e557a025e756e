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
            "--repeat", "1", "--prompts", "2", "--device", "cpu", "--dtype", "float32", "--json", str(out)]
    spec_tasks.main(argv + (["--same-process"] if same_process else []))
    report = json.loads(out.read_text())
    assert report["same_process"] is same_process
    rows = report["rows"]
    assert [(r["task"], r["batch"]) for r in rows] == [("copy", 1), ("copy", 2), ("chat", 1), ("chat", 2)]
    for r in rows:
        assert r["plain_tok_s"] > 0 and r["spec_tok_s"] > 0 and r["identical"]
        assert r["output_tokens"] == 10 * r["batch"] * 2  # two prompts
        assert len(r["plain_runs_ms"]) == len(r["spec_runs_ms"]) == 1  # --repeat 1
        # The reported rate is over both prompts' median runs: here the one run of each.
        assert r["plain_tok_s"] == pytest.approx(r["output_tokens"] / (r["plain_runs_ms"][0] / 1e3), rel=1e-3)
        assert len(r["prompt_speedups"]) == 2 and all(x > 0 for x in r["prompt_speedups"])
        assert r["first_difference"] == [None, None]
        # Per prompt, one run's steps: together the run's (a row's first step is its prefill's).
        assert [sum(c) for c in zip(*r["prompt_steps"])] == [r["steps"], r["verify_steps"]]
        assert all(steps > verify >= 0 for steps, verify in r["prompt_steps"])


def test_each_task_has_several_distinct_prompts():
    """A task's figure averages over texts: its prompts differ, and the first ones are the
    prompts of the one-prompt benchmark (before session 35), so `--prompts 1` reruns it."""
    for task, prompts in spec_tasks.TASKS.items():
        assert len(prompts) >= 4 and len(set(prompts)) == len(prompts), task
    assert spec_tasks.TASKS["copy"][0].endswith("that the lighthouse needed nothing at all.")
    assert "moving_average to rolling_mean" in spec_tasks.TASKS["edit_code"][0]
    for prompt in spec_tasks.TASKS["edit_code"]:
        old = prompt.split("Rename the function ")[1].split(" ")[0]
        assert f"def {old}(" in prompt  # the function to rename is in the code


def test_first_difference():
    assert spec_tasks.first_difference([1, 2, 3], [1, 2, 3]) is None
    assert spec_tasks.first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert spec_tasks.first_difference([1, 2], [1, 2, 3]) == 2
    assert spec_tasks._earliest_difference([[1, 2], [1, 2]], [[1, 2], [9, 2]]) == 0
    assert spec_tasks._earliest_difference([[1, 2]], [[1, 2]]) is None


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
                     "--prompts", "1", "--repeat", "1", "--device", "cpu", "--dtype", "float32", "--same-process",
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
                     "--prompts", "1", "--repeat", "1", "--device", "cpu", "--dtype", "float32", "--same-process",
                     "--temperature", "1.0",
                     "--speculative-config", json.dumps({"model": str(tiny_text_model), "num_speculative_tokens": 3}),
                     "--experiment", f"spec_coupled_draft={str(coupled).lower()}", "--json", str(out)])
    report = json.loads(out.read_text())
    assert report["temperature"] == 1.0
    (row,) = report["rows"]
    assert row["identical"] is coupled and row["output_tokens"] == 48


def test_rows_can_stop_at_eos(tiny_text_model, tmp_path):
    """`--stop-at-eos`: rows end at the end-of-sequence token (the tiny model's texts may end
    early), the rates are tokens over time on each side, and the report says so."""
    out = tmp_path / "spec.json"
    spec_tasks.main(["--model", str(tiny_text_model), "--tasks", "copy", "--batch-sizes", "1", "--max-tokens", "12",
                     "--prompts", "2", "--repeat", "1", "--device", "cpu", "--dtype", "float32", "--same-process",
                     "--stop-at-eos", "--json", str(out)])
    report = json.loads(out.read_text())
    (row,) = report["rows"]
    assert report["stop_at_eos"] is True and row["identical"] and 0 < row["output_tokens"] <= 24
    assert row["speedup"] == pytest.approx(row["spec_tok_s"] / row["plain_tok_s"])


@pytest.mark.parametrize("stop_at_eos", [False, True])
def test_timed_chat_ignores_eos_unless_told(stop_at_eos):
    import types
    seen = []

    class Stub:
        engine = types.SimpleNamespace(timeline=None)

        def chat(self, messages, params, **kw):
            seen.append(params)
            return []

    spec_tasks.timed_chat(Stub(), "copy", 2, 5, warm=False, prompt=3, stop_at_eos=stop_at_eos)
    (params,) = seen
    assert len(params) == 2 and all(p.ignore_eos is not stop_at_eos and p.max_tokens == 5 for p in params)


def test_forward_ms_by_kind_splits_plain_verify_and_empty_verify_steps():
    from tandem.bench.spec_tasks import forward_ms_by_kind
    from tandem.diagnostics.timeline import StepRecord

    def record(is_decode, ms, verify_k=None):
        return StepRecord(0, 1, 1, is_decode, 10, 10, 0.0, 0.1, 0.1, gpu_forward_ms=ms, verify_k=verify_k)

    records = [record(False, 5.0), record(True, 0.6), record(True, 0.7), record(True, 1.1, 15),
               record(True, 1.3, 15), record(True, 1.2, 15), record(True, 0.8, 0), record(True, None)]
    assert forward_ms_by_kind(records) == {"prefill": [1, 5.0], "decode": [3, 0.65], "verify": [3, 1.2],
                                           "verify_empty": [1, 0.8]}
    assert forward_ms_by_kind([record(True, None)]) == {"decode": [1, None]}  # the CPU: no device times
