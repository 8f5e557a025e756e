"""Per-row dynamic FP8 (e4m3) quantization of activations, one launch: the input side of
cuBLAS's row-wise scaled FP8 GEMM (`torch._scaled_mm`) for FP8 layers above small M.

One program per row loads the whole row once (K <= 16k), takes its absolute max, and
writes the e4m3 row and its fp32 scale (amax / 448): the torch version is ~7 launches.
"""
import torch
import triton
import triton.language as tl

from tandem.kernels.grid import next_power_of_2

FP8_MAX = 448.0


@triton.jit
def _quantize_rows_kernel(X, Q, S, K, stride_x, stride_q, FP8_MAX: tl.constexpr,
                          BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < K
    x = tl.load(X + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    scale = tl.maximum(tl.max(tl.abs(x), 0), 1e-12) / FP8_MAX
    q = tl.minimum(tl.maximum(x / scale, -FP8_MAX), FP8_MAX)
    tl.store(Q + row * stride_q + offs, q.to(Q.dtype.element_ty), mask=mask)
    tl.store(S + row, scale)


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
