"""Where a steady decode step's device time goes: kernel time by name, from torch.profiler.

    python3 -m tandem.bench.decode_kernels --preset qwen3-0.6b --batch 1 --batch 64
    python3 -m tandem.bench.decode_kernels --preset qwen3-0.6b --batch 256 --quantization fp8
    python3 -m tandem.bench.decode_kernels --preset qwen3-0.6b --batch 256 --kv-cache-dtype fp8
"""
import argparse
import random

import torch
from torch.profiler import ProfilerActivity, profile

from tandem.bench.presets import preset_dir
from tandem.config import EngineConfig, Experiments
from tandem.engine import Engine
from tandem.options import add_engine_fields
from tandem.sampling import SamplingParams


def profile_batch(engine: Engine, batch: int, steps: int, prompt_len: int) -> None:
    rng = random.Random(0)
    params = SamplingParams(max_tokens=steps + 40, temperature=0, ignore_eos=True)
    vocab = engine.model_config.vocab_size
    rids = [engine.add_request([rng.randrange(vocab) for _ in range(prompt_len)], params)
            for _ in range(batch)]
    for _ in range(20):
        engine.step()
    cuda = torch.cuda.is_available()
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    sync()
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            engine.step()
        sync()
    kind = "CUDA" if cuda else "CPU"
    events = [e for e in prof.key_averages() if e.device_type.name == kind]
    time_of = (lambda e: e.self_device_time_total) if cuda else (lambda e: e.self_cpu_time_total)
    total = sum(time_of(e) for e in events) or 1
    print(f"\nbatch {batch}: {total / steps / 1e3:.3f} ms of kernel time per step, top kernels:")
    print("| kernel | calls/step | µs/step | share |\n|---|---:|---:|---:|")
    for e in sorted(events, key=lambda e: -time_of(e))[:12]:
        print(f"| {e.key[:70]} | {e.count / steps:.0f} | {time_of(e) / steps:.1f} | {time_of(e) / total:.1%} |")
    engine.cancel(rids)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="qwen3-0.6b")
    ap.add_argument("--batch", type=int, action="append")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--experiment", action="append", default=[], metavar="NAME=VALUE",
                    help="an Experiments switch, e.g. fused_decode_merge=on (repeatable)")
    ap.add_argument("--quantization", choices=["fp8"], default=None,
                    help="FP8 weights: where an FP8 step's time goes against a bf16 one (issue 21)")
    add_engine_fields(ap, "kv_cache_dtype")  # an FP8 KV cache's decode attention against bf16's
    args = ap.parse_args()
    engine = Engine(EngineConfig(model=preset_dir(args.preset), dummy_weights=True, quantization=args.quantization,
                                 kv_cache_dtype=args.kv_cache_dtype,
                                 experiments=Experiments.from_overrides(args.experiment)))
    for b in args.batch or [1]:
        profile_batch(engine, b, args.steps, args.prompt_len)


if __name__ == "__main__":
    from tandem.entrypoints.cli import exit_quietly
    raise SystemExit(exit_quietly(main() or 0))
