"""Programmatic dependent launch (tandem.kernels.pdl): off on the CPU and under its debug switch;
on the GPU (compute capability 9.0+) a long chain of dependent PDL kernels replayed from one
CUDA graph gives the bits of the same kernels launched the plain way (a kernel that ran ahead
of its producer would read a stale buffer). The PTX ordering (wait before the first global access) is checked for
every PDL kernel by tests/kernel_compile.py."""
import pytest
import torch

from kernel_setup import HAS_CUDA  # first: it sets up Triton's interpreter

from tandem.kernels import pdl  # noqa: E402
from tandem.kernels.pdl import PDL_ENV, pdl_options, uses_pdl  # noqa: E402


def test_the_cpu_never_launches_with_pdl():
    assert pdl_options(torch.device("cpu")) == {"USE_PDL": False}
    assert not uses_pdl(torch.device("cpu"))


def test_the_debug_switch_is_read_from_the_environment(monkeypatch):
    pdl._enabled.cache_clear()
    try:
        monkeypatch.setenv(PDL_ENV, "1")
        assert pdl._enabled()
        pdl._enabled.cache_clear()
        monkeypatch.setenv(PDL_ENV, "0")
        assert not pdl._enabled()
        pdl._enabled.cache_clear()
        monkeypatch.delenv(PDL_ENV)
        assert pdl._enabled()  # on by default (measured on the H200 in session 13)
    finally:
        pdl._enabled.cache_clear()


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA or torch.cuda.get_device_capability()[0] < 9, reason="needs compute capability 9.0+")
def test_a_graph_of_dependent_pdl_kernels_matches_plain_launches(monkeypatch):
    from tandem.kernels.activation import silu_mul
    from tandem.kernels.norm import fused_add_rms_norm
    from tandem.kernels.small_m_gemm import GemmConfig, NormInput, small_m_gemm, small_m_gemm_add_norm
    torch.manual_seed(0)
    hidden, inter, layers = 256, 512, 24
    dt = torch.bfloat16
    up = [torch.randn(2 * inter, hidden, device="cuda", dtype=dt) * 0.05 for _ in range(layers)]
    down = [torch.randn(hidden, inter, device="cuda", dtype=dt) * 0.05 for _ in range(layers)]
    g = torch.ones(hidden, device="cuda", dtype=dt)
    x0 = torch.randn(1, hidden, device="cuda", dtype=dt)
    cfg = GemmConfig(8, 256, 1)

    def chain(x):
        residual = torch.zeros_like(x)
        for i in range(layers):  # norm-in-GEMM, SiLU-mul, GEMM, add + norm: each reads the last
            gate_up, residual = small_m_gemm_add_norm(x, NormInput(g, 1e-6, residual), up[i], None, None, cfg)
            x = small_m_gemm(silu_mul(gate_up), down[i], None, None, cfg)
            x, residual = fused_add_rms_norm(x, residual, g, 1e-6)
        return x

    inputs = [torch.randn_like(x0) for _ in range(3)]
    monkeypatch.setenv(PDL_ENV, "0")
    pdl._enabled.cache_clear()
    expected = [chain(x.clone()) for x in inputs]  # plain launches: the expected bits
    monkeypatch.setenv(PDL_ENV, "1")
    pdl._enabled.cache_clear()
    try:
        assert uses_pdl(torch.device("cuda"))
        static_in = x0.clone()
        chain(static_in)  # compile the PDL variants outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_out = chain(static_in)
        for x, want in zip(inputs, expected):
            static_in.copy_(x)
            graph.replay()
            assert torch.equal(static_out, want)
    finally:
        monkeypatch.delenv(PDL_ENV)
        pdl._enabled.cache_clear()
