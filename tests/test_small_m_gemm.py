"""The small-M weight-streaming GEMM and the `linear()` dispatch vs torch.matmul.

Without CUDA the kernel runs in Triton's interpreter (float32/float16 only: the
interpreter's bfloat16 `tl.dot` is wrong); with CUDA compiled, bfloat16 included.
"""
import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:  # must precede the first kernel definition
    os.environ.setdefault("TRITON_INTERPRET", "1")
triton = pytest.importorskip("triton")

from tandem.kernels.small_m_gemm import GemmConfig, small_m_gemm  # noqa: E402
from tandem.models.linear import Linear, linear, m_bucket, quantize_fp8  # noqa: E402

DEVICE = "cuda" if HAS_CUDA else "cpu"
_gpu_only = [pytest.mark.gpu] if HAS_CUDA else [pytest.mark.skip(reason="bfloat16 needs CUDA")]
DTYPES = [
    pytest.param(torch.float32, id="fp32", marks=[pytest.mark.gpu] if HAS_CUDA else []),
    pytest.param(torch.float16, id="fp16", marks=[pytest.mark.gpu] if HAS_CUDA else []),
    pytest.param(torch.bfloat16, id="bf16", marks=_gpu_only),
]
TOL = {torch.float32: 1e-4, torch.float16: 3e-3, torch.bfloat16: 2e-2}
# (block_n, block_k, split_k): one split; splits with a ragged last one; N not a block multiple.
CONFIGS = [GemmConfig(16, 64, 1), GemmConfig(32, 32, 3), GemmConfig(16, 128, 2)]


def _inputs(m: int, n: int, k: int, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(dtype).to(DEVICE)
    w = (torch.randn(n, k, generator=g) / k ** 0.5).to(dtype).to(DEVICE)
    b = torch.randn(n, generator=g).to(dtype).to(DEVICE)
    return x, w, b


def _close(out: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    err = (out.float() - expected.float()).abs().max().item()
    scale = expected.float().abs().max().item()
    assert err <= TOL[dtype] * max(scale, 1.0), f"max error {err} (scale {scale})"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", [1, 3, 16])
@pytest.mark.parametrize("cfg", CONFIGS, ids=str)
def test_small_m_gemm_matches_matmul(dtype, m, cfg):
    x, w, b = _inputs(m, 72, 200, dtype)
    expected = torch.matmul(x.float(), w.float().t()) + b.float()
    out = small_m_gemm(x, w, b, None, cfg)
    assert out.dtype == dtype and out.shape == (m, 72)
    _close(out, expected, dtype)


@pytest.mark.parametrize("m", [1, 5])
def test_small_m_gemm_fp8_weights(m):
    """FP8 weight with its per-channel scale: the same result as the dequantized weight."""
    x, w, _ = _inputs(m, 48, 128, torch.float16, seed=1)
    q, scale = quantize_fp8(w)
    expected = torch.matmul(x.float(), (q.float() * scale[:, None]).t())
    out = small_m_gemm(x, q, None, scale, GemmConfig(16, 64, 2))
    _close(out, expected, torch.float16)


def test_small_m_gemm_leading_dims_and_rejects_large_m():
    x, w, _ = _inputs(4, 40, 64, torch.float16, seed=2)
    out = small_m_gemm(x.view(2, 2, 64), w, None, None, CONFIGS[0])
    assert out.shape == (2, 2, 40)
    _close(out.view(4, 40), x.float() @ w.float().t(), torch.float16)
    with pytest.raises(ValueError, match="at most 16 rows"):
        small_m_gemm(torch.zeros(17, 64, dtype=torch.float16, device=DEVICE), w, None, None, CONFIGS[0])


def test_m_buckets_follow_graph_sizes():
    assert [m_bucket(m) for m in (1, 2, 3, 4, 5, 8, 9, 16)] == [1, 2, 4, 4, 8, 8, 16, 16]


def test_linear_cpu_is_torch_and_fp8_dequantizes():
    """On the CPU `linear` is F.linear; an FP8 layer computes with its dequantized weight."""
    torch.manual_seed(0)
    layer = Linear(64, 32, bias=True)
    with torch.no_grad():
        layer.weight.normal_(0, 0.1)
        layer.bias.normal_()
    x = torch.randn(5, 64)
    torch.testing.assert_close(layer(x), torch.nn.functional.linear(x, layer.weight, layer.bias))
    ref = layer(x)
    layer.quantize_fp8_()
    assert layer.weight.dtype == torch.float8_e4m3fn and layer.weight_scale.shape == (32,)
    out = layer(x)
    deq = layer.weight.float() * layer.weight_scale[:, None]
    torch.testing.assert_close(out, x @ deq.t() + layer.bias)
    # e4m3 keeps 3 mantissa bits: ~6% relative error per weight, far less after the sum
    assert (out - ref).abs().max() < 0.05 * ref.abs().max()


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_linear_dispatch_uses_plan_and_cublas_on_gpu():
    x, w, b = _inputs(3, 256, 512, torch.bfloat16)
    expected = torch.nn.functional.linear(x, w, b)
    out = linear(x, w, b, plan={4: GemmConfig(32, 128, 2)})
    _close(out, expected.float(), torch.bfloat16)
    # No plan entry for 32 rows: cuBLAS
    x32 = torch.randn(32, 512, device=DEVICE, dtype=torch.bfloat16)
    torch.testing.assert_close(linear(x32, w, b, plan={4: GemmConfig(32, 128, 2)}),
                               torch.nn.functional.linear(x32, w, b))
