"""Startup autotune of the small-M GEMM: per (N, K, M bucket, dtypes), the fastest of a few
weight-streaming configs and cuBLAS, measured on the device.

It runs once, before CUDA-graph capture (it synchronizes; the serving loop never tunes).
Results are written into each layer's `plan`, and into a gated layer's `silu_plan` (an MLP's
down projection fed packed gate/up rows: the fused SiLU-mul input is timed against the two
launches it replaces; judged by the unfused timing it ran 4-6x slower at 8 and 16 rows), and a
normed layer's `norm_plan` (qkv and gate/up with the residual add + RMSNorm in the prologue,
timed against the norm kernel + the layer's own plan; `fuse_norm=False` leaves it empty);
layers of the same shape share one measurement. Each candidate is timed the way decode runs it: back-to-back launches inside
a CUDA graph, each on a different copy of the weight so the copies together exceed L2
(a decode step streams ~1 GB of weights; a layer's weight is never cache-resident).
Timing launches from Python instead measures the host, not the kernel.
"""
import logging
import time

import torch

from tandem.kernels.activation import silu_mul
from tandem.kernels.grid import cdiv, next_power_of_2
from tandem.kernels.norm import fused_add_rms_norm
from tandem.kernels.small_m_gemm import GemmConfig, NormInput, k_per_split, small_m_gemm, small_m_gemm_add_norm
from tandem.models.linear import MAX_SMALL_M, Linear, linear, m_bucket

log = logging.getLogger("tandem")

M_BUCKETS = (1, 2, 4, 8, 16)
STREAM_BYTES = 192 << 20  # weight copies per timing: well past the H200's 50 MB of L2
REPLAYS = 5
# (block_n, block_k, num_warps). M=1 accumulates products per lane, so the tile is the
# bytes in flight per program; M>1 feeds tl.dot with M padded to 16.
_TILES_M1 = ((4, 1024, 4), (8, 512, 4), (8, 1024, 4), (16, 256, 4), (16, 512, 4), (32, 256, 4),
             (16, 512, 8))
_TILES_DOT = ((16, 256, 4), (32, 256, 4), (64, 128, 4), (32, 128, 4))
# M = 2..16 per lane (GemmConfig.per_lane): the accumulator holds M x block_n x block_k fp32,
# 8192 of them (64 registers a thread at 4 warps), so the tile shrinks as M grows.
_LANE_ELEMENTS = 8192
_LANE_BLOCK_N = (4, 8)


def candidates(n: int, k: int, m: int, num_sms: int) -> list[GemmConfig]:
    """Each tile with no split and with the splits that fill ~2 and ~4 waves of SMs."""
    out: list[GemmConfig] = []
    tiles = [(bn, bk, w, False) for bn, bk, w in (_TILES_M1 if m == 1 else _TILES_DOT)]
    # M 16 too (session 34, untimed yet): in the engine a one-row verify of 9 queries (M 16
    # bucket) took 1.27 ms on the H100 against 0.97 for 8 queries (M 8, where per-lane tiles compete).
    if 1 < m:
        tiles += [(bn, _LANE_ELEMENTS // (m * bn), 4, True) for bn in _LANE_BLOCK_N]
    for block_n, block_k, warps, per_lane in tiles:
        if block_k > next_power_of_2(k):
            continue
        blocks = cdiv(n, block_n)
        max_split = max(1, k // block_k)
        for waves in (0, 2, 4):
            split = min(max_split, next_power_of_2(cdiv(waves * num_sms, blocks))) if waves else 1
            cfg = GemmConfig(block_n, block_k, max(split, 1), warps, per_lane=per_lane)
            if cfg not in out and cdiv(k, k_per_split(k, cfg)) == cfg.split_k:
                out.append(cfg)
    return out


def graph_time_ms(run, copies: int, replays: int = REPLAYS) -> float:
    """Mean device ms of `run(i)` over `copies` back-to-back launches captured in a graph,
    the graph replayed `replays` times between two CUDA events."""
    for i in range(copies):  # compile and warm outside the capture
        run(i)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(copies):
            run(i)
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / (replays * copies)


@torch.no_grad()
def tune_shape(weight: torch.Tensor, scale: torch.Tensor | None, x_dtype: torch.dtype,
               m: int) -> tuple[GemmConfig | None, float, float]:
    """(best config or None for cuBLAS, its ms, cuBLAS ms) for one shape and M."""
    n, k = weight.shape
    weights = _weight_copies(weight)
    x = torch.randn(m, k, device=weight.device, dtype=x_dtype)
    try:  # cuBLAS (or its scaled FP8 GEMM) is the baseline to beat
        cublas_ms = graph_time_ms(lambda i: linear(x, weights[i], None, scale, None), len(weights))
    except RuntimeError as e:  # e.g. a shape cuBLASLt's FP8 kernels refuse
        log.warning("cuBLAS failed for N=%d K=%d M=%d: %s", n, k, m, e)
        cublas_ms = float("inf")
    best, best_ms = _fastest(lambda cfg: lambda i: small_m_gemm(x, weights[i], None, scale, cfg),
                             weights, m, cublas_ms)
    return best, best_ms, cublas_ms


@torch.no_grad()
def tune_gated_shape(weight: torch.Tensor, scale: torch.Tensor | None, x_dtype: torch.dtype, m: int,
                     unfused: GemmConfig | None) -> tuple[GemmConfig | None, float, float]:
    """The same for a gated layer's fused input (packed gate, up rows [m, 2K]; the kernel forms
    silu(gate) * up while loading them). The baseline is what the caller runs otherwise: the
    SiLU-mul kernel, then the layer's unfused plan (`unfused`, or cuBLAS)."""
    k = weight.shape[1]
    weights = _weight_copies(weight)
    gate_up = torch.randn(m, 2 * k, device=weight.device, dtype=x_dtype)
    plan = {m_bucket(m): unfused} if unfused is not None else None
    two_step_ms = graph_time_ms(lambda i: linear(silu_mul(gate_up), weights[i], None, scale, plan), len(weights))
    best, best_ms = _fastest(
        lambda cfg: lambda i: small_m_gemm(gate_up, weights[i], None, scale, cfg, silu_mul=True),
        weights, m, two_step_ms)
    return best, best_ms, two_step_ms


@torch.no_grad()
def tune_normed_shape(weight: torch.Tensor, scale: torch.Tensor | None, x_dtype: torch.dtype, m: int,
                      unfused: GemmConfig | None) -> tuple[GemmConfig | None, float, float]:
    """The same for a normed layer's fused input (residual add + RMSNorm in the prologue). The
    baseline is what the caller runs otherwise: the add + norm kernel, then the layer's unfused
    plan (`unfused`, or cuBLAS). Timed with a residual, as every norm but the first has one."""
    k = weight.shape[1]
    weights = _weight_copies(weight)
    x, residual = (torch.randn(m, k, device=weight.device, dtype=x_dtype) for _ in range(2))
    norm = NormInput(torch.rand(k, device=weight.device, dtype=x_dtype) + 0.5, 1e-6, residual)
    plan = {m_bucket(m): unfused} if unfused is not None else None

    def two_step(i: int) -> torch.Tensor:
        normed, _ = fused_add_rms_norm(x, residual, norm.weight, norm.eps)
        return linear(normed, weights[i], None, scale, plan)

    two_step_ms = graph_time_ms(two_step, len(weights))
    best, best_ms = _fastest(
        lambda cfg: lambda i: small_m_gemm_add_norm(x, norm, weights[i], None, scale, cfg),
        weights, m, two_step_ms)
    return best, best_ms, two_step_ms


def _weight_copies(weight: torch.Tensor) -> list[torch.Tensor]:
    """Enough copies of the weight that one timing streams them from HBM, not L2."""
    copies = max(2, min(64, STREAM_BYTES // (weight.numel() * weight.element_size())))
    return [weight] + [weight.clone() for _ in range(copies - 1)]


def _fastest(launcher, weights: list[torch.Tensor], m: int, baseline_ms: float) -> tuple[GemmConfig | None, float]:
    """The candidate whose `launcher(cfg)` (a function of the index into `weights`, the
    weight's copies) beats the baseline, and its ms; (None, baseline_ms) when none does."""
    (n, k), best, best_ms = weights[0].shape, None, baseline_ms
    sms = torch.cuda.get_device_properties(weights[0].device).multi_processor_count
    for cfg in candidates(n, k, m, sms):
        ms = graph_time_ms(launcher(cfg), len(weights))
        if ms < best_ms:
            best, best_ms = cfg, ms
    return best, best_ms


def tune_model(model: torch.nn.Module, dtype: torch.dtype, max_m: int = MAX_SMALL_M,
               fuse_norm: bool = True) -> dict:
    """Fill every `Linear`'s plan (a gated layer's `silu_plan`, and with `fuse_norm` a normed
    layer's `norm_plan`) for M buckets up to `max_m`; returns the results by shape
    {(N, K, weight dtype, M, fused input: None, "silu_mul" or "norm"): (config, ms, baseline
    ms)} for logging and benchmarks (the baseline: cuBLAS, or the two launches it replaces)."""
    started = time.monotonic()
    results: dict = {}
    layers = [mod for mod in model.modules() if isinstance(mod, Linear)]
    for layer in layers:
        for m in (b for b in M_BUCKETS if b <= max_m):
            _tune_layer(layer, dtype, m, fuse_norm, results)
    torch.cuda.empty_cache()  # the timing copies
    log.info("small-M GEMM tuning: %d shapes in %.1fs; %s", len(results), time.monotonic() - started,
             plan_summary(results))
    for (n, k, wdt, m, fused), (cfg, ms, base_ms) in results.items():
        log.debug("N=%d K=%d %s M=%d%s: %s %.1f us (baseline %.1f us)", n, k, wdt, m,
                  f" {fused} input" if fused else "", cfg, ms * 1e3, base_ms * 1e3)
    return results


def plan_summary(results: dict) -> str:
    """Which (shape, M) cases chose a Triton kernel, by input kind: e.g. "norm M=1 2/2, M=16 0/2"."""
    chosen: dict[str, dict[int, list[int]]] = {}
    for (_, _, _, m, fused), (cfg, _, _) in results.items():
        won = chosen.setdefault(fused or "plain", {}).setdefault(m, [0, 0])
        won[0] += cfg is not None
        won[1] += 1
    return "; ".join(f"{kind} " + ", ".join(f"M={m} {w}/{n}" for m, (w, n) in sorted(by_m.items()))
                     for kind, by_m in chosen.items())


def _tune_layer(layer: Linear, dtype: torch.dtype, m: int, fuse_norm: bool, results: dict) -> None:
    """One layer's plans for one M bucket, measuring each shape once (into `results`)."""
    w = layer.weight
    key = (w.shape[0], w.shape[1], w.dtype, m, None)
    if key not in results:
        results[key] = tune_shape(w, layer.weight_scale, dtype, m)
    unfused = results[key][0]
    if unfused is not None:
        layer.plan[m] = unfused
    fused_inputs = [("silu_mul", tune_gated_shape, layer.silu_plan)] if layer.gated else []
    if layer.normed and fuse_norm:
        fused_inputs.append(("norm", tune_normed_shape, layer.norm_plan))
    for name, tune, plan in fused_inputs:
        fused = key[:4] + (name,)
        if fused not in results:
            results[fused] = tune(w, layer.weight_scale, dtype, m, unfused)
        if results[fused][0] is not None:
            plan[m] = results[fused][0]
