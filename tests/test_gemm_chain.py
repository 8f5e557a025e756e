"""The startup tuner's chain step (`gemm_tuner.tune_chain`): a decoder layer's projections run
as a dependent chain, and the plan set per M bucket chosen on it.

On the CPU: the chain computes what the layer's projections compute, the candidate plan sets
are what they say, and the fastest set (timing faked) reaches every layer of the shape and only
those. On CUDA: the real timing, and the tuned model's forward still matches the untuned one.
"""
import pytest
import torch

from kernel_setup import HAS_CUDA  # first: it sets up Triton's interpreter

pytest.importorskip("triton")

from tandem.config import ModelConfig  # noqa: E402
from tandem.kernels import gemm_tuner  # noqa: E402
from tandem.kernels.small_m_gemm import GemmConfig  # noqa: E402
from tandem.models.decoder import DecoderModel  # noqa: E402
from tandem.models.layers import rms_norm_torch, silu_mul_torch  # noqa: E402

HF = dict(architectures=["LlamaForCausalLM"], vocab_size=128, hidden_size=64, intermediate_size=96,
          num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
          rms_norm_eps=1e-6, tie_word_embeddings=True)
A, B, C = GemmConfig(16, 64, 1), GemmConfig(8, 64, 2), GemmConfig(4, 64, 1, per_lane=True)


def _model(device: str = "cpu", dtype: torch.dtype = torch.float32, **overrides) -> DecoderModel:
    torch.manual_seed(0)
    model = DecoderModel(ModelConfig.from_hf({**HF, **overrides}), 64)
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.1)
    return model.to(device, dtype)


def test_the_chain_is_the_layers_projections_in_order():
    layer = _model().layers[0]
    x, residual = torch.randn(3, 64), torch.randn(3, 64)
    out, new_residual = layer.projection_chain(x, residual)
    attn, mlp = layer.self_attn, layer.mlp
    h = x + residual
    qkv = rms_norm_torch(h, layer.input_layernorm.weight, 1e-6) @ attn.qkv_proj.weight.t()
    o = qkv[:, :attn.q_size] @ attn.o_proj.weight.t()
    h2 = o + h
    gate_up = rms_norm_torch(h2, layer.post_attention_layernorm.weight, 1e-6) @ mlp.gate_up_proj.weight.t()
    expected = silu_mul_torch(gate_up) @ mlp.down_proj.weight.t()
    torch.testing.assert_close(new_residual, h2)
    torch.testing.assert_close(out, expected)


def test_chain_variants_as_tuned_fused_and_cublas():
    layer = _model().layers[0]
    qkv, o, gate_up, down = gemm_tuner._chain_linears(layer)
    qkv.plan[8], o.plan[8], gate_up.plan[8], down.plan[8] = A, A, B, A
    gate_up.norm_plan[8] = C  # the tuner kept this fusion, not qkv's nor down's
    key = lambda lin, kind: (*lin.weight.shape, lin.weight.dtype, 8, kind)  # noqa: E731
    offers = {key(qkv, "norm"): B, key(gate_up, "norm"): C, key(down, "silu_mul"): C}
    variants = gemm_tuner.chain_variants(layer, 8, offers)
    assert variants["tuned"] == [(A, None, None), (A, None, None), (B, None, C), (A, None, None)]
    assert variants["fused"] == [(A, None, B), (A, None, None), (B, None, C), (A, C, None)]
    assert variants["cublas"] == [(None, None, None)] * 4
    # Where nothing was offered, "fused" is "tuned": one candidate, not two.
    assert list(gemm_tuner.chain_variants(layer, 8, {})) == ["tuned", "cublas"]


def test_the_fastest_chain_reaches_every_layer_of_its_shape(monkeypatch):
    model = _model()
    for layer in model.layers:
        for lin in gemm_tuner._chain_linears(layer):
            lin.plan.update({1: A, 8: A})
    qkv = gemm_tuner._chain_linears(model.layers[0])[0]
    offers = {(*qkv.weight.shape, qkv.weight.dtype, m, "norm"): C for m in (1, 8)}
    # Fake device times: fused wins at M = 8, the per-shape plans at M = 1.
    timed = []

    def fake_time(copies, x):
        plans = gemm_tuner._plans(copies[0], x.shape[0])
        assert all(gemm_tuner._plans(c, x.shape[0]) == plans for c in copies)  # every copy runs the set
        timed.append(x.shape[0])
        fused = plans[0][2] is not None
        return (0.5 if fused else 1.0) if x.shape[0] == 8 else (2.0 if fused else 1.0)

    monkeypatch.setattr(gemm_tuner, "_chain_time_ms", fake_time)
    groups = gemm_tuner._decoder_layers_by_shape(model)
    assert [len(layers) for layers in groups.values()] == [3]
    kept = gemm_tuner.tune_chain(next(iter(groups.values())), torch.float32, [1, 8], offers)
    assert kept == {1: "tuned", 8: "fused"} and sorted(timed) == [1, 1, 1, 8, 8, 8]
    for layer in model.layers:
        first = gemm_tuner._chain_linears(layer)[0]
        assert first.norm_plan == {8: C} and first.plan == {1: A, 8: A}


def test_tensor_parallel_layers_are_left_out():
    model = _model()
    model.layers[1].self_attn.o_proj.reduce = lambda t: t  # stands in for an all-reduce
    groups = gemm_tuner._decoder_layers_by_shape(model)
    assert [[id(x) for x in layers] for layers in groups.values()] == [[id(model.layers[0]), id(model.layers[2])]]


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_the_tuned_chain_keeps_the_models_numbers_on_cuda():
    """tune_model with the chain step: every layer of the shape gets the same plans per bucket,
    and the projections' outputs stay those of the untuned (cuBLAS) model."""
    model = _model("cuda", torch.bfloat16, hidden_size=256, intermediate_size=512, num_attention_heads=4)
    x = torch.randn(5, 256, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        before = model.layers[0].projection_chain(x, x)[0].float()
        gemm_tuner.tune_model(model, torch.bfloat16, max_m=8)
        after = model.layers[0].projection_chain(x, x)[0].float()
    for m in (1, 2, 4, 8):
        plans = [gemm_tuner._plans(layer, m) for layer in model.layers]
        assert all(p == plans[0] for p in plans)
    assert (after - before).abs().max().item() <= 3e-2 * max(before.abs().max().item(), 1.0)
