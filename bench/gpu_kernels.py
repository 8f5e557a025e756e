"""Triton attention kernels vs the torch reference on the GPU: correctness, then speed.

    PYTHONPATH=. python bench/gpu_kernels.py --out DIR        # H200, < 3 minutes
    PYTHONPATH=. python bench/gpu_kernels.py --out DIR --smoke  # tiny shapes, CPU ok

Shapes are Qwen3-0.6B (16 heads / 8 KV heads / 128) and Llama-3.1-8B (32 / 8 / 128).
Each case checks the kernel against the float32 reference computed from the same
rounded inputs, then times kernel and reference (native dtype) with
`triton.testing.do_bench` (median, L2 flushed between runs). Decode reports the K/V
bytes read per second against the 4.3 TB/s HBM peak and a device copy measured in the
same run. Prints a markdown table, writes DIR/gpu_kernels.json, and exits 1 if any
comparison failed.
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

from tandem.attention import torch_backend as ref  # noqa: E402
from tandem.kernels import decode_attention, extend_attention, write_kv  # noqa: E402

MODELS = {"qwen3-0.6b": (16, 8, 128), "llama-3.1-8b": (32, 8, 128)}
HBM_PEAK_TBPS = 4.3
TOL = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 2e-2}


def _time_ms(fn) -> float:
    if torch.cuda.is_available():
        return float(triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median"))
    start = time.perf_counter()  # smoke mode: one interpreted run, for plumbing only
    fn()
    return (time.perf_counter() - start) * 1e3


def _paged_cache(seq_lens: list[int], kvh: int, d: int, dtype: torch.dtype, dev: str,
                 page: int, gen: torch.Generator):
    """Caches whose slots come in pages of `page` tokens, pages shuffled (page=1: every
    token scattered). Returns k_cache, v_cache, req_to_token, req_slots."""
    pages_per_req = [triton.cdiv(n, page) for n in seq_lens]
    order = torch.randperm(sum(pages_per_req), generator=gen)
    k_cache = torch.randn(1 + len(order) * page, kvh, d, device=dev, dtype=dtype)
    v_cache = torch.randn_like(k_cache)
    r2t = torch.zeros(len(seq_lens) + 1, max(seq_lens), dtype=torch.int32, device=dev)
    offs = torch.arange(page)
    first = 0
    for i, (n, p) in enumerate(zip(seq_lens, pages_per_req)):
        slots = (1 + order[first:first + p, None] * page + offs).flatten()[:n]
        r2t[i + 1, :n] = slots.to(device=dev, dtype=torch.int32)
        first += p
    req_slots = torch.arange(1, len(seq_lens) + 1, device=dev)
    return k_cache, v_cache, r2t, req_slots


def _check(out: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> tuple[bool, float]:
    err = (out.float() - expected).abs()
    tol = TOL[dtype]
    ok = bool(torch.isfinite(out).all()) and bool((err <= tol + tol * expected.abs()).all())
    return ok, float(err.max())


def _ragged(batch: int, max_len: int, low: int, gen: torch.Generator) -> list[int]:
    lens = torch.randint(low, max_len + 1, (batch,), generator=gen).tolist()
    lens[0] = max_len
    return lens


def bench_decode(model: str, dtype: torch.dtype, batch: int, max_len: int, dev: str,
                 page: int, gen: torch.Generator) -> dict:
    h, kvh, d = MODELS[model]
    seq_lens = _ragged(batch, max_len, max(1, max_len // 2), gen)
    k_cache, v_cache, r2t, req_slots = _paged_cache(seq_lens, kvh, d, dtype, dev, page, gen)
    q = torch.randn(batch, h, d, device=dev, dtype=dtype)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=dev)
    scale = d ** -0.5
    args = (q, k_cache, v_cache, r2t, req_slots, lens, scale, max_len)
    ok, err = _check(decode_attention(*args), ref.decode_attention(
        q.float(), k_cache.float(), v_cache.float(), *args[3:]), dtype)
    kernel_ms = _time_ms(lambda: decode_attention(*args))
    torch_ms = _time_ms(lambda: ref.decode_attention(*args))
    kv_bytes = sum(seq_lens) * kvh * d * 2 * k_cache.element_size()
    return dict(kernel="decode", model=model, dtype=str(dtype)[6:], page=page,
                shape=f"B={batch} L<={max_len}", ok=ok, max_err=err, triton_ms=kernel_ms,
                torch_ms=torch_ms, tbps=kv_bytes / kernel_ms / 1e9)


def bench_extend(model: str, dtype: torch.dtype, name: str, prefix_lens: list[int],
                 extend_lens: list[int], dev: str, gen: torch.Generator) -> dict:
    h, kvh, d = MODELS[model]
    seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens)]
    k_cache, v_cache, r2t, req_slots = _paged_cache(seq_lens, kvh, d, dtype, dev, 1, gen)
    q = torch.randn(sum(extend_lens), h, d, device=dev, dtype=dtype)
    as_i32 = lambda xs: torch.tensor(xs, dtype=torch.int32, device=dev)  # noqa: E731
    indptr = as_i32([0] + torch.tensor(extend_lens).cumsum(0).tolist())
    scale = d ** -0.5
    device_args = (r2t, req_slots, as_i32(seq_lens), as_i32(prefix_lens), indptr, scale)
    run = lambda: extend_attention(q, k_cache, v_cache, *device_args, max(extend_lens))  # noqa: E731
    host = (req_slots.tolist(), seq_lens, extend_lens, scale)
    ok, err = _check(run(), ref.extend_attention(q.float(), k_cache.float(), v_cache.float(),
                                                 r2t, *host), dtype)
    kernel_ms = _time_ms(run)
    torch_ms = _time_ms(lambda: ref.extend_attention(q, k_cache, v_cache, r2t, *host))
    pairs = sum(e * p + e * (e + 1) // 2 for p, e in zip(prefix_lens, extend_lens))
    return dict(kernel="extend", model=model, dtype=str(dtype)[6:], shape=name, ok=ok,
                max_err=err, triton_ms=kernel_ms, torch_ms=torch_ms,
                tflops=4 * h * d * pairs / kernel_ms / 1e9)


def bench_write_kv(model: str, dtype: torch.dtype, tokens: int, dev: str) -> dict:
    _, kvh, d = MODELS[model]
    k_cache = torch.zeros(4 * tokens + 1, kvh, d, device=dev, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    loc = torch.randperm(4 * tokens, device=dev)[:tokens] + 1
    k = torch.randn(tokens, kvh, d, device=dev, dtype=dtype)
    v = torch.randn_like(k)
    write_kv(k_cache, v_cache, loc, k, v)
    ok = torch.equal(k_cache[loc], k) and torch.equal(v_cache[loc], v)
    kernel_ms = _time_ms(lambda: write_kv(k_cache, v_cache, loc, k, v))
    torch_ms = _time_ms(lambda: ref.write_kv(k_cache, v_cache, loc, k, v))
    moved = 2 * 2 * k.numel() * k.element_size()  # K and V, read + write
    return dict(kernel="write_kv", model=model, dtype=str(dtype)[6:], shape=f"T={tokens}",
                ok=ok, max_err=0.0, triton_ms=kernel_ms, torch_ms=torch_ms,
                tbps=moved / kernel_ms / 1e9)


def check_graph_replay(model: str, dev: str, gen: torch.Generator) -> dict:
    """Capture decode once, change lengths and slot table in place, replay, compare."""
    h, kvh, d = MODELS[model]
    seq_lens = _ragged(64, 2048, 1, gen)
    k_cache, v_cache, r2t, req_slots = _paged_cache(seq_lens, kvh, d, torch.bfloat16, dev, 1, gen)
    q = torch.randn(64, h, d, device=dev, dtype=torch.bfloat16)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=dev)
    out = torch.empty_like(q)
    run = lambda: decode_attention(q, k_cache, v_cache, r2t, req_slots, lens, 0.08, 2048,  # noqa: E731
                                   out=out, num_splits=4)
    run()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    lens.copy_(torch.minimum(lens.flip(0), lens))  # new lengths, each within its own row
    graph.replay()
    expected = ref.decode_attention(q.float(), k_cache.float(), v_cache.float(), r2t, req_slots,
                                    lens, 0.08, 2048)
    ok, err = _check(out, expected, torch.bfloat16)
    return dict(kernel="decode graph replay", model=model, dtype="bfloat16", shape="B=64",
                ok=ok, max_err=err)


def measure_copy_tbps(dev: str) -> float:
    x = torch.empty(1 << 30, dtype=torch.uint8, device=dev)
    y = torch.empty_like(x)
    return 2 * x.numel() / _time_ms(lambda: y.copy_(x)) / 1e9


def run_all(dev: str, smoke: bool) -> tuple[list[dict], float]:
    gen = torch.Generator().manual_seed(0)
    rows = []
    if smoke:  # interpreter-sized; float16 because the interpreter's bf16 dot is wrong
        MODELS["tiny"] = (4, 2, 64)
        rows.append(bench_decode("tiny", torch.float16, 3, 300, dev, 1, gen))
        rows.append(bench_extend("tiny", torch.float16, "2 ragged", [0, 20], [33, 5], dev, gen))
        rows.append(bench_write_kv("tiny", torch.float16, 16, dev))
        return rows, 0.0
    copy_tbps = measure_copy_tbps(dev)
    for model in MODELS:
        for batch, max_len in [(1, 1024), (1, 32768), (16, 4096), (64, 4096), (256, 1024)]:
            rows.append(bench_decode(model, torch.bfloat16, batch, max_len, dev, 16, gen))
        rows.append(bench_decode(model, torch.bfloat16, 64, 4096, dev, 1, gen))
        rows.append(bench_decode(model, torch.float16, 64, 4096, dev, 16, gen))
        extends = [("prefill 4x1024", [0] * 4, [1024] * 4),
                   ("prefill 1x8192", [0], [8192]),
                   ("chunk 2x(4096+512)", [4096] * 2, [512] * 2),
                   ("mixed 16 ragged", _ragged(16, 2048, 0, gen), _ragged(16, 512, 64, gen))]
        for name, prefix, extend in extends:
            rows.append(bench_extend(model, torch.bfloat16, name, prefix, extend, dev, gen))
        rows.append(bench_extend(model, torch.float16, *extends[0], dev, gen))
        for tokens in (256, 8192):
            rows.append(bench_write_kv(model, torch.bfloat16, tokens, dev))
        rows.append(check_graph_replay(model, dev, gen))
    return rows, copy_tbps


def markdown(rows: list[dict], copy_tbps: float) -> str:
    lines = [f"device copy: {copy_tbps:.2f} TB/s (peak {HBM_PEAK_TBPS} TB/s)", "",
             "| kernel | model | dtype | shape | ok | max err | triton ms | torch ms | x | rate |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        shape = r["shape"] + (f" page={r['page']}" if "page" in r else "")
        if "tbps" in r:
            rate = f"{r['tbps']:.2f} TB/s ({100 * r['tbps'] / HBM_PEAK_TBPS:.0f}% peak)"
        elif "tflops" in r:
            rate = f"{r['tflops']:.0f} TFLOP/s"
        else:
            rate = ""
        timing = (f"{r['triton_ms']:.4f} | {r['torch_ms']:.4f} | "
                  f"{r['torch_ms'] / r['triton_ms']:.1f}" if "triton_ms" in r else " | | ")
        lines.append(f"| {r['kernel']} | {r['model']} | {r['dtype']} | {shape} | "
                     f"{'ok' if r['ok'] else 'FAIL'} | {r['max_err']:.2e} | {timing} | {rate} |")
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
    rows, copy_tbps = run_all(dev, args.smoke)
    table = markdown(rows, copy_tbps)
    print(table)
    args.out.mkdir(parents=True, exist_ok=True)
    device_name = torch.cuda.get_device_name() if dev == "cuda" else "cpu (interpreter)"
    (args.out / "gpu_kernels.json").write_text(json.dumps(dict(
        device=device_name, torch=torch.__version__, triton=triton.__version__,
        copy_tbps=copy_tbps, hbm_peak_tbps=HBM_PEAK_TBPS, rows=rows,
        wall_s=time.perf_counter() - start), indent=1))
    (args.out / "gpu_kernels.md").write_text(table + "\n")
    failed = [r for r in rows if not r["ok"]]
    print(f"\n{len(rows) - len(failed)}/{len(rows)} ok in {time.perf_counter() - start:.0f}s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
