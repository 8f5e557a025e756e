"""The suite's serving part: `tandem serve` as users start it, and the engine on the same load.

    python -m tandem.bench.suite_serve server --preset qwen3-0.6b --json OUT
    python -m tandem.bench.suite_serve engine --preset qwen3-0.6b --json OUT

`server`: starts `tandem serve --model DIR --dummy-weights --port P` (nothing else: the
defaults are what is measured, including its warm-up, from a cold process), times the start
until /health answers, then runs `tandem bench serve` once per rate (Poisson arrivals) and
reads the engine's GPU busy and host time per step from /metrics after each.
`engine`: the same requests at the same arrival times fed to `LLM(DIR, dummy_weights=True)`
(default options) in this process: the engine's own throughput, with nothing between it and
the load; the server's output tok/s over this is the cost of serving.
"""
from __future__ import annotations

import argparse
import json
import re
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from tandem.bench import launch, serve
from tandem.bench.presets import preset_dir


def _load_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--preset", default="qwen3-0.6b")
    ap.add_argument("--rates", type=serve._rates, default=[16.0, 128.0])
    ap.add_argument("--num-prompts", type=int, default=200)
    ap.add_argument("--input-len", type=serve._range, default=(100, 1024))
    ap.add_argument("--output-len", type=serve._range, default=(100, 1024))
    ap.add_argument("--token-id-range", type=serve._range, default=(100, 10000))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--start-timeout", type=float, default=300.0)
    ap.add_argument("--json", required=True)
    ap.add_argument("--server-flags", default="",
                    help="extra `tandem serve` flags, for A/B sweeps (the suite itself passes none)")


def _bench_argv(args: argparse.Namespace, url: str, rate: float, out: Path) -> list[str]:
    r = lambda lo_hi: f"{lo_hi[0]}:{lo_hi[1]}"  # noqa: E731
    return ["--base-url", url, "--rates", str(rate), "--num-prompts", str(args.num_prompts),
            "--input-len", r(args.input_len), "--output-len", r(args.output_len),
            "--token-id-range", r(args.token_id_range), "--seed", str(args.seed), "--json", str(out)]


def run_server(args: argparse.Namespace) -> dict:
    model, port = preset_dir(args.preset), launch.free_port()
    url = f"http://127.0.0.1:{port}"
    log = Path(args.json).with_suffix(".server.log")
    cmd = [sys.executable, "-m", "tandem", "serve", "--model", model, "--dummy-weights", "--port", str(port),
           *shlex.split(args.server_flags)]
    t0 = time.perf_counter()
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    try:
        launch._wait_healthy(url, proc, log, args.start_timeout)
        report = {"command": cmd, "startup_s": time.perf_counter() - t0, "rates": []}
        for rate in args.rates:
            report["rates"].append(_one_rate(args, url, rate, proc.pid))
        report["kernel_builds_while_serving"] = kernel_builds(log.read_text(errors="replace"))
        return report
    finally:
        launch.stop_server(proc)
        print(f"[suite-serve] server log tail:\n{log.read_text(errors='replace')[-1500:]}", file=sys.stderr)


BUILD_WARNING = re.compile(r"Triton built kernel (\S+) while serving")


def kernel_builds(server_log: str) -> list[str]:
    """The kernels the engine built after its warm-up (its warning, `Engine._warn_of_build`):
    each one stalled a step while serving."""
    return BUILD_WARNING.findall(server_log)


def _one_rate(args: argparse.Namespace, url: str, rate: float, server_pid: int) -> dict:
    before, cpu0, t0 = launch.metrics(url), launch.cpu_seconds(server_pid), time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "serve.json"
        rc = serve.bench_serve_main(_bench_argv(args, url, rate, out))
        summary = json.loads(out.read_text())["results"][0]
    m = launch.metrics(url)  # "recent steps": the load's last steps, read right after it
    # The server's own TTFT (arrival to the first token reaching its front end): the client's
    # TTFT less this is delivery (streaming and the client's parsing).
    server_ttft = launch.histogram_quantiles(before, m, "tandem_time_to_first_token_seconds")
    return {**summary, "exit_code": rc, "gpu_busy": m.get("tandem_gpu_busy_fraction"),
            "host_ms_per_step": m.get("tandem_host_ms_per_step"), "server_ttft_ms": server_ttft,
            **launch.front_end_cpu(launch.cpu_seconds(server_pid), cpu0, time.perf_counter() - t0,
                                   summary["total_output_tokens"])}


def run_engine(args: argparse.Namespace) -> dict:
    from tandem import LLM
    llm = LLM(preset_dir(args.preset), dummy_weights=True)  # the defaults, as `tandem serve` has them
    reqs = serve.make_workload(args.num_prompts, args.input_len, args.output_len, args.seed, False,
                               args.token_id_range)
    poisson_load(llm.engine, reqs[:16], float("inf"), args.seed, "warm")  # kernels, allocator, graphs
    report = {"rates": []}
    for rate in args.rates:
        results, duration = poisson_load(llm.engine, reqs, rate, args.seed, f"r{rate}")
        report["rates"].append(serve.summarize(results, duration, rate))
    llm.close()
    return report


def poisson_load(engine, reqs: list[serve.BenchRequest], rate: float, seed: int,
                 tag: str) -> tuple[list[serve.RequestResult], float]:
    """Each request added at its arrival time (the arrivals `tandem bench serve` draws for the
    same seed), steps in between; per request the figures the HTTP client would measure."""
    from tandem.sampling import SamplingParams
    arrivals = serve.poisson_arrivals(len(reqs), rate, np.random.default_rng(seed))
    sent: dict[str, float] = {}
    results = {f"{tag}-{i}": serve.RequestResult(ok=False) for i in range(len(reqs))}
    start, nxt = time.perf_counter(), 0
    while nxt < len(reqs) or engine.has_unfinished():
        now = time.perf_counter()
        while nxt < len(reqs) and start + arrivals[nxt] <= now:
            rid, req = f"{tag}-{nxt}", reqs[nxt]
            params = SamplingParams(max_tokens=req.output_len, temperature=0.0, ignore_eos=True)
            engine.add_request(req.prompt, params, request_id=rid)
            sent[rid], nxt = now, nxt + 1
        if not engine.has_unfinished():
            time.sleep(max(0.0, min(start + arrivals[nxt] - time.perf_counter(), 0.01)))
            continue
        for out in engine.step():
            _record(engine, results[out.request_id], out, sent[out.request_id])
    return list(results.values()), time.perf_counter() - start


def _record(engine, res: serve.RequestResult, out, sent_at: float) -> None:
    now = time.perf_counter()
    if out.new_token_ids and not res.ttft:
        res.ttft = now - sent_at
    if out.finished:
        final = engine.output(out.request_id)
        res.ok, res.e2e = out.finish_reason in ("length", "stop"), now - sent_at
        res.prompt_tokens, res.output_tokens = len(final.prompt_token_ids), len(final.token_ids)
        res.error = "" if res.ok else f"finish_reason {out.finish_reason}"
        engine.release(out.request_id)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tandem.bench.suite_serve", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("mode", choices=["server", "engine"])
    _load_args(ap)
    args = ap.parse_args(argv)
    report = run_server(args) if args.mode == "server" else run_engine(args)
    report["args"] = {k: v for k, v in vars(args).items()}
    Path(args.json).write_text(json.dumps(report, indent=1))
    failed = sum(r["failed"] for r in report["rates"])
    print(f"[suite-serve] {args.mode}: " + ", ".join(
        f"rate {r['request_rate']}: {r['output_token_throughput']:,.0f} out tok/s" for r in report["rates"]))
    return 1 if failed else 0


if __name__ == "__main__":
    from tandem.entrypoints.cli import exit_quietly
    raise SystemExit(exit_quietly(main()))
