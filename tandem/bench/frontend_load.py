"""`python -m tandem.bench.frontend_load`: the server's front end alone, under a stream load.

`tandem serve` runs as users start it (the tiny preset's config and tokenizer), but its engine
process holds a paced engine instead of a model: every `--step-ms` it gives each running request
one token (" x"), and ends a request at its `max_tokens`. The engine loop, the wire protocol, the
front end (routing, SSE, HTTP) and the benchmark's client are the real ones. So the figures are
the front end's: TTFT and inter-token gaps against the step period the engine keeps exactly, and
the front end's CPU per streamed token and share of a core. How many streamed tokens a second the
front end carries before its own queue shows, without a GPU.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from tandem.outputs import StepOutput


@dataclass
class _Paced:
    request_id: str
    max_tokens: int
    sent: int = 0
    detokenize: bool = True  # False: the front end makes the text (StepOutput.text_ids), as with the real engine


class PacedEngine:
    """What `_EngineLoop` needs of an engine, with no model: one token per running request
    every `step_s`, at most `max_running` running (the rest wait, first come first served)."""

    def __init__(self, step_s: float, max_running: int, max_model_len: int, vocab_size: int):
        self.step_s, self.max_running = step_s, max_running
        self.max_model_len = max_model_len
        self.model_config = argparse.Namespace(vocab_size=vocab_size)
        self.timeline = None
        self.requests: dict[str, _Paced] = {}
        self._next_step = time.monotonic()

    def add_request(self, prompt_token_ids: list[int], params, request_id: str, detokenize: bool = True) -> None:
        self.requests[request_id] = _Paced(request_id, params.max_tokens, detokenize=detokenize or bool(params.stop))

    def abort(self, request_id: str) -> None:
        self.requests.pop(request_id, None)

    def release(self, request_id: str) -> None:
        pass  # finished requests left `requests` in step()

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def step(self) -> list[StepOutput]:
        """Sleep to the next step boundary (an idle engine starts a step at once), then one token
        each for the first `max_running` requests."""
        now = time.monotonic()
        self._next_step = max(self._next_step, now - self.step_s)
        if self._next_step + self.step_s > now:
            time.sleep(self._next_step + self.step_s - now)
        self._next_step += self.step_s
        outputs = []
        for req in list(self.requests.values())[:self.max_running]:
            req.sent += 1
            done = req.sent >= req.max_tokens
            outputs.append(StepOutput(req.request_id, [100], " x" if req.detokenize else "", done,
                                      "length" if done else None, text_ids=None if req.detokenize else [100]))
            if done:
                del self.requests[req.request_id]
        return outputs

    def stats(self) -> dict:
        running = min(len(self.requests), self.max_running)
        return {"running": running, "waiting": len(self.requests) - running, "kv_cache_usage": 0.0,
                "prefix_cache_queried_tokens": 0, "prefix_cache_hit_tokens": 0, "prefix_cache_tokens": 0,
                "host_cache_hit_tokens": 0, "host_cache_tokens": 0, "host_load_bytes": 0, "host_load_seconds": 0.0,
                "host_write_back_bytes": 0, "host_write_back_seconds": 0.0}

    def reset_prefix_cache(self) -> int:
        return 0

    def resolved_settings(self) -> dict:
        return {"device": "none (paced engine)", "max_model_len": self.max_model_len}

    def close(self) -> None:
        pass


def _serve_paced(argv: list[str]) -> None:
    """`tandem serve` in this process, its engine process running `_paced_run_engine`."""
    import functools

    from tandem.server import cli, client
    step_s, max_running = float(argv.pop(0)), int(argv.pop(0))
    client.run_engine = functools.partial(_paced_run_engine, step_s, max_running)  # what start() spawns
    sys.exit(cli.main(argv))


def _paced_run_engine(step_s: float, max_running: int, *args) -> None:
    """The engine process (spawned: this module is imported afresh there): the real
    `run_engine`, with `build_engine` giving a PacedEngine."""
    import tandem.entrypoints.ranks as ranks
    from tandem.server import engine_process

    ranks.build_engine = lambda config: PacedEngine(step_s, max_running, config.max_model_len or 4096, 512)
    engine_process.run_engine(*args)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tandem.bench.frontend_load", description=__doc__.split("\n\n")[0])
    ap.add_argument("--step-ms", type=float, default=5.0, help="the paced engine's step period")
    ap.add_argument("--max-running", type=int, default=256)
    ap.add_argument("--num-prompts", type=int, default=200)
    ap.add_argument("--output-len", type=int, default=300)
    ap.add_argument("--rate", type=float, default=float("inf"), help="request rate (req/s; inf: all at once)")
    ap.add_argument("--client-processes", type=int, nargs="+", default=[1, 2], help="one run per value")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    from tandem.bench import launch, serve
    from tandem.bench.presets import preset_dir
    port = launch.free_port()
    url = f"http://127.0.0.1:{port}"
    log = Path(f"/tmp/tandem-frontend-load-{port}.log")
    cmd = [sys.executable, "-m", "tandem.bench.frontend_load", "--serve-paced", str(args.step_ms / 1e3),
           str(args.max_running), "--model", preset_dir("tiny"), "--dummy-weights", "--port", str(port)]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    rows = []
    try:
        launch._wait_healthy(url, proc, log, 120)
        reqs = [serve.BenchRequest([100 + i % 300, 101, 102, 103], 4, args.output_len) for i in range(args.num_prompts)]
        for procs in args.client_processes:
            cpu0, t0 = launch.cpu_seconds(proc.pid), time.perf_counter()
            run = serve.run_rate(url + "/v1/completions", reqs, args.rate, model=None, chat=False, ignore_eos=True,
                                 seed=0, api_key=None, max_concurrency=None, processes=procs)
            wall, cpu1 = time.perf_counter() - t0, launch.cpu_seconds(proc.pid)
            s = serve.summarize(run.results, run.duration, args.rate, run.client_lag_ms)
            tokens = s["total_output_tokens"]
            rows.append({"client_processes": procs, "step_ms": args.step_ms, "streams": args.num_prompts,
                         "failed": s["failed"], "output_tokens": tokens, "tokens_per_s": s["output_token_throughput"],
                         "offered_tokens_per_s": min(args.num_prompts, args.max_running) / args.step_ms * 1e3,
                         "ttft_ms": s["ttft_ms"], "itl_ms": s["itl_ms"], "client_lag_ms": s["client_lag_ms"],
                         **launch.front_end_cpu(cpu1, cpu0, wall, tokens)})
            r = rows[-1]
            print(f"client processes {procs}: {r['tokens_per_s']:,.0f} tokens/s of {r['offered_tokens_per_s']:,.0f} "
                  f"offered; TTFT p50 {r['ttft_ms']['p50']:.1f} ms; ITL p50/p90/p99 "
                  f"{r['itl_ms']['p50']:.2f}/{r['itl_ms']['p90']:.2f}/{r['itl_ms']['p99']:.2f} ms (step "
                  f"{args.step_ms} ms); front end {r['front_end_cpu_us_per_token']:.1f} us/token, "
                  f"{r['front_end_cpu_share']:.2f} of a core; client lag p99 {r['client_lag_ms']['p99']:.1f} ms")
    finally:
        launch.stop_server(proc)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0 if all(r["failed"] == 0 for r in rows) else 1


if __name__ == "__main__":
    if sys.argv[1:2] == ["--serve-paced"]:
        _serve_paced(sys.argv[2:])
    else:
        sys.exit(main(sys.argv[1:]))
