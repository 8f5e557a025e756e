"""Weight-streaming GEMM for few rows (decode at small batch): y[M, N] = x[M, K] @ W[N, K]^T.

At M <= 16 a linear layer is a pure weight read, and cuBLAS's M=1 kernels stream weights
at ~1.1 TB/s on the H200 (docs/benchmarks.md). Here each program owns BLOCK_N output
columns and one K-slice of the weight, so the grid (N blocks x K splits) has enough
programs in flight to saturate HBM even when N is small. With one split the program
writes the output (bias and dtype cast fused); with several, fp32 partials go to a
workspace and a tiny second kernel sums them.

M = 1 reduces in registers (multiply + sum along K); larger M either pads to 16 rows for a
`tl.dot`, or (`per_lane`, a few rows: a verify step's k + 1 queries) keeps the M = 1 scheme
with a [M, BLOCK_N, BLOCK_K] accumulator, each weight tile loaded once for every row. For the MLP's down projection the input can be the packed gate_up rows: the
kernel then forms silu(gate) * up while loading x (rounded as `kernels.activation`
does), which saves the separate SiLU-mul launch per layer at small batch. FP8 (e4m3) weights are converted in registers and their per-output-channel
scale is applied to the accumulator (it commutes with the sum over K).
Every launch has a host-fixed grid and no device reads: CUDA-graph capturable.
"""
from dataclasses import dataclass

import torch
import triton
import triton.language as tl


@dataclass(frozen=True)
class GemmConfig:
    block_n: int
    block_k: int
    split_k: int
    num_warps: int = 4
    num_stages: int = 3
    per_lane: bool = False  # M > 1: products accumulate per lane (rows padded to a power of 2), no tl.dot


@triton.jit
def _small_m_gemm_kernel(
    X, W, Scale, Bias, Out, Partial,
    M, N, K, k_per_split, stride_xm, stride_wn, stride_om, stride_ps,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    SPLIT: tl.constexpr, HAS_SCALE: tl.constexpr, HAS_BIAS: tl.constexpr,
    EVEN_K: tl.constexpr, EVEN_N: tl.constexpr, SILU_MUL: tl.constexpr,
    DOT_PRECISION: tl.constexpr, PER_LANE: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    mask_n = offs_n < N
    mask_m = offs_m < M
    k_start = pid_k * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    w_rows = W + offs_n.to(tl.int64)[:, None] * stride_wn
    x_rows = X + offs_m[:, None] * stride_xm
    if BLOCK_M == 1:
        # Elementwise products accumulate per lane; one cross-lane reduction at the end.
        acc2 = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    elif PER_LANE:
        acc3 = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_K], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        if EVEN_K:  # k_per_split is a multiple of BLOCK_K and K of k_per_split
            mask_x = mask_m[:, None]
            if EVEN_N:
                w = tl.load(w_rows + offs_k[None, :])
            else:
                w = tl.load(w_rows + offs_k[None, :], mask=mask_n[:, None], other=0.0)
        else:
            mask_k = offs_k < k_end
            mask_x = mask_m[:, None] & mask_k[None, :]
            w = tl.load(w_rows + offs_k[None, :], mask=mask_n[:, None] & mask_k[None, :], other=0.0)
        x = tl.load(x_rows + offs_k[None, :], mask=mask_x, other=0.0)
        if SILU_MUL:  # x holds gate; up sits K columns further
            up = tl.load(x_rows + K + offs_k[None, :], mask=mask_x, other=0.0).to(tl.float32)
            gate = x.to(tl.float32)
            act = (gate / (1.0 + tl.exp(-gate))).to(x.dtype).to(tl.float32)
            x = (act * up).to(x.dtype)
        if BLOCK_M == 1:
            acc2 += x.to(tl.float32) * w.to(tl.float32)
        elif PER_LANE:
            acc3 += x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :]
        else:
            acc = tl.dot(x, tl.trans(w.to(x.dtype)), acc, input_precision=DOT_PRECISION)
    if BLOCK_M == 1:
        acc = tl.sum(acc2, axis=1)[None, :]
    elif PER_LANE:
        acc = tl.sum(acc3, axis=2)
    if HAS_SCALE:
        acc = acc * tl.load(Scale + offs_n, mask=mask_n, other=0.0)[None, :]
    mask = mask_m[:, None] & mask_n[None, :]
    if SPLIT:
        tl.store(Partial + pid_k * stride_ps + offs_m[:, None] * N + offs_n[None, :], acc, mask=mask)
    else:
        if HAS_BIAS:
            acc += tl.load(Bias + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
        tl.store(Out + offs_m[:, None] * stride_om + offs_n[None, :],
                 acc.to(Out.dtype.element_ty), mask=mask)


@triton.jit
def _split_reduce_kernel(Partial, Bias, Out, N, stride_ps, stride_om, split_k,
                         HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
    m = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for s in range(split_k):  # a runtime bound: no compile per split count
        acc += tl.load(Partial + s * stride_ps + m * N + offs, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(Bias + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(Out + m * stride_om + offs, acc.to(Out.dtype.element_ty), mask=mask)


MAX_M = 16


def k_per_split(k: int, cfg: GemmConfig) -> int:
    """K elements per split: whole BLOCK_K tiles, so only the last split can be ragged."""
    return triton.cdiv(triton.cdiv(k, cfg.split_k), cfg.block_k) * cfg.block_k


def small_m_gemm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                 scale: torch.Tensor | None, cfg: GemmConfig, silu_mul: bool = False) -> torch.Tensor:
    """x [..., K] (M = rows <= 16), weight [N, K] (16-bit, or fp8 with `scale` [N] fp32).
    With `silu_mul`, x is [..., 2K] packed (gate, up) and the input is silu(gate) * up."""
    k = x.shape[-1] // 2 if silu_mul else x.shape[-1]
    n = weight.shape[0]
    x2 = x.reshape(-1, x.shape[-1])
    m = x2.shape[0]
    if m > MAX_M:
        raise ValueError(f"small_m_gemm takes at most {MAX_M} rows, got {m}")
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    assert weight.stride(-1) == 1 and weight.shape[1] == k
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return out.reshape(*x.shape[:-1], n)
    per_split = k_per_split(k, cfg)
    splits = triton.cdiv(k, per_split)
    even_k = k % cfg.block_k == 0 and per_split * splits == k
    partial = (torch.empty(splits, m, n, dtype=torch.float32, device=x.device)
               if splits > 1 else out)
    block_m = 1 if m == 1 else (triton.next_power_of_2(m) if cfg.per_lane else 16)
    _small_m_gemm_kernel[(triton.cdiv(n, cfg.block_n), splits)](
        x2, weight, scale if scale is not None else weight, bias if bias is not None else weight,
        out, partial, m, n, k, per_split, x2.stride(0), weight.stride(0), out.stride(0),
        partial.stride(0) if splits > 1 else 0,
        BLOCK_M=block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, SPLIT=splits > 1,
        HAS_SCALE=scale is not None, HAS_BIAS=bias is not None, EVEN_K=even_k,
        EVEN_N=n % cfg.block_n == 0, SILU_MUL=silu_mul,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",  # fp32 tests: exact
        PER_LANE=cfg.per_lane, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    if splits > 1:
        block = 1024
        _split_reduce_kernel[(m, triton.cdiv(n, block))](
            partial, bias if bias is not None else partial, out, n, partial.stride(0),
            out.stride(0), splits, HAS_BIAS=bias is not None, BLOCK=block, num_warps=4)
    return out.reshape(*x.shape[:-1], n)
