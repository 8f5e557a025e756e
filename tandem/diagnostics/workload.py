"""The short workload shared by `tandem profile` and `tandem sync-audit`.

N requests with random prompts of a fixed length arrive at once and decode a fixed number of
tokens (EOS ignored, greedy): one or a few prefill steps, then steady decode.
"""
from __future__ import annotations

import argparse
import random


def add_workload_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--model", help="HF directory or .gguf file (default: --preset with dummy weights)")
    ap.add_argument("--preset", help="dummy-weight model shape: qwen3-0.6b, llama-3.1-8b, tiny "
                                     "(default: qwen3-0.6b on CUDA, tiny on the CPU)")
    ap.add_argument("--dummy-weights", action="store_true", help="random weights for --model")
    ap.add_argument("--num-requests", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    ap.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    ap.add_argument("--cuda-graph", default="auto", choices=["auto", "on", "off"])
    ap.add_argument("--attention-backend", default="auto")
    ap.add_argument("--max-total-tokens", type=int, help="KV pool size (default: what the workload needs)")
    ap.add_argument("--seed", type=int, default=0)


def preset_name(args: argparse.Namespace, device) -> str:
    return args.preset or ("qwen3-0.6b" if device.type == "cuda" else "tiny")


def build_engine(args: argparse.Namespace, **overrides):
    from tandem.bench.presets import preset_dir
    from tandem.config import EngineConfig, resolve_device
    from tandem.engine import Engine
    device = resolve_device(args.device)
    if args.model:
        model, dummy = args.model, args.dummy_weights
    else:
        model, dummy = preset_dir(preset_name(args, device)), True
    per_request = args.prompt_len + args.max_tokens + 8
    cfg = EngineConfig(model=model, dummy_weights=dummy, device=args.device, dtype=args.dtype,
                       cuda_graph=args.cuda_graph, attention_backend=args.attention_backend,
                       max_running_requests=max(args.num_requests, 4), max_model_len=per_request,
                       max_total_tokens=args.max_total_tokens or max(args.num_requests, 4) * per_request,
                       seed=args.seed)
    for key, value in overrides.items():
        setattr(cfg, key, value)
    return Engine(cfg)


def make_workload(args: argparse.Namespace, engine, num_requests: int | None = None,
                  max_tokens: int | None = None, seed: int | None = None):
    from tandem.sampling import SamplingParams
    rng = random.Random(args.seed if seed is None else seed)
    vocab = engine.model_config.vocab_size
    n = args.num_requests if num_requests is None else num_requests
    prompts = [[rng.randrange(3, vocab) for _ in range(args.prompt_len)] for _ in range(n)]
    params = SamplingParams(max_tokens=args.max_tokens if max_tokens is None else max_tokens,
                            temperature=0.0, ignore_eos=True)
    return prompts, params


def drive(engine, prompts: list[list[int]], params) -> int:
    """Run the prompts to the end through `engine.step()`; returns the number of steps."""
    engine.reset_prefix_cache()  # runs repeat prompts: each computes its own
    rids = [engine.add_request(p, params) for p in prompts]
    steps = 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
    for rid in rids:
        engine.release(rid)
    return steps


def warm_up(engine, args: argparse.Namespace) -> None:
    """The same shapes once, briefly: kernels compiled, allocator cache filled."""
    prompts, params = make_workload(args, engine, max_tokens=min(args.max_tokens, 4), seed=args.seed + 1)
    drive(engine, prompts, params)
