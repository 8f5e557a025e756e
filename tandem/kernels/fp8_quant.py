"""Per-row dynamic FP8 (e4m3) quantization of activations, one launch: the input side of
cuBLAS's row-wise scaled FP8 GEMM (`torch._scaled_mm`) for FP8 layers above small M. The
down projection's input also comes fused with the SiLU-mul before it
(`silu_mul_quantize_rows_fp8`); the norms' fused variant is `norm.add_rms_norm_fp8`.

One program per row loads the whole row once (K <= 16k), takes its absolute max, and
writes the e4m3 row and its fp32 scale (amax / 448): the torch version is ~7 launches.
"""
import torch
import triton
import triton.language as tl

from tandem.kernels.grid import next_power_of_2

FP8_MAX = 448.0


@triton.jit
def quantize_store_row(x, Q, S, row, offs, mask, stride_q, FP8_MAX: tl.constexpr):
    """Row `row` of float32 values `x` as e4m3 into Q and its scale (amax / FP8_MAX) into S:
    every kernel that writes an FP8 layer's input rows (so all of them give the same values)."""
    scale = tl.maximum(tl.max(tl.abs(x), 0), 1e-12) / FP8_MAX
    q = tl.minimum(tl.maximum(x / scale, -FP8_MAX), FP8_MAX)
    tl.store(Q + row * stride_q + offs, q.to(Q.dtype.element_ty), mask=mask)
    tl.store(S + row, scale)


@triton.jit
def _quantize_rows_kernel(X, Q, S, K, stride_x, stride_q, FP8_MAX: tl.constexpr,
                          BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < K
    x = tl.load(X + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    quantize_store_row(x, Q, S, row, offs, mask, stride_q, FP8_MAX)


def quantize_rows_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (e4m3 [M, K], fp32 scale [M, 1]) with x ~= q * scale per row."""
    m, k = x.shape
    assert x.stride(1) == 1
    q = torch.empty(m, k, dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty(m, 1, dtype=torch.float32, device=x.device)
    if m:
        block = next_power_of_2(k)
        _quantize_rows_kernel[(m,)](x, q, scale, k, x.stride(0), q.stride(0), FP8_MAX=FP8_MAX,
                                    BLOCK=block, num_warps=8 if block >= 4096 else 4)
    return q, scale


@triton.jit
def _silu_mul_quantize_rows_kernel(X, Q, S, I, stride_x, stride_q, FP8_MAX: tl.constexpr,
                                   BLOCK: tl.constexpr):
    # silu(gate) * up as `silu_mul` rounds it (silu in float32 to the input dtype, the product
    # again), then as `_quantize_rows_kernel`: the same e4m3 row and scale as the two launches.
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < I
    gate = tl.load(X + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(X + row * stride_x + I + offs, mask=mask, other=0.0).to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(X.dtype.element_ty).to(tl.float32)
    quantize_store_row((act * up).to(X.dtype.element_ty).to(tl.float32), Q, S, row, offs, mask, stride_q,
                       FP8_MAX)


def silu_mul_quantize_rows_fp8(gate_up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """gate_up [M, 2I] (gate, then up) -> `quantize_rows_fp8(silu_mul(gate_up))` in one launch:
    the input of an FP8 down projection above the small-M kernels (issue 21)."""
    m, two_i = gate_up.shape
    assert two_i % 2 == 0 and gate_up.stride(1) == 1
    inter = two_i // 2
    q = torch.empty(m, inter, dtype=torch.float8_e4m3fn, device=gate_up.device)
    scale = torch.empty(m, 1, dtype=torch.float32, device=gate_up.device)
    if m:
        block = next_power_of_2(inter)
        _silu_mul_quantize_rows_kernel[(m,)](gate_up, q, scale, inter, gate_up.stride(0), q.stride(0),
                                             FP8_MAX=FP8_MAX, BLOCK=block, num_warps=8 if block >= 4096 else 4)
    return q, scale
