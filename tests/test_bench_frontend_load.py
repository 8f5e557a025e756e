"""The front-end load benchmark: `tandem serve` with a paced engine process (no model)."""
import json
import time

import pytest

from tandem.bench.frontend_load import PacedEngine, main
from tandem.sampling import SamplingParams

pytest.importorskip("fastapi")


def test_the_paced_engine_gives_one_token_a_step_to_its_running_requests():
    engine = PacedEngine(step_s=0.01, max_running=2, max_model_len=64, vocab_size=512)
    for rid, n in (("a", 2), ("b", 3), ("c", 1)):
        engine.add_request([1, 2], SamplingParams(max_tokens=n), rid)
    t = time.monotonic()
    steps = []
    while engine.has_unfinished():
        steps.append([(o.request_id, o.finished) for o in engine.step()])
    assert steps == [[("a", False), ("b", False)], [("a", True), ("b", False)], [("b", True), ("c", True)]]
    assert time.monotonic() - t >= 0.02  # paced: the first step at once, then one each step_s
    assert engine.stats()["running"] == 0


def test_the_front_end_carries_every_token_of_every_stream(tmp_path):
    out = tmp_path / "rows.json"
    assert main(["--num-prompts", "12", "--output-len", "15", "--step-ms", "4", "--client-processes", "2",
                 "--json", str(out)]) == 0
    (row,) = json.loads(out.read_text())
    assert row["failed"] == 0 and row["output_tokens"] == 12 * 15 and row["ttft_ms"]["p50"] > 0
    assert row["front_end_cpu_us_per_token"] > 0 and 0 < row["front_end_cpu_share"]
    assert row["client_lag_ms"]["p99"] is not None
