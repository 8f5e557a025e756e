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


# ---- the client against a scripted SSE server: several processes, results back in order ----
class _ScriptedSSE:
    """A raw asyncio HTTP/1.1 server on a thread: each request streams `max_tokens` completion
    chunks, `gap_s` apart, then [DONE]. It counts the streams open at once (peak)."""

    def __init__(self, gap_s: float = 0.001):
        import asyncio
        import threading
        self.gap_s, self.open, self.peak = gap_s, 0, 0
        self.events: list[str] = []  # "GET" / "POST" in arrival order
        self.loop = asyncio.new_event_loop()
        ready = threading.Event()

        def serve():
            asyncio.set_event_loop(self.loop)
            self.server = self.loop.run_until_complete(asyncio.start_server(self._handle, "127.0.0.1", 0))
            self.port = self.server.sockets[0].getsockname()[1]
            ready.set()
            self.loop.run_forever()

        self.thread = threading.Thread(target=serve, daemon=True)
        self.thread.start()
        ready.wait(10)

    async def _handle(self, reader, writer):
        import asyncio
        import json
        while True:
            try:
                head = await reader.readuntil(b"\r\n\r\n")
            except (asyncio.IncompleteReadError, ConnectionError):
                return
            self.events.append(head.split(b" ", 1)[0].decode())
            if head.startswith(b"GET "):  # the client's warm-up: /v1/models
                models = b'{"object": "list", "data": []}'
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
                             % (len(models), models))
                await writer.drain()
                continue
            length = next(int(h.split(b":")[1]) for h in head.split(b"\r\n") if h.lower().startswith(b"content-length:"))
            body = json.loads(await reader.readexactly(length))
            self.open += 1
            self.peak = max(self.peak, self.open)
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
            for _ in range(body["max_tokens"]):
                line = b'data: {"choices": [{"index": 0, "text": "x"}]}\n\n'
                writer.write(b"%x\r\n%s\r\n" % (len(line), line))
                await writer.drain()
                await asyncio.sleep(self.gap_s)
            self.open -= 1
            done = b"data: [DONE]\n\n"
            writer.write(b"%x\r\n%s\r\n0\r\n\r\n" % (len(done), done))
            await writer.drain()

    def close(self):
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


def _run(server, reqs, processes, **kw):
    from tandem.bench.serve import run_rate
    return run_rate(f"http://127.0.0.1:{server.port}/v1/completions", reqs, kw.pop("rate", math.inf), model=None,
                    chat=False, ignore_eos=False, seed=0, api_key=None, max_concurrency=kw.pop("cap", None),
                    processes=processes)


def test_requests_sent_from_several_processes_come_back_in_workload_order():
    """Each request asks for its own number of chunks; every result must carry its own count (a
    merge that mixed up the processes' parts would not)."""
    from tandem.bench.serve import BenchRequest
    server = _ScriptedSSE()
    try:
        reqs = [BenchRequest("p", 1, n) for n in (3, 9, 4, 7, 2, 8, 5)]
        run = _run(server, reqs, processes=3, rate=200.0)
        assert [r.output_tokens for r in run.results] == [3, 9, 4, 7, 2, 8, 5]
        assert all(r.ok and len(r.itl) == r.output_tokens - 1 and r.ttft > 0 for r in run.results)
        assert run.duration > 0 and run.client_lag_ms and all(lag > -1.0 for lag in run.client_lag_ms)
        one = _run(server, reqs, processes=1)
        assert [r.output_tokens for r in one.results] == [3, 9, 4, 7, 2, 8, 5]
    finally:
        server.close()


def test_each_client_process_warms_its_connection_up_before_the_clock_starts():
    """A process's first request pays for lazy imports and its first connection (70-220 ms of
    TTFT on the CPU box): one untimed GET per process, all before the first timed request."""
    from tandem.bench.serve import BenchRequest
    server = _ScriptedSSE()
    try:
        reqs = [BenchRequest("p", 1, 3) for _ in range(6)]
        assert all(r.ok for r in _run(server, reqs, processes=3, rate=200.0).results)
        assert server.events[:3] == ["GET"] * 3 and server.events[3:] == ["POST"] * 6
        server.events.clear()
        assert all(r.ok for r in _run(server, reqs, processes=1).results)
        assert server.events == ["GET"] + ["POST"] * 6
    finally:
        server.close()


def test_a_client_process_that_fails_before_the_start_says_why(monkeypatch):
    """An error before a process is ready (its warm-up) comes back as the run's error, and the
    other processes are not left waiting (forked: the patched warm-up is theirs too)."""
    from tandem.bench import serve

    async def broken(http, url):
        raise ValueError("no warm-up")

    monkeypatch.setattr(serve, "_warm_up", broken)
    server = _ScriptedSSE()
    try:
        with pytest.raises(RuntimeError, match="client process failed: ValueError: no warm-up"):
            _run(server, [serve.BenchRequest("p", 1, 3)] * 4, processes=2)
    finally:
        server.close()


def test_a_concurrency_cap_holds_across_client_processes():
    from tandem.bench.serve import BenchRequest
    server = _ScriptedSSE(gap_s=0.01)
    try:
        reqs = [BenchRequest("p", 1, 4) for _ in range(8)]
        run = _run(server, reqs, processes=4, cap=3)
        assert all(r.ok for r in run.results) and server.peak <= 3  # caps 1 + 1 + 1 of the 3 processes left
        server.peak = 0
        assert all(r.ok for r in _run(server, reqs, processes=4).results) and server.peak > 3  # the check can fail
    finally:
        server.close()


def test_summarize_reports_the_clients_event_loop_lag():
    s = summarize([RequestResult(True, output_tokens=2, ttft=0.1, e2e=0.2, itl=[0.1])], 1.0, 1.0,
                  client_lag_ms=[0.1] * 99 + [50.0])
    assert s["client_lag_ms"]["p50"] == pytest.approx(0.1) and s["client_lag_ms"]["max"] == 50.0
    assert summarize([], 1.0, 1.0)["client_lag_ms"] == {"p50": None, "p99": None, "max": None}


def test_server_ttft_quantiles_from_two_metrics_reads():
    from tandem.bench.launch import histogram_quantiles
    name = "tandem_time_to_first_token_seconds"

    def read(counts, total):
        m = {f'{name}_bucket{{le="{le}"}}': c for le, c in zip(("0.01", "0.02", "0.04", "+Inf"), counts)}
        return {**m, f"{name}_count": counts[-1], f"{name}_sum": total}

    before = read((1, 1, 1, 1), 0.005)
    after = read((1, 5, 11, 11), 0.005 + 10 * 0.02)  # 4 in (0.01, 0.02], 6 in (0.02, 0.04]
    q = histogram_quantiles(before, after, name)
    assert q["mean"] == pytest.approx(20.0)
    assert q["p50"] == pytest.approx(20.0 + 20.0 * (5 - 4) / 6)  # the 5th of 10 is the 1st of 6 above 20 ms
    assert q["p90"] == pytest.approx(20.0 + 20.0 * (9 - 4) / 6)
    assert histogram_quantiles(after, after, name) == {"mean": None, "p50": None, "p90": None, "p99": None}


def test_a_processs_cpu_seconds_and_the_front_ends_share():
    import os
    import time

    from tandem.bench.launch import cpu_seconds, front_end_cpu
    before, t = cpu_seconds(os.getpid()), time.process_time()
    while time.process_time() - t < 0.2:  # busy: CPU time, not sleep
        pass
    assert cpu_seconds(os.getpid()) - before >= 0.15
    assert cpu_seconds(2**22 + 7) is None  # no such process
    assert front_end_cpu(3.0, 1.0, 4.0, 20_000) == {"front_end_cpu_us_per_token": 100.0, "front_end_cpu_share": 0.5}
    assert front_end_cpu(None, 1.0, 4.0, 10)["front_end_cpu_share"] is None
