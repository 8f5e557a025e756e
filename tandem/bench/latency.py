"""`tandem bench latency`: steady decode at fixed batch sizes, overlap on vs off, in one run.

For each batch size: B requests with short random prompts decode without end; after a
warm-up, M engine steps are timed on the host. Device time of each forward comes from CUDA
events in the step timeline; GPU busy = forward time / (forward time + gaps between them).
"""
import argparse
import json
import random
import time
from dataclasses import asdict, dataclass

from tandem.bench.presets import preset_dir
from tandem.config import EngineConfig
from tandem.engine import Engine
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


def steady_decode(engine: Engine, batch: int, overlap: bool, steps: int, warmup: int,
                  prompt_len: int, seed: int = 0) -> DecodeRow:
    engine.cfg.disable_overlap = not overlap
    rng = random.Random(seed)
    vocab = engine.model_config.vocab_size
    params = SamplingParams(max_tokens=warmup + steps + 8, temperature=0, ignore_eos=True)
    rids = [engine.add_request([rng.randrange(vocab) for _ in range(prompt_len)], params,
                               request_id=f"lat-{batch}-{overlap}-{i}") for i in range(batch)]
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
    for rid in rids:
        engine.abort(rid)
    while engine.has_unfinished():
        engine.step()
    for rid in rids:
        engine.release(rid)
    return DecodeRow(batch, overlap, wall / steps * 1e3, batch * steps / wall,
                     summary.get("mean_gpu_forward_ms"), summary.get("gpu_busy_fraction"),
                     summary["mean_host_ms"])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="tandem bench latency", description=__doc__)
    ap.add_argument("--model", help="model path (default: --preset with dummy weights)")
    ap.add_argument("--preset", default="qwen3-0.6b")
    ap.add_argument("--batch-sizes", default="1,8,16,64,256")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--max-total-tokens", type=int)
    ap.add_argument("--attention-backend", default="auto")
    ap.add_argument("--cuda-graph", default="auto", choices=["auto", "on", "off"])
    ap.add_argument("--json", help="write results here")
    args = ap.parse_args(argv)
    sizes = [int(x) for x in args.batch_sizes.split(",")]
    cfg = EngineConfig(model=args.model or preset_dir(args.preset), dummy_weights=args.model is None,
                       device=args.device, dtype=args.dtype, timeline=True,
                       max_total_tokens=args.max_total_tokens, attention_backend=args.attention_backend,
                       max_running_requests=max(256, max(sizes)))
    if hasattr(cfg, "cuda_graph"):
        cfg.cuda_graph = args.cuda_graph
    engine = Engine(cfg)
    rows = []
    for b in sizes:
        for overlap in (True, False):
            rows.append(steady_decode(engine, b, overlap, args.steps, args.warmup, args.prompt_len))
    print(format_table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": [asdict(r) for r in rows]}, f, indent=1)
    return 0


def format_table(rows: list[DecodeRow]) -> str:
    by = {(r.batch, r.overlap): r for r in rows}
    lines = ["| batch | tok/s overlap on | tok/s off | on/off | step ms on | GPU fwd ms | GPU busy on | GPU busy off | host ms/step |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for b in sorted({r.batch for r in rows}):
        on, off = by[(b, True)], by[(b, False)]
        fmt = lambda x, p="{:.3f}": "n/a" if x is None else p.format(x)  # noqa: E731
        lines.append(f"| {b} | {on.tokens_per_s:,.0f} | {off.tokens_per_s:,.0f} | "
                     f"{on.tokens_per_s / off.tokens_per_s:.2f} | {on.step_ms:.3f} | {fmt(on.gpu_forward_ms)} | "
                     f"{fmt(on.gpu_busy, '{:.1%}')} | {fmt(off.gpu_busy, '{:.1%}')} | {on.host_ms:.3f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
