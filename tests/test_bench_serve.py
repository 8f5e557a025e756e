"""The serving benchmark's pure parts: arrivals, workload, statistics, table (its run against a
real server is in test_server.py, which owns the server process)."""
import math

import numpy as np
import pytest

from tandem.bench.serve import (RequestResult, build_parser, format_table, make_workload,
                                poisson_arrivals, summarize)


def test_poisson_arrivals_rate_and_seed():
    times = poisson_arrivals(20000, 50.0, np.random.default_rng(3))
    assert times[0] == 0 and np.all(np.diff(times) >= 0)
    gaps = np.diff(times)
    assert gaps.mean() == pytest.approx(1 / 50, rel=0.03)
    assert gaps.std() == pytest.approx(1 / 50, rel=0.05)  # exponential: std == mean
    again = poisson_arrivals(20000, 50.0, np.random.default_rng(3))
    assert np.array_equal(times, again)
    assert np.array_equal(poisson_arrivals(5, math.inf, np.random.default_rng(0)), np.zeros(5))


def test_workload_lengths_and_prompt_kinds():
    reqs = make_workload(200, (3, 9), (5, 6), seed=1, text=False, id_range=(100, 200))
    assert all(len(r.prompt) == r.input_len and 3 <= r.input_len <= 9 for r in reqs)
    assert {r.output_len for r in reqs} == {5, 6} and {r.input_len for r in reqs} == set(range(3, 10))
    assert all(100 <= t < 200 for r in reqs for t in r.prompt)
    assert [r.prompt for r in reqs] == [r.prompt for r in make_workload(200, (3, 9), (5, 6), 1, False, (100, 200))]
    text = make_workload(4, (7, 7), (1, 1), seed=1, text=True, id_range=(0, 1))
    assert all(isinstance(r.prompt, str) and len(r.prompt.split()) == 7 for r in text)


def test_summarize_figures():
    results = [RequestResult(True, prompt_tokens=10, output_tokens=5, ttft=0.1, e2e=0.5, itl=[0.1] * 4),
               RequestResult(True, prompt_tokens=20, output_tokens=3, ttft=0.3, e2e=0.7, itl=[0.2, 0.2]),
               RequestResult(False, error="HTTP 503: busy")]
    s = summarize(results, duration=2.0, rate=4.0)
    assert (s["completed"], s["failed"], s["errors"]) == (2, 1, ["HTTP 503: busy"])
    assert s["request_throughput"] == 1.0
    assert s["output_token_throughput"] == 4.0 and s["total_token_throughput"] == 19.0
    assert s["ttft_ms"]["p50"] == pytest.approx(200.0) and s["ttft_ms"]["p99"] == pytest.approx(298.0)
    assert s["tpot_ms"]["mean"] == pytest.approx(150.0)  # (0.4/4 + 0.4/2) / 2
    assert s["itl_ms"]["p50"] == pytest.approx(100.0) and s["itl_ms"]["p90"] == pytest.approx(200.0)
    table = format_table([s])
    assert "TTFT p50/p90/p99 ms" in table and "200.0/" in table.splitlines()[1]


def test_summarize_with_nothing_completed():
    s = summarize([RequestResult(False, error="x")], duration=1.0, rate=math.inf)
    assert s["request_rate"] == "inf" and s["ttft_ms"]["p50"] is None
    assert "-/-/-" in format_table([s])


def test_cli_parses_rates_and_ranges():
    args = build_parser().parse_args(["--rates", "1,4,inf", "--input-len", "8:16", "--output-len", "32"])
    assert args.rates == [1.0, 4.0, math.inf] and args.input_len == (8, 16) and args.output_len == (32, 32)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--rates", "0"])
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--input-len", "9:3"])
