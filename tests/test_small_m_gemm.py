"""The small-M weight-streaming GEMM and the `linear()` dispatch vs torch.matmul.

Without CUDA the kernel runs in Triton's interpreter (float32/float16 only: the
interpreter's bfloat16 `tl.dot` is wrong); with CUDA compiled, bfloat16 included.
"""
import pytest
import torch

from kernel_setup import DEVICE, DTYPES, HAS_CUDA  # first: it sets up Triton's interpreter

triton = pytest.importorskip("triton")

from tandem.kernels.small_m_gemm import GemmConfig, NormInput, small_m_gemm, small_m_gemm_add_norm  # noqa: E402
from tandem.models.linear import Linear, linear, m_bucket, quantize_fp8  # noqa: E402

TOL = {torch.float32: 1e-4, torch.float16: 3e-3, torch.bfloat16: 2e-2}
# (block_n, block_k, split_k): one split; splits with a ragged last one; N not a block multiple.
CONFIGS = [GemmConfig(16, 64, 1), GemmConfig(32, 32, 3), GemmConfig(16, 128, 2)]
# Per-lane accumulation for a few rows (no tl.dot): one split, ragged splits.
LANE_CONFIGS = [GemmConfig(4, 64, 1, per_lane=True), GemmConfig(8, 32, 3, per_lane=True)]


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
@pytest.mark.parametrize("n,k", [(72, 200), (64, 256)])  # ragged; N and K whole tiles
def test_small_m_gemm_matches_matmul(dtype, m, cfg, n, k):
    x, w, b = _inputs(m, n, k, dtype)
    expected = torch.matmul(x.float(), w.float().t()) + b.float()
    out = small_m_gemm(x, w, b, None, cfg)
    assert out.dtype == dtype and out.shape == (m, n)
    _close(out, expected, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", [2, 5, 8])
@pytest.mark.parametrize("cfg", LANE_CONFIGS, ids=str)
@pytest.mark.parametrize("silu_mul", [False, True])
def test_small_m_gemm_per_lane_matches_matmul(dtype, m, cfg, silu_mul):
    """A verify step's few rows: each weight tile loaded once, products summed per lane."""
    x, w, b = _inputs(m, 72, 200, dtype, seed=3)
    if silu_mul:
        gate_up = torch.cat([x, _inputs(m, 72, 200, dtype, seed=4)[0]], dim=1)
        g, u = gate_up.float().chunk(2, dim=1)
        act = (torch.nn.functional.silu(g).to(dtype).float() * u).to(dtype).float()
        expected = act @ w.float().t() + b.float()
        out = small_m_gemm(gate_up, w, b, None, cfg, silu_mul=True)
    else:
        expected = torch.matmul(x.float(), w.float().t()) + b.float()
        out = small_m_gemm(x, w, b, None, cfg)
    assert out.shape == (m, 72)
    _close(out, expected, dtype)


def test_tuner_offers_per_lane_tiles_for_a_few_rows():
    from tandem.kernels.gemm_tuner import candidates
    for m in (2, 4, 8, 16):
        lanes = [c for c in candidates(960, 576, m, 132) if c.per_lane]
        assert lanes and all(m * c.block_n * c.block_k <= 8192 for c in lanes)
        assert any(not c.per_lane for c in candidates(960, 576, m, 132))  # and the tl.dot tiles
    assert not any(c.per_lane for c in candidates(960, 576, 1, 132))


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


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", [1, 4])
def test_small_m_gemm_fused_silu_mul_input(dtype, m):
    """down(silu(gate) * up) from the packed gate_up rows equals the two-step torch path."""
    from tandem.models.layers import silu_mul_torch
    gate_up, w, _ = _inputs(m, 40, 2 * 96, dtype, seed=3)
    w = w[:, :96].contiguous()
    expected = torch.matmul(silu_mul_torch(gate_up).float(), w.float().t())
    out = small_m_gemm(gate_up, w, None, None, GemmConfig(16, 32, 2), silu_mul=True)
    assert out.shape == (m, 40)
    _close(out, expected, dtype)


def test_quantize_rows_fp8_matches_torch():
    """The activation side of the FP8 cuBLAS path: per-row amax scale, e4m3 values."""
    from tandem.kernels.fp8_quant import FP8_MAX, quantize_rows_fp8
    x, _, _ = _inputs(5, 8, 300, torch.float16, seed=4)
    x[2] = 0  # an all-zero row must not divide by zero
    q, scale = quantize_rows_fp8(x)
    ref_scale = x.float().abs().amax(1, keepdim=True).clamp(min=1e-12) / FP8_MAX
    torch.testing.assert_close(scale, ref_scale)
    if not HAS_CUDA:
        return  # the interpreter's fp32 -> e4m3 cast is wrong where rounding carries into
        # the exponent (seen: 124.3 -> 64); the hardware cast is checked on the GPU
    ref_q = (x.float() / ref_scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    # Same value, or one e4m3 step away where the division rounded differently.
    assert (q.float() == ref_q.float()).float().mean() > 0.99
    torch.testing.assert_close(q.float(), ref_q.float(), rtol=0.13, atol=1e-6)


def test_small_m_gemm_option_is_validated(tmp_path):
    from tandem import LLM
    from tiny_models import make_tiny_model
    path = str(make_tiny_model(tmp_path, "llama"))
    with pytest.raises(ValueError, match="small_m_gemm must be"):
        LLM(path, device="cpu", small_m_gemm="fast")
    with pytest.raises(ValueError, match="needs a CUDA device"):
        LLM(path, device="cpu", small_m_gemm="on")


def test_linear_reduce_hook_applies_to_the_output():
    """A row-parallel layer passes its all-reduce; here a doubling stands in for it."""
    layer = Linear(8, 4, reduce=lambda y: 2 * y)
    with torch.no_grad():
        layer.weight.normal_()
    x = torch.randn(3, 8)
    torch.testing.assert_close(layer(x), 2 * torch.nn.functional.linear(x, layer.weight))


def test_the_mlp_down_projection_is_gated_and_only_it():
    from tandem.models.layers import GatedMLP
    mlp = GatedMLP(16, 24)
    assert mlp.down_proj.gated and not mlp.gate_up_proj.gated


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_the_fused_silu_mul_input_runs_only_from_its_own_plan():
    """A gated layer's unfused plan does not stand for its fused input (at 8 and 16 rows that
    kernel was 4-6x slower than the two launches): without a silu_plan entry the caller runs
    SiLU-mul, then the layer; with one, the fused kernel, same result."""
    from tandem.models.layers import GatedMLP, silu_mul_torch
    mlp = GatedMLP(64, 96).to(DEVICE, torch.bfloat16)
    for p in mlp.parameters():
        torch.nn.init.normal_(p, std=0.05)
    x = torch.randn(8, 64, device=DEVICE, dtype=torch.bfloat16)
    expected = mlp.down_proj.weight.float() @ silu_mul_torch(mlp.gate_up_proj(x)).float().t()
    mlp.down_proj.plan = {8: GemmConfig(16, 32, 1)}
    assert mlp.down_proj.silu_mul_forward(mlp.gate_up_proj(x)) is None
    _close(mlp(x), expected.t(), torch.bfloat16)
    mlp.down_proj.silu_plan = {8: GemmConfig(16, 32, 1)}
    assert mlp.down_proj.silu_mul_forward(mlp.gate_up_proj(x)) is not None
    _close(mlp(x), expected.t(), torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_the_tuner_times_the_fused_input_against_the_two_launches():
    """tune_model fills a gated layer's silu_plan only with configs it timed faster than
    SiLU-mul + the layer's own plan, and tunes no other layer's fused input."""
    from tandem.kernels.gemm_tuner import tune_model
    from tandem.models.layers import GatedMLP
    mlp = GatedMLP(256, 512).to(DEVICE, torch.bfloat16)
    results = tune_model(mlp, torch.bfloat16, max_m=8)
    gated = {key: r for key, r in results.items() if key[4] == "silu_mul"}
    assert {key[:2] for key in gated} == {(256, 512)}  # down: N = hidden, K = intermediate
    for (n, k, _, m, _), (cfg, ms, base_ms) in gated.items():
        assert mlp.down_proj.silu_plan.get(m) == cfg
        assert cfg is None or ms < base_ms


# ---- residual add + RMSNorm in the prologue (issue 21) ----
EPS = 1e-6


def _norm_inputs(m: int, k: int, dtype: torch.dtype, residual: bool, seed: int = 5):
    """x, residual (or None) and a norm weight away from 1, so that both g and rstd matter."""
    g = torch.Generator().manual_seed(seed)
    x = (3 * torch.randn(m, k, generator=g)).to(dtype).to(DEVICE)
    res = (2 * torch.randn(m, k, generator=g)).to(dtype).to(DEVICE) if residual else None
    weight = (0.5 + torch.rand(k, generator=g)).to(dtype).to(DEVICE)
    return x, res, weight


def _norm_then_linear(x, res, norm_weight, w, b):
    """The unfused path in torch: the new residual, then rms_norm (rounded as the model does)
    and the projection in float32."""
    from tandem.models.layers import rms_norm_torch
    h = x if res is None else x + res
    normed = rms_norm_torch(h, norm_weight, EPS)
    out = normed.float() @ w.float().t()
    return (out if b is None else out + b.float()), h


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", [1, 3, 8, 16])
@pytest.mark.parametrize("cfg", CONFIGS + LANE_CONFIGS, ids=str)
@pytest.mark.parametrize("residual", [True, False], ids=["add", "no_residual"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no_bias"])
def test_small_m_gemm_add_norm_matches_norm_then_linear(dtype, m, cfg, residual, bias):
    """One launch (two with split-K) computes proj(rms_norm(x + residual)) and x + residual;
    the projection differs from the two-step path by rounding only (float32: none to speak of)."""
    x, res, norm_weight = _norm_inputs(m, 200, dtype, residual)
    _, w, b = _inputs(m, 72, 200, dtype, seed=6)
    b = b if bias else None
    expected, h = _norm_then_linear(x, res, norm_weight, w, b)
    out, new_residual = small_m_gemm_add_norm(x, NormInput(norm_weight, EPS, res), w, b, None, cfg)
    assert out.dtype == dtype and out.shape == (m, 72)
    _close(out, expected, dtype)
    assert torch.equal(new_residual, h)  # bit-exact: the residual stream must not drift
    if res is None:
        assert new_residual is x  # the first layer: its input is the residual, as unfused


@pytest.mark.parametrize("cfg", [GemmConfig(16, 64, 1), GemmConfig(8, 32, 1, per_lane=True)], ids=str)
def test_add_norm_applies_rstd_per_row(cfg):
    """Rows 100x apart in scale give the same normed projection (RMSNorm is scale-free): a
    kernel that drops rstd, or applies one row's to another, fails here."""
    x, res, norm_weight = _norm_inputs(4, 128, torch.float32, True, seed=7)
    scales = torch.tensor([10.0, 0.1, 1.0, 1000.0], device=DEVICE)[:, None]
    _, w, _ = _inputs(4, 40, 128, torch.float32, seed=8)
    out, _ = small_m_gemm_add_norm(x * scales, NormInput(norm_weight, EPS, res * scales), w, None, None, cfg)
    expected, _ = _norm_then_linear(x, res, norm_weight, w, None)
    _close(out, expected, torch.float32)


def test_add_norm_sums_the_squares_of_every_split():
    """With split-K each program sees part of the row: the reduce must sum all splits' squares.
    The row's energy sits in the last of four K ranges, so any one split's (or the first
    split's) sum alone gives a wrong rstd."""
    k = 256
    x, res, norm_weight = _norm_inputs(3, k, torch.float32, True, seed=9)
    x[:, 192:] *= 50
    _, w, b = _inputs(3, 72, k, torch.float32, seed=10)
    expected, _ = _norm_then_linear(x, res, norm_weight, w, b)
    for cfg in (GemmConfig(16, 64, 4), GemmConfig(8, 32, 4, per_lane=True), GemmConfig(32, 32, 3)):
        out, _ = small_m_gemm_add_norm(x, NormInput(norm_weight, EPS, res), w, b, None, cfg)
        _close(out, expected, torch.float32)


@pytest.mark.parametrize("cfg", [GemmConfig(16, 64, 2), GemmConfig(8, 32, 1, per_lane=True)], ids=str)
def test_add_norm_of_large_float16_activations_does_not_overflow(cfg):
    """Residual streams reach thousands; times a norm weight of 8 that is past float16's 65504,
    so the kernel must not round h * g to float16 (rstd only shrinks it at the end)."""
    x, res, _ = _norm_inputs(9, 128, torch.float32, True, seed=15)
    x, res = (3000 * x).half(), (3000 * res).half()
    norm_weight = torch.full((128,), 8.0, dtype=torch.float16, device=DEVICE)
    _, w, _ = _inputs(9, 40, 128, torch.float16, seed=16)
    out, _ = small_m_gemm_add_norm(x, NormInput(norm_weight, EPS, res), w, None, None, cfg)
    expected, _ = _norm_then_linear(x, res, norm_weight, w, None)
    assert torch.isfinite(out).all()
    _close(out, expected, torch.float16)


@pytest.mark.parametrize("m", [1, 5])
def test_small_m_gemm_add_norm_fp8_weights(m):
    """The FP8 scale and rstd both scale the accumulator: the result is the dequantized one's."""
    x, res, norm_weight = _norm_inputs(m, 128, torch.float16, True, seed=11)
    _, w, _ = _inputs(m, 48, 128, torch.float16, seed=12)
    q, scale = quantize_fp8(w)
    deq = (q.float() * scale[:, None]).to(torch.float16)
    expected, h = _norm_then_linear(x, res, norm_weight, deq, None)
    out, new_residual = small_m_gemm_add_norm(x, NormInput(norm_weight, EPS, res), q, None, scale,
                                              GemmConfig(16, 64, 2))
    _close(out, expected, torch.float16)
    assert torch.equal(new_residual, h)


def test_small_m_gemm_add_norm_keeps_leading_dims():
    x, res, norm_weight = _norm_inputs(4, 64, torch.float32, True, seed=13)
    _, w, _ = _inputs(4, 40, 64, torch.float32, seed=14)
    out, new_residual = small_m_gemm_add_norm(x.view(2, 2, 64), NormInput(norm_weight, EPS, res.view(2, 2, 64)),
                                              w, None, None, CONFIGS[0])
    assert out.shape == (2, 2, 40) and new_residual.shape == (2, 2, 64)
    expected, h = _norm_then_linear(x, res, norm_weight, w, None)
    _close(out.view(4, 40), expected, torch.float32)
    assert torch.equal(new_residual.view(4, 64), h)


def test_add_norm_forward_needs_a_plan_and_cuda():
    """Without a norm plan for these rows (no tuning, CPU tensors) the caller runs the two steps."""
    layer = Linear(64, 32, normed=True)
    x, res, norm_weight = _norm_inputs(3, 64, torch.float32, True)
    assert layer.add_norm_forward(x.cpu(), res.cpu(), norm_weight.cpu(), EPS) is None
    layer.norm_plan = {4: GemmConfig(16, 64, 1)}
    assert layer.add_norm_forward(x.cpu(), res.cpu(), norm_weight.cpu(), EPS) is None  # CPU: torch
    layer.quantize_fp8_()
    assert layer.norm_plan == {}  # tuned for the 16-bit weight


def test_the_normed_layers_are_qkv_and_gate_up():
    from tandem.models.decoder import DecoderModel
    from tandem.config import ModelConfig
    cfg = ModelConfig.from_hf(dict(architectures=["LlamaForCausalLM"], vocab_size=64, hidden_size=32,
                                   intermediate_size=48, num_hidden_layers=1, num_attention_heads=2,
                                   num_key_value_heads=1, rms_norm_eps=1e-6))
    model = DecoderModel(cfg, 64)
    normed = {name for name, mod in model.named_modules() if isinstance(mod, Linear) and mod.normed}
    assert normed == {"layers.0.self_attn.qkv_proj", "layers.0.mlp.gate_up_proj"}


def _tiny_logits(model, steps: list[list[int]]) -> list[torch.Tensor]:
    """Last-token logits of one request fed `steps` (a prompt, then decode tokens), torch attention."""
    from tandem.attention import TorchAttention
    from tandem.forward_batch import ForwardBatch
    from tandem.memory.kv_cache import KVCache
    cfg, device = model.config, model.embed_tokens.weight.device
    kv = KVCache(cfg.num_layers, 64, cfg.num_kv_heads, cfg.head_dim, model.embed_tokens.weight.dtype, device)
    table = torch.zeros(2, 64, dtype=torch.int32, device=device)
    start, out = 0, []
    for ids in steps:
        n = len(ids)
        locs = torch.arange(1 + start, 1 + start + n, device=device)
        table[1, start:start + n] = locs.to(torch.int32)
        t = lambda v: torch.tensor(v, device=device)  # noqa: E731
        fb = ForwardBatch(
            input_ids=t(ids), positions=torch.arange(start, start + n, device=device), out_cache_loc=locs,
            req_slots=t([1]), seq_lens=t([start + n]), prefix_lens=t([start]), qo_indptr=t([0, n]),
            req_to_token=table, host_req_slots=[1], host_seq_lens=[start + n], host_extend_lens=[n],
            is_decode=n == 1, max_seq_len=start + n)
        with torch.no_grad():
            out.append(model.compute_logits(model(fb, kv, TorchAttention())[-1:])[0])
        start += n
    return out


def _tiny_model(tmp_path, variant: str, dtype: torch.dtype, device: str):
    """A tiny checkpoint loaded as ours, its norm weights moved off 1 so that they matter."""
    from tandem.config import ModelConfig
    from tandem.models.checkpoint import open_checkpoint
    from tandem.models.loader import load_model
    from tiny_models import make_tiny_model
    ckpt = open_checkpoint(make_tiny_model(tmp_path, variant))
    model = load_model(ckpt, ModelConfig.from_hf(ckpt.config), dtype, torch.device(device), 512,
                       dummy_weights=False)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("layernorm.weight"):
                p.copy_(0.5 + torch.rand(p.shape, generator=g))
    return model


def _set_norm_plans(model, plan: dict) -> int:
    layers = [mod for mod in model.modules() if isinstance(mod, Linear) and mod.normed]
    for layer in layers:
        layer.norm_plan = dict(plan)
    return len(layers)


# Both buckets the steps below use: a prompt of 11 rows (bucket 16, split-K) and decode (M = 1).
NORM_PLAN = {16: GemmConfig(16, 32, 2), 1: GemmConfig(8, 32, 1)}
STEPS = [[5, 17, 99, 3, 42, 250, 7, 64, 128, 9, 33], [11], [200]]


@pytest.mark.parametrize("variant", ["llama", "qwen2"])  # qwen2: the qkv bias
def test_decoder_with_fused_norm_matches_unfused_on_cpu(tmp_path, variant, monkeypatch):
    """A whole tiny model with every qkv and gate/up projection taking its norm in the kernel
    gives the unfused logits (float32). `linear` uses the kernels only for CUDA tensors; here
    the plan lookup is opened to CPU tensors, so the interpreter runs them on the CPU."""
    import tandem.models.linear as linear_mod
    if not HAS_CUDA:
        def cpu_config(x, plan):
            rows = x.numel() // x.shape[-1]
            return plan.get(m_bucket(rows)) if plan and 0 < rows <= 16 else None
        monkeypatch.setattr(linear_mod, "_small_m_config", cpu_config)
    model = _tiny_model(tmp_path, variant, torch.float32, DEVICE)
    expected = _tiny_logits(model, STEPS)
    assert _set_norm_plans(model, NORM_PLAN) == 2 * model.config.num_layers
    calls = []
    original = linear_mod.Linear.add_norm_forward

    def counted(self, *args):
        calls.append(original(self, *args))
        return calls[-1]
    monkeypatch.setattr(linear_mod.Linear, "add_norm_forward", counted)
    for out, ref in zip(_tiny_logits(model, STEPS), expected):
        torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    assert calls and all(c is not None for c in calls)  # every normed projection ran fused


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_fused_norm_logits_match_unfused_on_gpu(tmp_path):
    """bfloat16 on the device: a tiny model's logits with the norm fused into every qkv and
    gate/up projection (forced plans, prefill and decode rows) are the unfused ones to rounding."""
    model = _tiny_model(tmp_path, "qwen2", torch.bfloat16, "cuda")
    expected = _tiny_logits(model, STEPS)
    _set_norm_plans(model, {**NORM_PLAN, 1: GemmConfig(8, 32, 2)})
    for out, ref in zip(_tiny_logits(model, STEPS), expected):
        _close(out, ref, torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_the_tuner_fills_norm_plans_only_where_faster_and_when_asked(tmp_path):
    """tune_model times the fused add + norm input of qkv and gate/up against the norm kernel +
    the layer's own plan; with fuse_norm=False no layer gets a norm plan."""
    from tandem.kernels.gemm_tuner import tune_model
    model = _tiny_model(tmp_path, "llama", torch.bfloat16, "cuda")
    tune_model(model, torch.bfloat16, max_m=4, fuse_norm=False)
    assert all(not mod.norm_plan for mod in model.modules() if isinstance(mod, Linear))
    results = tune_model(model, torch.bfloat16, max_m=4)
    normed = {key: r for key, r in results.items() if key[4] == "norm"}
    qkv, gate_up = model.layers[0].self_attn.qkv_proj, model.layers[0].mlp.gate_up_proj
    assert {key[:2] for key in normed} == {tuple(qkv.weight.shape), tuple(gate_up.weight.shape)}
    for (n, _, _, m, _), (cfg, ms, base_ms) in normed.items():
        layer = qkv if n == qkv.weight.shape[0] else gate_up
        assert layer.norm_plan.get(m) == cfg
        assert cfg is None or ms < base_ms


def test_plan_summary_counts_triton_choices_per_input_and_m():
    from tandem.kernels.gemm_tuner import plan_summary
    cfg = GemmConfig(16, 256, 1)
    results = {(8, 4, None, 1, None): (cfg, 0.0, 0.0), (16, 4, None, 1, None): (None, 0.0, 0.0),
               (8, 4, None, 1, "norm"): (cfg, 0.0, 0.0), (8, 4, None, 16, "norm"): (None, 0.0, 0.0)}
    assert plan_summary(results) == "plain M=1 1/2; norm M=1 1/1, M=16 0/1"
