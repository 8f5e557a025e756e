"""silu(gate) * up from the packed gate_up projection, in one launch.

Numerics follow `GatedMLP.down` in torch: silu is evaluated in float32 and rounded
to the input dtype, the product is rounded again.
"""
import torch
import triton
import triton.language as tl

from tandem.kernels.grid import cdiv, next_power_of_2
from tandem.kernels.pdl import pdl_options, pdl_prologue


@triton.jit
def _silu_mul_kernel(X, Out, stride_x, stride_o, I, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    pdl_prologue(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < I
    gate = tl.load(X + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(X + row * stride_x + I + offs, mask=mask, other=0.0).to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(X.dtype.element_ty).to(tl.float32)
    tl.store(Out + row * stride_o + offs, (act * up).to(Out.dtype.element_ty), mask=mask)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [T, 2I] (gate first, then up) -> silu(gate) * up [T, I]."""
    num_tokens, two_i = gate_up.shape
    assert two_i % 2 == 0 and gate_up.stride(1) == 1
    inter = two_i // 2
    out = torch.empty(num_tokens, inter, dtype=gate_up.dtype, device=gate_up.device)
    if num_tokens:
        block = min(1024, next_power_of_2(inter))
        _silu_mul_kernel[(num_tokens, cdiv(inter, block))](
            gate_up, out, gate_up.stride(0), out.stride(0), inter, BLOCK=block,
            num_warps=4, **pdl_options(gate_up.device),
        )
    return out
