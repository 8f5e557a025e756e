"""Issue 13 on the H200, one process: small-M GEMM correctness and bandwidth vs cuBLAS,
decode-attention splits by context, kernels per decode step, and decode tok/s with the new
paths on vs off (bf16 and FP8) for the Qwen3-0.6B and Llama-3.1-8B shapes.

    PYTHONPATH=. python3 bench/gpu_kernels13.py --out $OUT --budget-s 220

Sections run in priority order and are skipped once the time budget is spent; results are
written to OUT/kernels13.json after every section; a short table is printed at the end.
"""
import argparse
import gc
import os
import subprocess
import sys
import json
import logging
import random
import time
import traceback

import torch

START = time.monotonic()
R: dict = {}
SHAPES = {  # (N, K) of the four projections
    "qwen3-0.6b": {"qkv": (4096, 1024), "o": (1024, 2048), "gate_up": (6144, 1024), "down": (1024, 3072)},
    "llama-3.1-8b": {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)},
}


def save(out: str) -> None:
    with open(f"{out}/kernels13.json", "w") as f:
        json.dump(R, f, indent=1, default=str)


def elapsed() -> float:
    return time.monotonic() - START


def gemm_section(dtype=torch.bfloat16) -> None:
    from tandem.kernels.gemm_tuner import candidates, tune_shape
    from tandem.kernels.small_m_gemm import small_m_gemm
    from tandem.models.layers import silu_mul_torch
    from tandem.models.linear import quantize_fp8
    rows = R.setdefault("gemm", [])
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for quant in (False, True):
        for model, shapes in SHAPES.items():
            for name, (n, k) in shapes.items():
                w = (torch.randn(n, k, device="cuda") / k ** 0.5).to(dtype)
                scale = None
                if quant:
                    w, scale = quantize_fp8(w)
                ref_w = w.float() * scale[:, None] if quant else w.float()
                for m in ((1, 16) if quant else (1, 2, 4, 8, 16)):
                    x = torch.randn(m, k, device="cuda", dtype=dtype)
                    cfg, ms, cublas_ms = tune_shape(w, scale, dtype, m)
                    check = cfg or candidates(n, k, m, sms)[0]
                    out = small_m_gemm(x, w, None, scale, check)
                    ref = x.float() @ ref_w.t()
                    err = ((out.float() - ref).abs().max() / ref.abs().max()).item()
                    row = {"model": model, "layer": name, "N": n, "K": k, "M": m,
                           "weight": "fp8" if quant else "bf16", "best": str(cfg), "us": ms * 1e3,
                           "cublas_us": cublas_ms * 1e3, "rel_err": err,
                           "TBps": n * k * w.element_size() / (ms * 1e-3) / 1e12,
                           "cublas_TBps": n * k * w.element_size() / (cublas_ms * 1e-3) / 1e12}
                    if name == "down" and m in (1, 4):
                        gu = torch.randn(m, 2 * k, device="cuda", dtype=dtype)
                        fused = small_m_gemm(gu, w, None, scale, check, silu_mul=True)
                        ref2 = silu_mul_torch(gu).float() @ ref_w.t()
                        row["silu_fused_rel_err"] = ((fused.float() - ref2).abs().max() / ref2.abs().max()).item()
                    rows.append(row)
                    print(f"gemm {row['weight']} {model} {name} M={m}: {row['us']:.1f} us "
                          f"{row['TBps']:.2f} TB/s (cuBLAS {row['cublas_us']:.1f} us "
                          f"{row['cublas_TBps']:.2f} TB/s) err {err:.1e} {cfg}", flush=True)
                del w


def attention_section() -> None:
    from tandem.attention import torch_backend as ref
    from tandem.kernels import decode_attention, decode_num_splits
    rows = R.setdefault("attention", [])
    heads, kv_heads, d, layers = 16, 8, 128, 28
    for batch, ctx in ((1, 128), (1, 512), (1, 2048), (1, 8192), (16, 512), (64, 512), (64, 2048)):
        num_slots = batch * ctx + 1
        k_cache = torch.randn(num_slots, kv_heads, d, device="cuda", dtype=torch.bfloat16)
        v_cache = torch.randn_like(k_cache)
        r2t = (torch.randperm(num_slots - 1, device="cuda") + 1).int().view(batch, ctx)
        slots = torch.arange(batch, device="cuda")
        lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
        q = torch.randn(batch, heads, d, device="cuda", dtype=torch.bfloat16)
        splits = decode_num_splits(batch, kv_heads, heads // kv_heads, 40960, q.device)
        row = {"batch": batch, "ctx": ctx, "grid_splits": splits}
        for min_split in (1, 64, 128, 256):
            out = torch.empty_like(q)

            def run():
                for _ in range(layers):
                    decode_attention(q, k_cache, v_cache, r2t, slots, lens, d ** -0.5, 40960, out,
                                     num_splits=splits, min_split_tokens=min_split)
            run()
            expected = ref.decode_attention(q.float(), k_cache.float(), v_cache.float(), r2t, slots,
                                            lens, d ** -0.5, ctx)
            row[f"err_min{min_split}"] = (out.float() - expected).abs().max().item()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                run()
            graph.replay()
            torch.cuda.synchronize()
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            for _ in range(10):
                graph.replay()
            e.record()
            e.synchronize()
            row[f"us_per_layer_min{min_split}"] = s.elapsed_time(e) / 10 / layers * 1e3
        rows.append(row)
        print("attention", row, flush=True)


def kernels_per_step(engine, steps: int = 10) -> dict:
    from torch.profiler import ProfilerActivity, profile
    from tandem.sampling import SamplingParams
    rng = random.Random(0)
    params = SamplingParams(max_tokens=steps + 40, temperature=0, ignore_eos=True)
    rid = engine.add_request([rng.randrange(1000) for _ in range(128)], params, request_id="prof")
    for _ in range(12):
        engine.step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.device_type.name == "CUDA"]
    total_us = sum(e.self_device_time_total for e in events)
    top = sorted(events, key=lambda e: -e.self_device_time_total)[:12]
    engine.cancel([rid])
    for _ in range(3):
        engine.step()
    return {"kernels_per_step": sum(e.count for e in events) / steps,
            "kernel_ms_per_step": total_us / steps / 1e3,
            "top": [(e.key[:80], e.count / steps, e.self_device_time_total / steps) for e in top]}


def engine_section(label: str, preset: str, batches: list[int], new: bool, quant: str | None) -> None:
    from tandem.bench.latency import steady_decode
    from tandem.bench.presets import preset_dir
    from tandem.config import EngineConfig, Experiments
    from tandem.engine import Engine
    t0 = time.monotonic()
    cfg = EngineConfig(model=preset_dir(preset), dummy_weights=True, timeline=True,
                       max_total_tokens=131072, max_running_requests=max(64, max(batches)),
                       cuda_graph_max_batch=max(batches), quantization=quant,
                       small_m_gemm="auto" if new else "off",
                       experiments=Experiments(attention_split_by_context=new))
    engine = Engine(cfg)
    res = {"preset": preset, "new": new, "quant": quant, "build_s": time.monotonic() - t0,
           "tuned": {f"N{n} K{k} {str(wd)[6:]} M{m}": (str(c), ms * 1e3, cb * 1e3)
                     for (n, k, wd, m), (c, ms, cb) in engine.gemm_tuning.items()}}
    R.setdefault("engines", {})[label] = res
    for b in batches:
        row = steady_decode(engine, b, True, 40, 10, 128)
        res[f"batch{b}"] = {"tok_s": row.tokens_per_s, "step_ms": row.step_ms,
                            "graph_replay_ms": row.graph_replay_ms, "gpu_busy": row.gpu_busy}
        print(f"{label} batch {b}: {row.tokens_per_s:,.0f} tok/s, step {row.step_ms:.3f} ms, "
              f"replay {row.graph_replay_ms} ms", flush=True)
    res["profile_b1"] = kernels_per_step(engine)
    print(f"{label}: {res['profile_b1']['kernels_per_step']:.0f} kernels/step, "
          f"{res['profile_b1']['kernel_ms_per_step']:.3f} ms kernels/step", flush=True)
    del engine
    gc.unfreeze()  # the engine froze everything it built; let the collector reclaim it
    gc.collect()
    torch.cuda.empty_cache()


def subprocess_section(name: str, cmd: list[str], budget_s: float) -> None:
    """A command in a child process, cut off at what is left of the budget."""
    limit = max(5.0, budget_s - elapsed() - 3)
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=limit, env=env)
        R[name] = {"rc": done.returncode, "tail": (done.stdout + done.stderr)[-4000:]}
    except subprocess.TimeoutExpired as e:
        R[name] = {"rc": "timeout", "tail": str(e.stdout or "")[-4000:]}
    print(f"{name}: rc {R[name]['rc']}\n{R[name]['tail'][-1500:]}", flush=True)


def summary() -> str:
    lines = ["| config | batch | tok/s | step ms | graph replay ms | kernels/step (b1) | build s |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for label, res in R.get("engines", {}).items():
        for key, row in res.items():
            if key.startswith("batch"):
                prof = res.get("profile_b1", {}).get("kernels_per_step")
                lines.append(f"| {label} | {key[5:]} | {row['tok_s']:,.0f} | {row['step_ms']:.3f} | "
                             f"{row['graph_replay_ms'] or 0:.3f} | {prof or 0:.0f} | {res['build_s']:.0f} |")
    gemm = [g for g in R.get("gemm", []) if g["M"] == 1]
    lines += ["", "| weight | model | layer | M=1 us | TB/s | cuBLAS us | cuBLAS TB/s | err |",
              "|---|---|---|---:|---:|---:|---:|---:|"]
    lines += [f"| {g['weight']} | {g['model']} | {g['layer']} | {g['us']:.1f} | {g['TBps']:.2f} | "
              f"{g['cublas_us']:.1f} | {g['cublas_TBps']:.2f} | {g['rel_err']:.1e} |" for g in gemm]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--budget-s", type=float, default=220)
    ap.add_argument("--only", help="comma list of sections to run")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    R["device"] = torch.cuda.get_device_name(0)
    R["versions"] = {"torch": torch.__version__, "triton": __import__("triton").__version__}
    sections = [
        ("gemm", gemm_section, 40),
        ("e2e-0.6b-old", lambda: engine_section("0.6b bf16 old", "qwen3-0.6b", [1, 16, 64], False, None), 30),
        ("e2e-0.6b-new", lambda: engine_section("0.6b bf16 new", "qwen3-0.6b", [1, 16, 64], True, None), 30),
        ("e2e-8b-new", lambda: engine_section("8b bf16 new", "llama-3.1-8b", [1], True, None), 30),
        ("e2e-8b-old", lambda: engine_section("8b bf16 old", "llama-3.1-8b", [1], False, None), 25),
        ("e2e-0.6b-fp8", lambda: engine_section("0.6b fp8 new", "qwen3-0.6b", [1, 16, 64], True, "fp8"), 30),
        ("e2e-8b-fp8", lambda: engine_section("8b fp8 new", "llama-3.1-8b", [1], True, "fp8"), 30),
        ("attention", attention_section, 15),
        ("pytest", lambda: subprocess_section("pytest", [
            sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
            "tests/test_small_m_gemm.py", "tests/test_kernels.py", "-k", "decode or small_m or quantize or linear"],
            args.budget_s), 30),
        ("offline-8b-fp8", lambda: subprocess_section("offline-8b-fp8", [
            sys.executable, "-m", "tandem", "bench", "offline", "--preset", "llama-3.1-8b",
            "--quantization", "fp8", "--no-overlap-off", "--json", f"{args.out}/offline_8b_fp8.json"],
            args.budget_s), 60),
    ]
    only = set(args.only.split(",")) if args.only else None
    for name, fn, need_s in sections:
        if only and name not in only:
            continue
        if elapsed() + need_s > args.budget_s:
            print(f"SKIP {name}: {elapsed():.0f} s used", flush=True)
            R.setdefault("skipped", []).append(name)
            continue
        t = time.monotonic()
        try:
            fn()
        except Exception:
            R.setdefault("errors", {})[name] = traceback.format_exc()
            print(f"ERROR in {name}:\n{traceback.format_exc()}", flush=True)
            gc.collect()
            torch.cuda.empty_cache()
        R.setdefault("section_s", {})[name] = time.monotonic() - t
        print(f"== {name} done in {time.monotonic() - t:.1f} s (total {elapsed():.0f} s)", flush=True)
        save(args.out)
    print(summary())
    save(args.out)


if __name__ == "__main__":
    main()
