"""Startup autotune of the small-M GEMM: per (N, K, M bucket, dtypes), the fastest of a few
weight-streaming configs and cuBLAS, measured on the device.

It runs once, before CUDA-graph capture (it synchronizes; the serving loop never tunes).
Results are written into each layer's `plan`; layers of the same shape share one
measurement. Timing flushes L2 between runs (`triton.testing.do_bench`): a decode step
reads ~1 GB of weights, so a layer's weights are never cache-resident in serving.
"""
import logging
import time

import torch
import triton
from triton.testing import do_bench

from tandem.kernels.small_m_gemm import GemmConfig, k_per_split, small_m_gemm
from tandem.models.linear import MAX_SMALL_M, Linear, linear

log = logging.getLogger("tandem")

M_BUCKETS = (1, 2, 4, 8, 16)
# (block_n, block_k, num_warps): M=1 reduces in registers, so wide K tiles keep loads
# 16-byte vectors; M>1 feeds tl.dot, which wants moderate tiles.
_TILES_M1 = ((16, 512, 4), (32, 256, 4), (8, 1024, 4))
_TILES_DOT = ((32, 256, 4), (64, 128, 4), (16, 512, 4))


def candidates(n: int, k: int, m: int, num_sms: int) -> list[GemmConfig]:
    """A handful of tiles, each with no split and with the split that fills ~4 waves of SMs."""
    out: list[GemmConfig] = []
    for block_n, block_k, warps in (_TILES_M1 if m == 1 else _TILES_DOT):
        if block_k > triton.next_power_of_2(k):
            continue
        blocks = triton.cdiv(n, block_n)
        max_split = max(1, k // block_k)
        want = min(max_split, triton.next_power_of_2(triton.cdiv(4 * num_sms, blocks)))
        for split in sorted({1, want, max(1, want // 2)}):
            cfg = GemmConfig(block_n, block_k, split, warps)
            if cfg not in out and triton.cdiv(k, k_per_split(k, cfg)) == split:
                out.append(cfg)
    return out


def _time_ms(fn) -> float:
    return do_bench(fn, warmup=3, rep=12)


@torch.no_grad()
def tune_shape(weight: torch.Tensor, scale: torch.Tensor | None, x_dtype: torch.dtype,
               m: int) -> tuple[GemmConfig | None, float, float]:
    """(best config or None for cuBLAS, its ms, cuBLAS ms) for one shape and M."""
    n, k = weight.shape
    x = torch.randn(m, k, device=weight.device, dtype=x_dtype)
    best, best_ms = None, _time_ms(lambda: linear(x, weight, None, scale, None))
    cublas_ms = best_ms
    sms = torch.cuda.get_device_properties(weight.device).multi_processor_count
    for cfg in candidates(n, k, m, sms):
        ms = _time_ms(lambda: small_m_gemm(x, weight, None, scale, cfg))
        if ms < best_ms:
            best, best_ms = cfg, ms
    return best, best_ms, cublas_ms


def tune_model(model: torch.nn.Module, dtype: torch.dtype, max_m: int = MAX_SMALL_M) -> dict:
    """Fill every `Linear`'s plan for M buckets up to `max_m`; returns the results by shape
    {(N, K, weight dtype, M): (config, ms, cuBLAS ms)} for logging and benchmarks."""
    started = time.monotonic()
    results: dict = {}
    layers = [mod for mod in model.modules() if isinstance(mod, Linear)]
    for layer in layers:
        w = layer.weight
        for m in (b for b in M_BUCKETS if b <= max_m):
            key = (w.shape[0], w.shape[1], w.dtype, m)
            if key not in results:
                results[key] = tune_shape(w, layer.weight_scale, dtype, m)
            if results[key][0] is not None:
                layer.plan[m] = results[key][0]
    log.info("small-M GEMM tuning: %d shapes in %.1fs", len(results), time.monotonic() - started)
    for (n, k, wdt, m), (cfg, ms, cublas_ms) in sorted(results.items(), key=lambda kv: kv[0][:2] + kv[0][3:]):
        log.debug("N=%d K=%d %s M=%d: %s %.1f us (cuBLAS %.1f us)", n, k, wdt, m, cfg,
                  ms * 1e3, cublas_ms * 1e3)
    return results
