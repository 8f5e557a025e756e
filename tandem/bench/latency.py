"""`tandem bench latency`: steady decode at fixed batch sizes, overlap on vs off, in one run.

For each batch size: B requests with short random prompts decode without end; after a
warm-up, M engine steps are timed on the host. Device time of each forward comes from CUDA
events in the step timeline; GPU busy = forward time / (forward time + gaps between them).
"""
import argparse
import json
import random
import time

import torch
from dataclasses import asdict, dataclass

from tandem.bench.presets import load_tokenizer, preset_dir
from tandem.config import EngineConfig, Experiments
from tandem.diagnostics.profile import host_profile
from tandem.engine import Engine
from tandem.entrypoints.ranks import build_engine
from tandem.options import add_engine_fields
from tandem.sampling import SamplingParams


@dataclass
class DecodeRow:
    batch: int
    overlap: bool
    step_ms: float
    tokens_per_s: float
    gpu_forward_ms: float | None
    gpu_busy: float | None
    host_ms: float  # host work per step outside the sanctioned wait
    graph_replay_ms: float | None = None  # device time of the same forward from its CUDA graph
    graph_launch_host_ms: float | None = None  # host time to queue that graph's replay
    phases_ms: dict | None = None  # mean host ms per step: schedule, launch, process, wait

    @property
    def overhead_ratio(self) -> float | None:
        return None if not self.graph_replay_ms else self.step_ms / self.graph_replay_ms


def steady_decode(engine: Engine, batch: int, overlap: bool, steps: int, warmup: int,
                  prompt_len: int, seed: int = 0, detokenize: bool = True) -> DecodeRow:
    engine.cfg.disable_overlap = not overlap
    engine.reset_prefix_cache()  # runs repeat prompts: each computes its own
    rng = random.Random(seed)
    vocab = engine.model_config.vocab_size
    params = SamplingParams(max_tokens=warmup + steps + 8, temperature=0, ignore_eos=True)
    rids = [engine.add_request([rng.randrange(vocab) for _ in range(prompt_len)], params,
                               request_id=f"lat-{batch}-{overlap}-{i}", detokenize=detokenize) for i in range(batch)]
    while any(r.num_scheduled_samples == 0 for r in (engine.requests[x] for x in rids)):
        engine.step()  # prefill everything first
    for _ in range(warmup):
        engine.step()
    first = len(engine.timeline.records)
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    wall = time.perf_counter() - start
    summary = engine.timeline.summary(skip=first)
    graph_ms, launch_host_ms = replay_ms(engine, batch)
    engine.cancel(rids)
    return DecodeRow(batch, overlap, wall / steps * 1e3, batch * steps / wall,
                     summary.get("mean_gpu_forward_ms"), summary.get("gpu_busy_fraction"),
                     summary["mean_host_ms"], graph_ms, launch_host_ms, _phases(engine.timeline.records[first:]))


def _phases(records) -> dict:
    n = max(len(records), 1)
    return {k: round(sum(getattr(r, f"{k}_ms") for r in records) / n, 4)
            for k in ("schedule", "launch", "process", "host_wait")}


def replay_ms(engine: Engine, batch: int, repeats: int = 20) -> tuple[float | None, float | None]:
    """(device ms of one decode forward replayed from its CUDA graph (events), host ms to queue
    one replay), or (None, None) without a graph. The host figure is what every graphed step
    pays on the CPU for the launch itself, whatever the rest of its host work."""
    graphs = engine.runner.graphs
    if graphs is None or batch > graphs.max_batch:
        return None, None
    stream = engine.streams.forward
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    slots = engine.stager.views(0, {"req_slots": graphs.bucket(batch)})["req_slots"]
    torch.cuda.synchronize()
    with torch.cuda.stream(stream):
        start.record(stream)
        queued = time.perf_counter()
        for _ in range(repeats):
            graphs.replay(graphs.bucket(batch), 0, slots)
        host_ms = (time.perf_counter() - queued) / repeats * 1e3
        end.record(stream)
    end.synchronize()
    return start.elapsed_time(end) / repeats, host_ms


def host_profile_steps(engine: Engine, batch: int, steps: int, prompt_len: int) -> str:
    """cProfile of `steps` steady overlapped decode steps at `batch` rows, after the timed runs
    (the profiler's cost never reaches their figures)."""
    engine.cfg.disable_overlap = False
    params = SamplingParams(max_tokens=steps + 16, temperature=0, ignore_eos=True)
    rng = random.Random(2)
    vocab = engine.model_config.vocab_size
    rids = [engine.add_request([rng.randrange(vocab) for _ in range(prompt_len)], params,
                               request_id=f"prof-{batch}-{i}") for i in range(batch)]
    for _ in range(8):
        engine.step()
    text = host_profile(lambda: [engine.step() for _ in range(steps)])
    engine.cancel(rids)
    while engine.has_unfinished():
        engine.step()
    return f"host profile, batch {batch}, {steps} steps (cProfile):\n{text}"


def time_to_first_token(engine: Engine, prompts: list[list[int]], switch: bool) -> dict:
    """All prompts arrive at once; returns TTFT of the first-admitted and the mean, in ms."""
    engine.cfg.experiments.process_before_consecutive_prefill = switch
    engine.cfg.disable_overlap = False
    engine.reset_prefix_cache()  # runs repeat prompts: each computes its own
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    start = time.perf_counter()
    rids = [engine.add_request(p, params, request_id=f"ttft-{switch}-{i}") for i, p in enumerate(prompts)]
    first: dict[str, float] = {}
    while engine.has_unfinished():
        for out in engine.step():
            first.setdefault(out.request_id, time.perf_counter() - start)
    for rid in rids:
        engine.release(rid)
    engine.cfg.experiments.process_before_consecutive_prefill = False
    times = sorted(first.values())
    return {"first_ms": times[0] * 1e3, "mean_ms": sum(times) / len(times) * 1e3,
            "last_ms": times[-1] * 1e3}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="tandem bench latency", description=__doc__)
    ap.add_argument("--model", help="model path (default: --preset with dummy weights)")
    ap.add_argument("--preset", default="qwen3-0.6b")
    ap.add_argument("--tokenizer", metavar="DIR",
                    help="with --preset: this saved tokenizer (its vocabulary) beside the dummy weights, so each "
                         "step detokenizes as a user's does ('builtin': the built-in model's); without it no text is made")
    ap.add_argument("--text", default="engine", choices=["engine", "caller"],
                    help="with --tokenizer: who makes the text. engine: each step detokenizes (requests "
                         "with stop strings). caller: the engine names the ids (add_request's detokenize=False) "
                         "and makes no text, as for LLM.generate (texts made at the end) and tandem serve "
                         "(its front end detokenizes) for requests without stop strings")
    ap.add_argument("--batch-sizes", default="1,8,16,64,256")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--max-total-tokens", type=int)
    ap.add_argument("--attention-backend", default="auto")
    ap.add_argument("--cuda-graph", default="auto", choices=["auto", "on", "off"])
    ap.add_argument("--quantization", choices=["fp8"])
    add_engine_fields(ap, "kv_cache_dtype")
    ap.add_argument("--small-m-gemm", default="auto", choices=["auto", "on", "off"])
    ap.add_argument("--tp", type=int, default=1, help="tensor parallelism: ranks (GPUs)")
    ap.add_argument("--ttft-burst", type=int, default=32, help="prompts in the TTFT burst")
    ap.add_argument("--experiment", action="append", default=[], metavar="NAME=VALUE",
                    help="an Experiments switch for an A/B run, e.g. fused_kv_write=off (repeatable)")
    ap.add_argument("--host-profile", type=int, metavar="BATCH",
                    help="after the timed runs, cProfile 200 decode steps at BATCH rows and print the top functions")
    ap.add_argument("--json", help="write results here")
    args = ap.parse_args(argv)
    sizes = [int(x) for x in args.batch_sizes.split(",")]
    tokenizer = None if args.model or not args.tokenizer else load_tokenizer(
        None if args.tokenizer == "builtin" else args.tokenizer)
    cfg = EngineConfig(model=args.model or preset_dir(args.preset, tokenizer), dummy_weights=args.model is None,
                       device=args.device, dtype=args.dtype, timeline=True,
                       max_total_tokens=args.max_total_tokens, attention_backend=args.attention_backend,
                       max_running_requests=max(256, max(sizes)),
                       experiments=Experiments.from_overrides(args.experiment))
    cfg.cuda_graph, cfg.tensor_parallel_size = args.cuda_graph, args.tp
    cfg.quantization, cfg.small_m_gemm = args.quantization, args.small_m_gemm
    cfg.kv_cache_dtype = args.kv_cache_dtype
    engine = build_engine(cfg)  # --tp: starts the ranks
    engine_text = args.text == "engine"
    detokenizes = engine.tokenizer is not None and engine_text  # each step makes text (stop strings)
    rows = []
    for b in sizes:
        for overlap in (True, False):
            rows.append(steady_decode(engine, b, overlap, args.steps, args.warmup, args.prompt_len,
                                      detokenize=engine_text))
    print(format_table(rows))
    for r in rows:
        print(f"host phases, batch {r.batch}, overlap {'on' if r.overlap else 'off'}: {r.phases_ms}")
    rng = random.Random(1)
    vocab = engine.model_config.vocab_size
    single = time_to_first_token(engine, [[rng.randrange(vocab) for _ in range(1024)]], False)
    burst = [[rng.randrange(vocab) for _ in range(1024)] for _ in range(args.ttft_burst)]
    switch = {flag: time_to_first_token(engine, burst, flag) for flag in (False, True)}
    print(f"\nTTFT, one 1024-token prompt: {single['first_ms']:.1f} ms")
    print(f"TTFT, {args.ttft_burst} x 1024-token prompts at once (consecutive-prefill switch off / on): "
          f"first {switch[False]['first_ms']:.1f} / {switch[True]['first_ms']:.1f} ms, "
          f"mean {switch[False]['mean_ms']:.1f} / {switch[True]['mean_ms']:.1f} ms, "
          f"last {switch[False]['last_ms']:.1f} / {switch[True]['last_ms']:.1f} ms")
    profile = host_profile_steps(engine, args.host_profile, 200, args.prompt_len) if args.host_profile else None
    if profile:
        print(profile)
    engine.close()  # tensor-parallel workers
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "detokenizes": detokenizes, "rows": [{**asdict(r), "overhead_ratio": r.overhead_ratio}
                                                    for r in rows],
                       "ttft_single_1024": single, "ttft_burst": {"off": switch[False], "on": switch[True]},
                       "host_profile": profile},
                      f, indent=1)
    return 0


def format_table(rows: list[DecodeRow]) -> str:
    by = {(r.batch, r.overlap): r for r in rows}
    lines = ["| batch | tok/s overlap on | tok/s off | on/off | step ms on | GPU fwd ms | graph replay ms | graph launch host ms | overhead ratio | GPU busy on | GPU busy off | host ms/step |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for b in sorted({r.batch for r in rows}):
        on, off = by[(b, True)], by[(b, False)]
        fmt = lambda x, p="{:.3f}": "n/a" if x is None else p.format(x)  # noqa: E731
        lines.append(f"| {b} | {on.tokens_per_s:,.0f} | {off.tokens_per_s:,.0f} | "
                     f"{on.tokens_per_s / off.tokens_per_s:.2f} | {on.step_ms:.3f} | {fmt(on.gpu_forward_ms)} | "
                     f"{fmt(on.graph_replay_ms)} | {fmt(on.graph_launch_host_ms)} | {fmt(on.overhead_ratio, '{:.2f}')} | "
                     f"{fmt(on.gpu_busy, '{:.1%}')} | {fmt(off.gpu_busy, '{:.1%}')} | {on.host_ms:.3f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
