"""RMSNorm, and residual add + RMSNorm, in one launch each.

Numerics follow `tandem.models.layers.RMSNorm` (which mirrors transformers): the
residual sum is rounded to the input dtype (it is the new residual), the row is
normalised in float32, rounded to the input dtype, then multiplied by the weight and
rounded again. One program per row; the whole row sits in registers (hidden sizes up
to a few thousand), so each element is read once and written once.

The `_fp8` variants write the normalised row as FP8 (e4m3) with its per-row scale instead,
the input an FP8 layer's cuBLAS GEMM takes (`linear.fp8_scaled_mm`): the same values as the
norm followed by `quantize_rows_fp8` (the row rounded to the input dtype first), one launch and
one activation round trip fewer (issue 21: FP8 lost to bf16 above the small-M kernels).
"""
import torch
import triton
import triton.language as tl

from tandem.kernels.fp8_quant import quantize_store_row
from tandem.kernels.grid import next_power_of_2
from tandem.kernels.pdl import pdl_options, pdl_prologue


@triton.jit
def _rms_norm_kernel(
    X, Res, Out, ResOut, W, Scale,
    stride_x, stride_r, stride_o, stride_ro,
    N, eps,
    HAS_RESIDUAL: tl.constexpr, QUANT: tl.constexpr, BLOCK_N: tl.constexpr, USE_PDL: tl.constexpr,
    FP8_MAX: tl.constexpr = 448.0,
):
    pdl_prologue(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_N)
    mask = offs < N
    x = tl.load(X + row * stride_x + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(Res + row * stride_r + offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(X.dtype.element_ty)
        tl.store(ResOut + row * stride_ro + offs, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / N + eps)
    w = tl.load(W + offs, mask=mask, other=0.0).to(tl.float32)
    y = (xf * rstd).to(X.dtype.element_ty).to(tl.float32) * w
    if QUANT:  # as quantize_rows_fp8 of the row rounded to the input dtype
        quantize_store_row(y.to(X.dtype.element_ty).to(tl.float32), Out, Scale, row, offs, mask, stride_o,
                           FP8_MAX)
    else:
        tl.store(Out + row * stride_o + offs, y.to(Out.dtype.element_ty), mask=mask)


def _launch(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
            fp8: bool = False):
    n = x.shape[-1]
    assert weight.shape == (n,) and weight.is_contiguous()
    # The decoder's rows are 2-D already: no reshape, no view back (host time, issue 21).
    flat = x.dim() == 2
    x2 = x if flat else x.reshape(-1, n)
    assert x2.stride(-1) == 1
    assert flat or not fp8, "the FP8 output is for the decoder's 2-D rows"
    out = (torch.empty(x2.shape, dtype=torch.float8_e4m3fn, device=x.device) if fp8 else
           torch.empty_like(x2, memory_format=torch.contiguous_format))
    scale = torch.empty(x2.shape[0], 1, dtype=torch.float32, device=x.device) if fp8 else None
    if residual is not None:
        assert residual.shape == x.shape and residual.dtype == x.dtype
        r2 = residual if flat else residual.reshape(-1, n)
        assert r2.stride(-1) == 1
        res_out = torch.empty_like(x2, memory_format=torch.contiguous_format)
    else:
        r2 = res_out = x2  # unused
    rows = x2.shape[0]
    if rows:
        block = next_power_of_2(n)
        _rms_norm_kernel[(rows,)](
            x2, r2, out, res_out, weight, scale if fp8 else out,  # Scale: unread without QUANT
            x2.stride(0), r2.stride(0), out.stride(0), res_out.stride(0),
            n, eps,
            HAS_RESIDUAL=residual is not None, QUANT=fp8, BLOCK_N=block,
            num_warps=max(1, min(8, block // 256)), **pdl_options(x.device),
        )
    if fp8:
        return out, scale, res_out
    return (out, res_out) if flat else (out.view(x.shape), res_out.view(x.shape))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., N] normalised over its last dim and scaled by weight [N]; output in x's dtype."""
    return _launch(x, None, weight, eps)[0]


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual) in one launch; both new tensors."""
    return _launch(x, residual, weight, eps)


def add_rms_norm_fp8(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x, residual [T, N] -> (e4m3 [T, N], fp32 scale [T, 1], x + residual) with the first two
    `quantize_rows_fp8(rms_norm(x + residual))`, in one launch. Without a residual: of
    rms_norm(x), and x itself third."""
    q, scale, res = _launch(x, residual, weight, eps, fp8=True)
    return q, scale, (x if residual is None else res)
