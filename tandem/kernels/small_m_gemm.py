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
does), which saves the separate SiLU-mul launch per layer at small batch. The same way, the
qkv and gate/up projections can take the residual add + RMSNorm in front of them
(`small_m_gemm_add_norm`, issue 21): with h = x + residual (rounded to x's dtype, as
`kernels.norm` does) the projection of the normed row is rstd[m] * sum_k h[m,k] g[k] W[n,k],
so the kernel multiplies the loaded tile by the norm weight g, sums h^2 over its K range and
scales the accumulator by rstd at the end: by itself without split-K, else the reduce kernel
sums the splits' squares (written, like h, by the first column block only) before applying it.
The normed row is never rounded to 16 bits (`tl.dot` takes h exactly and W * g rounded: h * g
could overflow fp16), so results differ from norm-then-GEMM by rounding. FP8 (e4m3) weights are converted in
registers and their per-output-channel scale is applied to the accumulator (it commutes with
the sum over K, as rstd does).
Every launch has a host-fixed grid and no device reads: CUDA-graph capturable.
"""
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from tandem.kernels.grid import cdiv, next_power_of_2
from tandem.kernels.pdl import pdl_options, pdl_prologue


@dataclass(frozen=True)
class GemmConfig:
    block_n: int
    block_k: int
    split_k: int
    num_warps: int = 4
    num_stages: int = 3
    per_lane: bool = False  # M > 1: products accumulate per lane (rows padded to a power of 2), no tl.dot


@dataclass(frozen=True)
class NormInput:
    """The RMSNorm in front of a projection (issue 21): the kernel's input is
    rms_norm(x + residual) * weight, or rms_norm(x) * weight with no residual (the first layer)."""
    weight: torch.Tensor  # [K], the norm's scale
    eps: float
    residual: torch.Tensor | None = None  # [..., K] like x


@triton.jit
def _silu_mul_input(gate, up_ptrs, mask_x):
    """silu(gate) * up, rounded as `kernels.activation` does; up sits K columns after gate."""
    up = tl.load(up_ptrs, mask=mask_x, other=0.0).to(tl.float32)
    g = gate.to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(gate.dtype).to(tl.float32)
    return (act * up).to(gate.dtype)


@triton.jit
def _add_norm_input(x, res_ptrs, res_out_ptrs, NormW, offs_k, k_end, mask_x, write_rows,
                    HAS_RESIDUAL: tl.constexpr):
    """(h, the norm weight g of these columns in fp32, the rows' sum of h^2) for h = x + residual
    rounded to x's dtype (as `kernels.norm` rounds the new residual). rstd needs the whole row,
    so the caller applies it to the accumulator. h is the next layer's residual: stored once,
    for the rows in `write_rows` (all rows in the pid_n == 0 programs, none elsewhere)."""
    if HAS_RESIDUAL:
        r = tl.load(res_ptrs, mask=mask_x, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        tl.store(res_out_ptrs, x, mask=mask_x & write_rows[:, None])
    h = x.to(tl.float32)
    g = tl.load(NormW + offs_k, mask=offs_k < k_end, other=0.0).to(tl.float32)
    return x, g, tl.sum(h * h, axis=1)


@triton.jit
def _small_m_gemm_kernel(
    X, W, Scale, Bias, Out, Partial, Res, NormW, ResOut, SqPartial,
    M, N, K, k_per_split, stride_xm, stride_wn, stride_om, stride_ps, stride_rm, eps,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    SPLIT: tl.constexpr, HAS_SCALE: tl.constexpr, HAS_BIAS: tl.constexpr,
    EVEN_K: tl.constexpr, EVEN_N: tl.constexpr, SILU_MUL: tl.constexpr,
    NORM: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
    DOT_PRECISION: tl.constexpr, PER_LANE: tl.constexpr, USE_PDL: tl.constexpr,
):
    pdl_prologue(USE_PDL)
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
    ssq = tl.zeros([BLOCK_M], dtype=tl.float32)  # NORM: this K range's sum of h^2 per row
    # The first column block writes what is per row (h, ssq). A row-shaped mask: the
    # interpreter types a scalar bool & a tensor as int32, which a store rejects.
    first_rows = mask_m & (offs_m * 0 + pid_n == 0)
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
            x = _silu_mul_input(x, x_rows + K + offs_k[None, :], mask_x)
        if NORM:
            x, g, sq = _add_norm_input(x, Res + offs_m[:, None] * stride_rm + offs_k[None, :],
                                       ResOut + offs_m[:, None] * K + offs_k[None, :], NormW, offs_k,
                                       k_end, mask_x, first_rows, HAS_RESIDUAL)
            ssq += sq
            if BLOCK_M == 1 or PER_LANE:  # fp32 products: h * g is never rounded
                x = x.to(tl.float32) * g[None, :]
            else:  # the dot takes h as is and g on the weight: h * g could overflow fp16
                w = w.to(tl.float32) * g[None, :]  # (before rstd shrinks it), W * g cannot
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
        if NORM:  # the reduce kernel sums the splits' parts of the row before taking rstd
            tl.store(SqPartial + pid_k * M + offs_m, ssq, mask=first_rows)
    else:
        if NORM:  # rstd scales the whole dot product (both it and the FP8 scale commute with it)
            acc = acc * (1.0 / tl.sqrt(ssq / K + eps))[:, None]
        if HAS_BIAS:
            acc += tl.load(Bias + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
        tl.store(Out + offs_m[:, None] * stride_om + offs_n[None, :],
                 acc.to(Out.dtype.element_ty), mask=mask)


@triton.jit
def _split_reduce_kernel(Partial, SqPartial, Bias, Out, M, N, K, stride_ps, stride_om, split_k, eps,
                         HAS_BIAS: tl.constexpr, NORM: tl.constexpr, BLOCK: tl.constexpr,
                         USE_PDL: tl.constexpr):
    pdl_prologue(USE_PDL)
    m = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    ssq = tl.zeros([1], dtype=tl.float32)  # NORM: the row's sum of squares, over the splits
    for s in range(split_k):  # a runtime bound: no compile per split count
        acc += tl.load(Partial + s * stride_ps + m * N + offs, mask=mask, other=0.0)
        if NORM:
            ssq += tl.load(SqPartial + s * M + m + tl.zeros([1], dtype=tl.int32))
    if NORM:
        acc = acc * (1.0 / tl.sqrt(ssq / K + eps))
    if HAS_BIAS:
        acc += tl.load(Bias + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(Out + m * stride_om + offs, acc.to(Out.dtype.element_ty), mask=mask)


MAX_M = 16


def k_per_split(k: int, cfg: GemmConfig) -> int:
    """K elements per split: whole BLOCK_K tiles, so only the last split can be ragged."""
    return cdiv(cdiv(k, cfg.split_k), cfg.block_k) * cfg.block_k


def small_m_gemm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                 scale: torch.Tensor | None, cfg: GemmConfig, silu_mul: bool = False) -> torch.Tensor:
    """x [..., K] (M = rows <= 16), weight [N, K] (16-bit, or fp8 with `scale` [N] fp32).
    With `silu_mul`, x is [..., 2K] packed (gate, up) and the input is silu(gate) * up."""
    return _launch(x, weight, bias, scale, cfg, silu_mul, None)[0]


def small_m_gemm_add_norm(x: torch.Tensor, norm: NormInput, weight: torch.Tensor, bias: torch.Tensor | None,
                          scale: torch.Tensor | None, cfg: GemmConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """(the projection of rms_norm(x + norm.residual) * norm.weight, x + norm.residual) in one
    launch (two with split-K); without a residual, of rms_norm(x) * norm.weight, and x itself."""
    return _launch(x, weight, bias, scale, cfg, False, norm)


def _rows(t: torch.Tensor) -> torch.Tensor:
    t2 = t.reshape(-1, t.shape[-1])
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def _launch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, scale: torch.Tensor | None,
            cfg: GemmConfig, silu_mul: bool, norm: NormInput | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, new residual: x when `norm` has no residual, unused without `norm`)."""
    k = x.shape[-1] // 2 if silu_mul else x.shape[-1]
    n = weight.shape[0]
    x2 = _rows(x)
    m = x2.shape[0]
    if m > MAX_M:
        raise ValueError(f"small_m_gemm takes at most {MAX_M} rows, got {m}")
    assert weight.stride(-1) == 1 and weight.shape[1] == k
    assert not (silu_mul and norm is not None), "one fused input at a time"
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    add = norm is not None and norm.residual is not None
    res2 = _rows(norm.residual) if add else x2
    res_out = torch.empty(m, k, dtype=x.dtype, device=x.device) if add else x2
    if add:
        assert norm.residual.shape == x.shape and norm.residual.dtype == x.dtype
    if norm is not None:
        assert norm.weight.shape == (k,) and norm.weight.is_contiguous()
    new_residual = res_out.view(x.shape) if add else x
    if m == 0:
        return out.reshape(*x.shape[:-1], n), new_residual
    per_split = k_per_split(k, cfg)
    splits = cdiv(k, per_split)
    even_k = k % cfg.block_k == 0 and per_split * splits == k
    # Split-K workspaces: fp32 partial outputs, and (norm) each split's part of the rows' sum
    # of squares; allocated per call, like the output (graph capture keeps them in its pool).
    partial = torch.empty(splits, m, n, dtype=torch.float32, device=x.device) if splits > 1 else out
    sq = (torch.empty(splits, m, dtype=torch.float32, device=x.device)
          if splits > 1 and norm is not None else partial)
    block_m = 1 if m == 1 else (next_power_of_2(m) if cfg.per_lane else 16)
    eps = norm.eps if norm is not None else 0.0
    _small_m_gemm_kernel[(cdiv(n, cfg.block_n), splits)](
        x2, weight, scale if scale is not None else weight, bias if bias is not None else weight,
        out, partial, res2, norm.weight if norm is not None else weight, res_out, sq,
        m, n, k, per_split, x2.stride(0), weight.stride(0), out.stride(0),
        partial.stride(0) if splits > 1 else 0, res2.stride(0), eps,
        BLOCK_M=block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, SPLIT=splits > 1,
        HAS_SCALE=scale is not None, HAS_BIAS=bias is not None, EVEN_K=even_k,
        EVEN_N=n % cfg.block_n == 0, SILU_MUL=silu_mul, NORM=norm is not None, HAS_RESIDUAL=add,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",  # fp32 tests: exact
        PER_LANE=cfg.per_lane, num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl_options(x.device),
    )
    if splits > 1:
        block = 1024
        _split_reduce_kernel[(m, cdiv(n, block))](
            partial, sq, bias if bias is not None else partial, out, m, n, k, partial.stride(0),
            out.stride(0), splits, eps, HAS_BIAS=bias is not None, NORM=norm is not None,
            BLOCK=block, num_warps=4, **pdl_options(x.device))
    return out.reshape(*x.shape[:-1], n), new_residual
