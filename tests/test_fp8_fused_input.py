"""FP8 layers above the small-M kernels take their input rows quantized by the kernel in front
(`Experiments.fp8_fused_input`): the RMSNorm (with the residual add) or the SiLU-mul writes the
e4m3 rows and their scales. They must equal the two launches they replace, value for value.

Without CUDA the kernels run in Triton's interpreter (float32/float16); its fp32 -> e4m3 cast
is wrong in places (`test_small_m_gemm.test_quantize_rows_fp8_matches_torch`), but both sides
take the same cast, so equality still holds; the layer-level equality needs cuBLAS's FP8 GEMM.
"""
import pytest
import torch

from kernel_setup import DEVICE, DTYPES, HAS_CUDA  # first: it sets up Triton's interpreter

triton = pytest.importorskip("triton")

from tandem.kernels.activation import silu_mul  # noqa: E402
from tandem.kernels.fp8_quant import quantize_rows_fp8, silu_mul_quantize_rows_fp8  # noqa: E402
from tandem.kernels.norm import add_rms_norm_fp8, fused_add_rms_norm, rms_norm  # noqa: E402
from tandem.models.linear import Linear, fp8_linear_cublas  # noqa: E402


def _rows(m: int, k: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (3 * torch.randn(m, k, generator=g)).to(dtype).to(DEVICE)


def _same(a: tuple[torch.Tensor, torch.Tensor], b: tuple[torch.Tensor, torch.Tensor]) -> None:
    (qa, sa), (qb, sb) = a, b
    assert qa.dtype == qb.dtype == torch.float8_e4m3fn and qa.shape == qb.shape
    assert torch.equal(sa, sb)
    assert torch.equal(qa.float(), qb.float())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("m,k", [(5, 96), (3, 300)])  # a whole tile; a ragged row
def test_norm_writes_the_quantized_rows_of_norm_then_quantize(dtype, residual, m, k):
    x, res = _rows(m, k, dtype, 1), _rows(m, k, dtype, 2)
    x[1] = 0  # a row that normalises to zeros: scale from the 1e-12 floor, no division by zero
    weight = (1 + 0.1 * torch.randn(k, generator=torch.Generator().manual_seed(3))).to(dtype).to(DEVICE)
    q, scale, new_res = add_rms_norm_fp8(x, res if residual else None, weight, 1e-6)
    if residual:
        normed, expected_res = fused_add_rms_norm(x, res, weight, 1e-6)
        assert torch.equal(new_res, expected_res)
    else:
        normed = rms_norm(x, weight, 1e-6)
        assert new_res is x
    _same((q, scale), quantize_rows_fp8(normed))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,inter", [(4, 128), (2, 200)])
def test_silu_mul_writes_the_quantized_rows_of_silu_mul_then_quantize(dtype, m, inter):
    gate_up = _rows(m, 2 * inter, dtype, 4)
    _same(silu_mul_quantize_rows_fp8(gate_up), quantize_rows_fp8(silu_mul(gate_up)))


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="cuBLAS's FP8 GEMM needs CUDA")
def test_fp8_layers_give_the_same_output_with_the_fused_input():
    """A normed layer (qkv, gate/up) and a gated one (down) at 40 rows, fused input on and off:
    the same GEMM on the same FP8 rows, so the same output bit for bit."""
    torch.manual_seed(0)
    x, res = torch.randn(40, 256, device="cuda").bfloat16(), torch.randn(40, 256, device="cuda").bfloat16()
    norm_w = (1 + 0.1 * torch.randn(256, device="cuda")).bfloat16()
    normed = Linear(256, 384, bias=True, normed=True).cuda().bfloat16()
    gated = Linear(192, 256, gated=True).cuda().bfloat16()
    for layer in (normed, gated):
        with torch.no_grad():  # Linear allocates its weight uninitialised (the loader fills it)
            layer.weight.normal_(0, 0.05)
            if layer.bias is not None:
                layer.bias.normal_(0, 0.1)
        layer.quantize_fp8_(fused_input=True)
    out, new_res = normed.add_norm_forward(x, res, norm_w, 1e-6)
    ref_normed, ref_res = fused_add_rms_norm(x, res, norm_w, 1e-6)
    assert torch.equal(new_res, ref_res)
    assert torch.equal(out, fp8_linear_cublas(ref_normed, normed.weight, normed.bias, normed.weight_scale))
    gate_up = torch.randn(40, 384, device="cuda").bfloat16()
    assert torch.equal(gated.silu_mul_forward(gate_up),
                       fp8_linear_cublas(silu_mul(gate_up), gated.weight, None, gated.weight_scale))
    normed.fp8_fused_input = gated.fp8_fused_input = False  # off: the caller runs the two launches
    assert normed.add_norm_forward(x, res, norm_w, 1e-6) is None and gated.silu_mul_forward(gate_up) is None
