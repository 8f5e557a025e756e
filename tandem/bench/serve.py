"""`tandem bench serve`: Poisson arrivals against any OpenAI-compatible server.

For each request rate, sends the same seeded workload (input and output lengths
uniform in given ranges) as streamed completions and measures, per request,
time to first token (TTFT), the gaps between streamed tokens (ITL), time per
output token after the first (TPOT) and end-to-end latency; then p50/p90/p99
of each plus request and token throughput. Prints a table; `--json` writes all
figures.

Prompts are random token ids by default (exact lengths, and the server needs no
tokenizer, e.g. a `--dummy-weights` model); `--text-prompts` sends random words
instead (for servers that only take text, and for the chat endpoint). Token
counts come from the server's usage report (`stream_options.include_usage`).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import multiprocessing
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Callable

import httpx
import numpy as np

_WORDS = ("time river light stone house voice paper green music field window story number "
          "garden market winter bridge letter school forest cloud table summer mountain").split()


@dataclass
class BenchRequest:
    prompt: list[int] | str
    input_len: int  # tokens asked for (words for text prompts)
    output_len: int


@dataclass
class RequestResult:
    ok: bool
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    error: str = ""

    @property
    def tpot(self) -> float | None:
        return (self.e2e - self.ttft) / (self.output_tokens - 1) if self.output_tokens > 1 else None


def poisson_arrivals(n: int, rate: float, rng: np.random.Generator) -> np.ndarray:
    """Send times (s from start) of n requests arriving as a Poisson process; inf: all at once."""
    if math.isinf(rate):
        return np.zeros(n)
    gaps = rng.exponential(1.0 / rate, size=n)
    return np.concatenate([[0.0], np.cumsum(gaps[:-1])]) if n else gaps


def make_workload(n: int, input_range: tuple[int, int], output_range: tuple[int, int], seed: int,
                  text: bool, id_range: tuple[int, int]) -> list[BenchRequest]:
    rng = np.random.default_rng(seed)
    ins = rng.integers(input_range[0], input_range[1] + 1, size=n)
    outs = rng.integers(output_range[0], output_range[1] + 1, size=n)
    reqs = []
    for i, o in zip(ins.tolist(), outs.tolist()):
        if text:
            prompt: list[int] | str = " ".join(rng.choice(_WORDS, size=i).tolist())
        else:
            prompt = rng.integers(id_range[0], id_range[1], size=i).tolist()
        reqs.append(BenchRequest(prompt, i, o))
    return reqs


def _body(req: BenchRequest, model: str | None, chat: bool, ignore_eos: bool) -> dict:
    body: dict = {"max_tokens": req.output_len, "temperature": 0.0, "stream": True,
                  "stream_options": {"include_usage": True}}
    if model:
        body["model"] = model
    if ignore_eos:
        body["ignore_eos"] = True
    if chat:
        body["messages"] = [{"role": "user", "content": req.prompt}]
    else:
        body["prompt"] = req.prompt
    return body


async def send_one(http: httpx.AsyncClient, url: str, body: dict, chat: bool) -> RequestResult:
    start = time.perf_counter()
    res, last, chunks = RequestResult(ok=False), None, 0
    try:
        async with http.stream("POST", url, json=body) as resp:
            if resp.status_code != 200:
                res.error = f"HTTP {resp.status_code}: {(await resp.aread()).decode()[:200]}"
                return res
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                msg = json.loads(data)
                if "error" in msg:
                    res.error = str(msg["error"].get("message", msg["error"]))
                    return res
                if msg.get("usage"):
                    res.prompt_tokens = msg["usage"]["prompt_tokens"]
                    res.output_tokens = msg["usage"]["completion_tokens"]
                if not _carries_token(msg, chat):
                    continue
                now = time.perf_counter()
                if last is None:
                    res.ttft = now - start
                else:
                    res.itl.append(now - last)
                last, chunks = now, chunks + 1
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        res.error = f"{type(exc).__name__}: {exc}"
        return res
    res.e2e = time.perf_counter() - start
    res.output_tokens = res.output_tokens or chunks  # servers without usage: one token per chunk
    res.ok = last is not None
    res.error = "" if res.ok else "no tokens streamed"
    return res


def _carries_token(msg: dict, chat: bool) -> bool:
    """A chunk for a generated token (the chat role preamble and the usage chunk are not)."""
    choices = msg.get("choices") or []
    if not choices:
        return False
    if chat:
        delta = choices[0].get("delta") or {}
        return "role" not in delta and delta.get("content") is not None
    return True


LAG_PROBE_S = 0.005  # the client's event-loop lag probe: one wake-up this often


@dataclass
class RateRun:
    """One rate's run: every request's result (in workload order), the wall time from the first
    send to the last response, and how late each client process's event loop woke (ms): a loop
    that is late is a client too slow for the stream of events, and every latency it measures
    includes that wait."""

    results: list[RequestResult]
    duration: float
    client_lag_ms: list[float]


@dataclass
class _PartRun:
    results: list[RequestResult]  # in the part's order
    start: float  # time.monotonic(): one clock for every process of the machine
    end: float
    lag_ms: list[float]


def run_rate(url: str, reqs: list[BenchRequest], rate: float, *, model: str | None, chat: bool,
             ignore_eos: bool, seed: int, api_key: str | None, max_concurrency: int | None,
             processes: int = 1) -> RateRun:
    """Send `reqs` at Poisson arrival times from `processes` client processes (round-robin: each
    sends every n-th request at its own arrival time; a concurrency cap is split between them).
    One Python process parses ~15-30k streamed events/s (this project's CPU box, 2026-12-04); past
    that its own queue shows up as TTFT and bunched tokens, so a fast server needs several."""
    arrivals = poisson_arrivals(len(reqs), rate, np.random.default_rng(seed))
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    processes = max(1, min(processes, len(reqs), max_concurrency or len(reqs)))
    parts = [[(i, _body(reqs[i], model, chat, ignore_eos), float(arrivals[i]))
              for i in range(p, len(reqs), processes)] for p in range(processes)]
    caps = [None if max_concurrency is None else max_concurrency // processes + (p < max_concurrency % processes)
            for p in range(processes)]
    if processes == 1:
        runs = [asyncio.run(_send_part(url, parts[0], time.monotonic, chat, headers, caps[0]))]
    else:
        runs = _in_processes(url, parts, chat, headers, caps)
    results = [RequestResult(ok=False) for _ in reqs]
    for part, run in zip(parts, runs):
        for (i, _, _), res in zip(part, run.results):
            results[i] = res
    return RateRun(results, max(r.end for r in runs) - min(r.start for r in runs),
                   [lag for r in runs for lag in r.lag_ms])


def _in_processes(url: str, parts: list[list], chat: bool, headers: dict, caps: list) -> list[_PartRun]:
    """Each part in a process of its own (forked: nothing to import again), all starting at one
    moment once every process is up."""
    ctx = multiprocessing.get_context("fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn")
    pipes, procs = [], []
    for part, cap in zip(parts, caps):
        mine, theirs = ctx.Pipe()
        proc = ctx.Process(target=_part_process, args=(theirs, url, part, chat, headers, cap), daemon=True)
        proc.start()
        pipes.append(mine)
        procs.append(proc)
    try:
        readies = [pipe.recv() for pipe in pipes]  # "ready" once warmed up, or the error that stopped it
        start = time.monotonic() + 0.05
        for pipe in pipes:
            pipe.send(start)
        runs = [pipe.recv() if ready == "ready" else ready for pipe, ready in zip(pipes, readies)]
    finally:  # a process that failed sent its error instead (raised below) or died (EOFError above)
        for proc in procs:
            proc.join(5)
            if proc.is_alive():
                proc.kill()
    failed = [run for run in runs if isinstance(run, str)]
    if failed:
        raise RuntimeError(f"a client process failed: {failed[0]}")
    return runs


def _part_process(pipe, url: str, part: list, chat: bool, headers: dict, cap: int | None) -> None:
    started = False

    def ready_then_start() -> float:
        nonlocal started
        pipe.send("ready")
        started = True
        return pipe.recv()  # the common start time (blocks: nothing else runs on the loop yet)

    try:
        pipe.send(asyncio.run(_send_part(url, part, ready_then_start, chat, headers, cap)))
    except Exception as exc:  # noqa: BLE001 (the parent raises it with its text)
        pipe.send(f"{type(exc).__name__}: {exc}")
        if not started:  # the parent read that as this process's "ready": take the start it sends
            pipe.recv()


async def _warm_up(http: httpx.AsyncClient, url: str) -> None:
    """One request before the clock starts. A client process's first request pays for its
    HTTP stack's lazy imports and its first connection: 70-220 ms of TTFT against 15 ms for
    the rest (this project's CPU box, paced server, 2026-12-04), which made the suite's 16 req/s
    TTFT p99 (2 of 200 requests) the client's four first requests."""
    try:
        await http.get(url.split("/v1/")[0] + "/v1/models")
    except httpx.HTTPError:
        pass  # the server's own error shows on the timed requests


async def _send_part(url: str, part: list, start: Callable[[], float], chat: bool, headers: dict,
                     cap: int | None) -> _PartRun:
    """Warm the connection up, then send this part's requests, each at start() + its arrival
    time, while a probe measures how late the event loop wakes."""
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    gate = asyncio.Semaphore(cap) if cap else None
    lags: list[float] = []
    done = asyncio.Event()

    async def probe() -> None:
        while not done.is_set():
            t = time.monotonic()
            await asyncio.sleep(LAG_PROBE_S)
            lags.append((time.monotonic() - t - LAG_PROBE_S) * 1e3)

    async with httpx.AsyncClient(timeout=httpx.Timeout(None), limits=limits, headers=headers) as http:
        await _warm_up(http, url)
        t0 = start()

        async def one(body: dict, at: float) -> RequestResult:
            await asyncio.sleep(max(0.0, t0 + at - time.monotonic()))
            if gate is None:
                return await send_one(http, url, body, chat)
            async with gate:
                return await send_one(http, url, body, chat)

        prober = asyncio.create_task(probe())
        results = await asyncio.gather(*(one(body, at) for _, body, at in part))
        end = time.monotonic()
        done.set()
        await prober
    return _PartRun(list(results), t0, end, lags)


def _pcts(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"mean": None, "p50": None, "p90": None, "p99": None}
    a = np.asarray(values) * 1000.0  # milliseconds
    return {"mean": float(a.mean()), **{f"p{q}": float(np.percentile(a, q)) for q in (50, 90, 99)}}


def summarize(results: list[RequestResult], duration: float, rate: float,
              client_lag_ms: list[float] | None = None) -> dict:
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens for r in ok)
    errors = sorted({r.error for r in results if not r.ok})
    return {
        "request_rate": "inf" if math.isinf(rate) else rate,
        "completed": len(ok), "failed": len(results) - len(ok), "errors": errors[:5],
        "duration_s": duration,
        "request_throughput": len(ok) / duration,
        "output_token_throughput": out_tokens / duration,
        "total_token_throughput": (in_tokens + out_tokens) / duration,
        "total_input_tokens": in_tokens, "total_output_tokens": out_tokens,
        "ttft_ms": _pcts([r.ttft for r in ok]),
        "tpot_ms": _pcts([t for r in ok if (t := r.tpot) is not None]),
        "itl_ms": _pcts([x for r in ok for x in r.itl]),
        "e2e_ms": _pcts([r.e2e for r in ok]),
        # How late the client's event loop woke (ms): large next to TTFT or ITL, the client measured itself.
        "client_lag_ms": _lag_pcts(client_lag_ms or []),
    }


def _lag_pcts(lags_ms: list[float]) -> dict[str, float | None]:
    if not lags_ms:
        return {"p50": None, "p99": None, "max": None}
    a = np.asarray(lags_ms)
    return {"p50": float(np.percentile(a, 50)), "p99": float(np.percentile(a, 99)), "max": float(a.max())}


def format_table(summaries: list[dict]) -> str:
    head = ("rate req/s", "done", "fail", "req/s", "out tok/s", "tot tok/s", "TTFT p50/p90/p99 ms",
            "ITL p50/p90/p99 ms", "TPOT p50/p90/p99 ms")

    def trio(d: dict) -> str:
        return "/".join("-" if d[k] is None else f"{d[k]:.1f}" for k in ("p50", "p90", "p99"))

    rows = [[str(s["request_rate"]), str(s["completed"]), str(s["failed"]), f"{s['request_throughput']:.2f}",
             f"{s['output_token_throughput']:.1f}", f"{s['total_token_throughput']:.1f}",
             trio(s["ttft_ms"]), trio(s["itl_ms"]), trio(s["tpot_ms"])] for s in summaries]
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(head)]
    lines = ["  ".join(h.rjust(w) for h, w in zip(head, widths))]
    lines += ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in rows]
    return "\n".join(lines)


def _range(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition(":")
    lo_i, hi_i = int(lo), int(hi or lo)
    if not 1 <= lo_i <= hi_i:
        raise argparse.ArgumentTypeError(f"expected LO:HI with 1 <= LO <= HI, got {text!r}")
    return lo_i, hi_i


def _rates(text: str) -> list[float]:
    rates = [float(x) for x in text.split(",") if x]
    if not rates or any(r <= 0 for r in rates):
        raise argparse.ArgumentTypeError(f"rates must be > 0 (or inf), got {text!r}")
    return rates


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tandem bench serve", description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="server root (without /v1)")
    p.add_argument("--model", default=None, help="model name to send (default: the server's first model)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--rates", type=_rates, default=[1.0, 4.0, 16.0],
                   help="comma-separated request rates in req/s; 'inf' sends all at once")
    p.add_argument("--num-prompts", type=int, default=200, help="requests per rate")
    p.add_argument("--input-len", type=_range, default=(100, 1024), help="LO:HI tokens, uniform")
    p.add_argument("--output-len", type=_range, default=(100, 1024), help="LO:HI tokens, uniform")
    p.add_argument("--token-id-range", type=_range, default=(100, 10000),
                   help="random prompt ids are drawn from [LO, HI)")
    p.add_argument("--text-prompts", action="store_true", help="random words instead of token ids")
    p.add_argument("--chat", action="store_true", help="use /v1/chat/completions (implies --text-prompts)")
    p.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                   help="do not send ignore_eos (for servers that refuse the extension)")
    p.add_argument("--max-concurrency", type=int, default=None, help="cap on requests in flight")
    p.add_argument("--client-processes", type=int, default=min(4, os.cpu_count() or 1),
                   help="client processes sending the requests (round-robin); one Python process parses "
                        "~15-30k streamed events/s, so a fast server needs several (default: min(4, CPUs))")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write every figure to this file")
    return p


def bench_serve_main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    base = args.base_url.rstrip("/")
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    model = args.model
    if model is None:
        try:
            model = httpx.get(base + "/v1/models", headers=headers, timeout=10).json()["data"][0]["id"]
        except (httpx.HTTPError, KeyError, IndexError, ValueError) as exc:
            print(f"cannot list models at {base}/v1/models: {exc}", file=sys.stderr)
            return 1
    chat = args.chat
    reqs = make_workload(args.num_prompts, args.input_len, args.output_len, args.seed,
                         args.text_prompts or chat, args.token_id_range)
    url = base + ("/v1/chat/completions" if chat else "/v1/completions")
    summaries = []
    for rate in args.rates:
        _reset_prefix_cache(base, headers)  # every rate sends the same prompts: none starts warm
        run = run_rate(url, reqs, rate, model=model, chat=chat, ignore_eos=args.ignore_eos, seed=args.seed,
                       api_key=args.api_key, max_concurrency=args.max_concurrency, processes=args.client_processes)
        summaries.append(summarize(run.results, run.duration, rate, run.client_lag_ms))
        print(f"rate {rate}: {summaries[-1]['completed']}/{len(run.results)} ok in {run.duration:.1f}s "
              f"({args.client_processes} client process(es), event-loop lag p99 "
              f"{summaries[-1]['client_lag_ms']['p99']:.1f} ms)", file=sys.stderr)
    print(format_table(summaries))
    if args.json:
        config = {k: v for k, v in vars(args).items() if k != "api_key"}
        config["rates"] = ["inf" if math.isinf(r) else r for r in args.rates]
        with open(args.json, "w") as f:
            json.dump({"config": {**config, "model": model, "url": url}, "results": summaries}, f, indent=2)
    return 0 if all(s["failed"] == 0 for s in summaries) else 1


def _reset_prefix_cache(base: str, headers: dict) -> None:
    """tandem's (and SGLang's/vLLM's) cache reset; servers without one are left as they are."""
    try:
        httpx.post(base + "/reset_prefix_cache", headers=headers, timeout=10)
    except httpx.HTTPError:
        pass


if __name__ == "__main__":
    sys.exit(bench_serve_main(sys.argv[1:]))
