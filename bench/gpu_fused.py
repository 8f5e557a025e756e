"""Fused elementwise Triton kernels vs the torch path on the GPU: correctness, then speed.

    PYTHONPATH=. python3 bench/gpu_fused.py --out DIR        # H200, < 60 s
    PYTHONPATH=. python3 bench/gpu_fused.py --out DIR --smoke  # tiny shapes, CPU ok

Qwen3-0.6B shapes (hidden 1024, 16 q heads / 8 kv heads / head_dim 128, intermediate
3072), bfloat16, T = 1, 64, 256, 4096 tokens. Ops: rms_norm, add_rms_norm (residual add
+ norm), qk_norm_rope (packed qkv -> Qwen3 per-head q/k norm + RoPE; the Triton one works
in place), rope (the same without the norm: Llama/Qwen2), silu_mul. The torch side is
the modules' CPU code (`tandem.models.layers.*_torch`) run on CUDA tensors.

Each case first checks the Triton output against the torch output (exit 1 on a
mismatch; both round to bf16 at the same places, so differences are an ulp or so), then
times both with `triton.testing.do_bench` (median, L2 flushed between runs):
- eager: one Python call (the torch path launches 8-16 kernels, so at small T its
  time is launch overhead);
- graph: the call captured REPEAT times in a CUDA graph and replayed, per call (what a
  decode step replayed from a graph pays). Also checks the graph-replayed Triton output.
qk_norm_rope at T >= 64 is also timed with 1/2/4/8 heads per program (the default is
chosen by `tandem.kernels.rope.default_heads_per_program`). `kernels` counts the GPU
kernels of one call (torch profiler). Prints a markdown table and writes
DIR/gpu_fused.json and DIR/gpu_fused.md.
"""
import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
import triton  # noqa: E402
import triton.testing  # noqa: E402

from tandem.kernels.activation import silu_mul  # noqa: E402
from tandem.kernels.norm import fused_add_rms_norm, rms_norm  # noqa: E402
from tandem.kernels.rope import default_heads_per_program, qkv_norm_rope  # noqa: E402
from tandem.models.layers import (RotaryEmbedding, qkv_norm_rope_torch, rms_norm_torch,  # noqa: E402
                                  silu_mul_torch)

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER, EPS = 1024, 16, 8, 128, 3072, 1e-6
TOKENS = (1, 64, 256, 4096)
MAX_POS = 8192
REPEAT = 10
TOL = {torch.float32: (1e-5, 1e-5), torch.float16: (2e-3, 2e-3), torch.bfloat16: (2e-2, 1.6e-2)}


def _time_us(fn) -> float:
    if torch.cuda.is_available():
        return 1e3 * float(triton.testing.do_bench(fn, warmup=5, rep=20, return_mode="median"))
    start = time.perf_counter()  # smoke mode: one interpreted run, for plumbing only
    fn()
    return (time.perf_counter() - start) * 1e6


def _graph_us(fn) -> float | None:
    """Per-call time of fn captured REPEAT times in one CUDA graph."""
    if not torch.cuda.is_available():
        return None
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()  # warm: compiled, allocator cached
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(REPEAT):
            fn()
    return _time_us(graph.replay) / REPEAT


def _count_kernels(fn) -> int | None:
    if not torch.cuda.is_available():
        return None
    try:
        from torch.profiler import ProfilerActivity, profile
        fn()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        return sum(1 for e in prof.events()
                   if e.device_type == torch.autograd.DeviceType.CUDA
                   and not e.name.lower().startswith(("memcpy", "memset")))
    except Exception as exc:  # the count is informative only
        print(f"kernel count failed: {exc!r}", file=sys.stderr)
        return None


def _compare(out, expected, dtype) -> tuple[bool, float]:
    atol, rtol = TOL[dtype]
    ok, worst = True, 0.0
    for o, e in zip(out, expected):
        o, e = o.float(), e.float()
        err = (o - e).abs()
        ok &= bool((err <= atol + rtol * e.abs()).all())
        worst = max(worst, float(err.max())) if err.numel() else worst
    return ok, worst


def _cases(t: int, dtype: torch.dtype, dev: str, tables, gen: torch.Generator):
    """(op, torch fn, triton fn, make_inputs) per op; make_inputs returns fresh tensors."""
    cos, sin = tables
    rnd = lambda *s, scale=1.0: (torch.randn(*s, generator=gen) * scale).to(dev, dtype)  # noqa: E731
    w_h, w_q, w_k = rnd(HIDDEN), rnd(HEAD_DIM), rnd(HEAD_DIM)
    pos = torch.randint(0, MAX_POS, (t,), generator=gen).to(dev)
    qkv_cols = (HEADS + 2 * KV_HEADS) * HEAD_DIM
    geom = (HEADS, KV_HEADS, HEAD_DIM)
    cases = [
        ("rms_norm", lambda x: (rms_norm_torch(x, w_h, EPS),),
         lambda x: (rms_norm(x, w_h, EPS),), lambda: (rnd(t, HIDDEN, scale=3.0),)),
        ("add_rms_norm", lambda x, r: (rms_norm_torch(x + r, w_h, EPS), x + r),
         lambda x, r: fused_add_rms_norm(x, r, w_h, EPS),
         lambda: (rnd(t, HIDDEN), rnd(t, HIDDEN, scale=5.0))),
        ("qk_norm_rope", lambda qkv: qkv_norm_rope_torch(qkv, pos, cos, sin, *geom, w_q, w_k, EPS),
         lambda qkv: qkv_norm_rope(qkv, pos, cos, sin, *geom, w_q, w_k, EPS),
         lambda: (rnd(t, qkv_cols, scale=2.0),)),
        ("rope", lambda qkv: qkv_norm_rope_torch(qkv, pos, cos, sin, *geom),
         lambda qkv: qkv_norm_rope(qkv, pos, cos, sin, *geom),
         lambda: (rnd(t, qkv_cols, scale=2.0),)),
        ("silu_mul", lambda gu: (silu_mul_torch(gu),), lambda gu: (silu_mul(gu),),
         lambda: (rnd(t, 2 * INTER, scale=4.0),)),
    ]
    if dev == "cuda" and t >= 64:  # the heads-per-program alternatives, timing only
        for hpp in (1, 2, 4, 8):
            cases.append((f"qk_norm_rope hpp={hpp}", None,
                          lambda qkv, hpp=hpp: qkv_norm_rope(qkv, pos, cos, sin, *geom, w_q, w_k,
                                                             EPS, heads_per_program=hpp),
                          cases[2][3]))
    return cases


def run_all(dev: str, smoke: bool) -> list[dict]:
    gen = torch.Generator().manual_seed(0)
    dtype = torch.float16 if smoke else torch.bfloat16  # the interpreter has no real bf16
    tokens = (1, 5) if smoke else TOKENS
    rot = RotaryEmbedding(HEAD_DIM, MAX_POS, 1e6, None).to(dev)
    tables = (rot.cos, rot.sin)
    rows = []
    for t in tokens:
        for op, torch_fn, triton_fn, make in _cases(t, dtype, dev, tables, gen):
            row = dict(op=op, tokens=t, dtype=str(dtype).removeprefix("torch."))
            if torch_fn is None:
                row.update(ok=True, max_err=0.0)
            else:
                inputs = make()
                expected = torch_fn(*inputs)
                ok, err = _compare(triton_fn(*[x.clone() for x in inputs]), expected, dtype)
                if dev == "cuda":  # a graph captured on static inputs, replayed on new ones
                    static = [x.clone() for x in inputs]
                    triton_fn(*[x.clone() for x in static])  # warm
                    torch.cuda.synchronize()
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph):
                        outs = triton_fn(*static)
                    fresh = make()
                    for s, f in zip(static, fresh):
                        s.copy_(f)
                    graph.replay()
                    ok2, err2 = _compare(outs, torch_fn(*fresh), dtype)
                    ok, err = ok and ok2, max(err, err2)
                row.update(ok=ok, max_err=err)
                row["torch_eager_us"] = _time_us(lambda: torch_fn(*inputs))
                row["torch_graph_us"] = _graph_us(lambda: torch_fn(*inputs))
                if t == tokens[0]:
                    row["torch_kernels"] = _count_kernels(lambda: torch_fn(*inputs))
            inputs = make()
            row["triton_eager_us"] = _time_us(lambda: triton_fn(*inputs))
            row["triton_graph_us"] = _graph_us(lambda: triton_fn(*inputs))
            if torch_fn is not None and t == tokens[0]:
                row["triton_kernels"] = _count_kernels(lambda: triton_fn(*inputs))
            if op.startswith("qk_norm_rope") and torch_fn is not None:
                row["heads_per_program"] = default_heads_per_program(t, HEADS)
            rows.append(row)
            print(f"  {op} T={t}: {'ok' if row['ok'] else 'FAIL'}", file=sys.stderr, flush=True)
    return rows


def _fmt(x, spec=".1f") -> str:
    return "" if x is None else format(x, spec)


def markdown(rows: list[dict]) -> str:
    lines = ["| op | T | ok | max err | kernels torch/triton | torch µs | triton µs | speed-up "
             "| torch graph µs | triton graph µs | graph speed-up |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        te, ge = r.get("torch_eager_us"), r.get("torch_graph_us")
        se = _fmt(te / r["triton_eager_us"], ".2f") if te else ""
        sg = _fmt(ge / r["triton_graph_us"], ".2f") if ge and r["triton_graph_us"] else ""
        kernels = (f"{r['torch_kernels']}/{r['triton_kernels']}"
                   if r.get("torch_kernels") is not None else "")
        op = r["op"] + (f" (hpp={r['heads_per_program']})" if "heads_per_program" in r else "")
        lines.append(f"| {op} | {r['tokens']} | {'ok' if r['ok'] else 'FAIL'} | "
                     f"{r['max_err']:.2e} | {kernels} | {_fmt(te)} | {_fmt(r['triton_eager_us'])} | "
                     f"{se} | {_fmt(ge)} | {_fmt(r['triton_graph_us'])} | {sg} |")
    # One decode layer's elementwise glue: 2 x add_rms_norm + qk_norm_rope + silu_mul.
    per_layer = {"add_rms_norm": 2, "qk_norm_rope": 1, "silu_mul": 1}
    for t in sorted({r["tokens"] for r in rows}):
        sel = [r for r in rows if r["tokens"] == t and r["op"] in per_layer]
        if len(sel) == len(per_layer) and all(r.get("torch_graph_us") for r in sel):
            torch_us = sum(per_layer[r["op"]] * r["torch_graph_us"] for r in sel)
            triton_us = sum(per_layer[r["op"]] * r["triton_graph_us"] for r in sel)
            lines.append(f"\nQwen3 layer glue (2 add_rms_norm + qk_norm_rope + silu_mul), T={t}, "
                         f"graph: torch {torch_us:.1f} µs, triton {triton_us:.1f} µs "
                         f"(x28 layers: {28 * torch_us / 1e3:.2f} ms -> {28 * triton_us / 1e3:.2f} ms)")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--smoke", action="store_true", help="tiny shapes; runs on the CPU")
    args = parser.parse_args()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    if dev == "cpu" and not args.smoke:
        print("no CUDA device: use --smoke for a CPU plumbing check", file=sys.stderr)
        return 2
    start = time.perf_counter()
    with torch.no_grad():
        rows = run_all(dev, args.smoke)
    table = markdown(rows)
    print(table)
    args.out.mkdir(parents=True, exist_ok=True)
    device_name = torch.cuda.get_device_name() if dev == "cuda" else "cpu (interpreter)"
    (args.out / "gpu_fused.json").write_text(json.dumps(dict(
        device=device_name, torch=torch.__version__, triton=triton.__version__,
        shapes=dict(hidden=HIDDEN, heads=HEADS, kv_heads=KV_HEADS, head_dim=HEAD_DIM,
                    intermediate=INTER), graph_repeat=REPEAT, rows=rows,
        wall_s=time.perf_counter() - start), indent=1))
    (args.out / "gpu_fused.md").write_text(table + "\n")
    failed = [r for r in rows if not r["ok"]]
    print(f"\n{len(rows) - len(failed)}/{len(rows)} ok in {time.perf_counter() - start:.0f}s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
