"""`tandem bench soak` at small scale: fuzzed traffic through a real server, checked end to end.

The soak passes only when every greedy answer equals the overlap-off, cache-off reference
server's, nothing answers 5xx, every bad input gets a 4xx and no KV stays in use. The
second test points the reference at different weights: the comparison must catch it.
"""
import json

import pytest

from tandem.bench.soak import find_mismatches, main
from tandem.bench.soak_cases import Planner
from tandem.bench.soak_client import Outcome


@pytest.mark.slow
def test_small_soak_passes_with_every_check(tiny_text_model, tmp_path):
    rc = main(["--requests", "200", "--concurrency", "16", "--device", "cpu", "--model", str(tiny_text_model),
               "--max-model-len", "512", "--bad-fraction", "0.15", "--sampled-fraction", "0.05",
               "--out", str(tmp_path)])
    report = json.loads((tmp_path / "results.json").read_text())
    c = report["counts"]
    assert rc == 0 and report["passed"], json.dumps({k: report[k] for k in ("counts", "problems", "mismatches")})
    assert (c["mismatches"], c["server_errors_5xx"], c["stream_errors"], c["broken"]) == (0, 0, 0, 0)
    assert c["settled"] and c["kv_usage_after_reset"] == 0
    assert c["bad_refused"] == c["bad"] > 10 and c["bad_accepted"] == 0
    assert c["greedy_compared"] > 80 and c["disconnected"] > 0 and c["aborted"] > 0
    assert c["sent"] == 200 == c["completed"] + c["disconnected"] + c["aborted"] + c["bad_refused"] + c["good_refused"]
    rss = report["rss_mib"]
    assert all(0 < rss[p]["start"] <= rss[p]["peak"] for p in ("front_end", "engine"))


@pytest.mark.slow
def test_soak_catches_a_reference_that_answers_differently(tiny_text_model, tmp_path):
    # Same tokenizer and shapes, random weights: every greedy text differs.
    rc = main(["--requests", "12", "--concurrency", "8", "--device", "cpu", "--model", str(tiny_text_model),
               "--max-model-len", "512", "--bad-fraction", "0", "--out", str(tmp_path),
               "--reference-args", "--disable-overlap --dummy-weights"])
    report = json.loads((tmp_path / "results.json").read_text())
    assert rc == 1 and not report["passed"]
    assert 0 < report["counts"]["mismatches"] <= report["counts"]["greedy_compared"]
    # Each mismatch says where the reference's tokens left the answer and how close the pick was.
    assert any(m["divergence"] and m["divergence"]["top2_gap"] > 0 for m in report["mismatches"])


def test_mismatch_is_any_choice_text_or_finish_reason():
    ref = Outcome(0, "good", "completed", 200, ["ab", "ab"], ["length", "length"])
    same = Outcome(1, "good", "completed", 200, ["ab", "ab"], ["length", "length"])
    text = Outcome(2, "good", "completed", 200, ["ab", "ac"], ["length", "length"])
    reason = Outcome(3, "good", "completed", 200, ["ab", "ab"], ["length", "stop"])
    assert [m["index"] for m in find_mismatches([same, text, reason], ref, "k")] == [2, 3]


def test_plan_is_seeded_and_mixes_every_kind():
    plan = lambda: Planner(3, "m", 1000, 256, 4096).plan(400, 0.2)  # noqa: E731
    a, b = plan(), plan()
    assert [(c.path, c.body, c.leave) for c in a] == [(c.path, c.body, c.leave) for c in b]
    good = [c for c in a if c.kind == "good"]
    assert {c.path for c in good} == {"completions", "chat/completions"}
    assert {c.leave for c in good} == {"complete", "disconnect", "abort"}
    assert any(c.stream for c in good) and any(c.greedy for c in good) and any(c.choices > 1 for c in good)
    assert len({c.kind for c in a}) > 20  # many kinds of bad input
    stops = [json.loads(c.body).get("stop") for c in good]
    assert any(stops)
