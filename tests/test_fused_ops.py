"""Fused Triton elementwise kernels (RMSNorm, add+RMSNorm, q/k-norm+RoPE, SiLU*mul) vs
the torch references in `tandem.models.layers` (the CPU path of the modules).

Without CUDA the kernels run in Triton's interpreter on the CPU (float32/float16);
with CUDA they run compiled, bfloat16 included. The reference always runs on the CPU
(on CUDA the modules would call the kernels themselves). The kernels reproduce the
reference's roundings to the activation dtype, so tolerances are a few ulps.
"""
import os

import pytest
import torch

from kernel_setup import DEVICE, DTYPES, HAS_CUDA  # first: it sets up Triton's interpreter

triton = pytest.importorskip("triton")

from tandem.kernels.activation import silu_mul  # noqa: E402
from tandem.kernels.norm import fused_add_rms_norm, rms_norm  # noqa: E402
from tandem.kernels.kv_write import write_kv  # noqa: E402
from tandem.kernels.rope import CacheOut, qkv_norm_rope, rope  # noqa: E402
from tandem.models.layers import (RotaryEmbedding, qkv_norm_rope_torch, rms_norm_torch,  # noqa: E402
                                  rope_torch, silu_mul_torch)

# (atol, rtol): float32 differs only in summation order / rsqrt; half types by an ulp
# where a float32 intermediate lands next to a rounding boundary.
TOL = {torch.float32: (1e-5, 1e-5), torch.float16: (2e-3, 2e-3), torch.bfloat16: (2e-2, 1.6e-2)}
EPS = 1e-6


def _rand(*shape, dtype, seed, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(dtype)


def _check(out: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    atol, rtol = TOL[dtype]
    assert out.dtype == expected.dtype and out.shape == expected.shape
    torch.testing.assert_close(out.cpu().float(), expected.float(), atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,hidden", [(1, 576), (37, 576), (37, 1024), (5, 130)])
def test_rms_norm(dtype, tokens, hidden):
    x = _rand(tokens, hidden, dtype=dtype, seed=1, scale=3.0)
    w = _rand(hidden, dtype=dtype, seed=2)
    out = rms_norm(x.to(DEVICE), w.to(DEVICE), EPS)
    _check(out, rms_norm_torch(x, w, EPS), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,hidden", [(1, 576), (37, 576), (37, 1024)])
def test_fused_add_rms_norm(dtype, tokens, hidden):
    x = _rand(tokens, hidden, dtype=dtype, seed=3)
    res = _rand(tokens, hidden, dtype=dtype, seed=4, scale=5.0)
    w = _rand(hidden, dtype=dtype, seed=5)
    x_d, res_d = x.to(DEVICE), res.to(DEVICE)
    out, new_res = fused_add_rms_norm(x_d, res_d, w.to(DEVICE), EPS)
    expected_res = x + res
    _check(new_res, expected_res, dtype)
    _check(out, rms_norm_torch(expected_res, w, EPS), dtype)
    # Inputs untouched (new tensors out).
    assert torch.equal(x_d.cpu(), x) and torch.equal(res_d.cpu(), res)


def test_rms_norm_leading_dims_and_strided_rows():
    x = _rand(7, 4, 64, dtype=torch.float32, seed=6)
    w = _rand(64, dtype=torch.float32, seed=7)
    _check(rms_norm(x.to(DEVICE), w.to(DEVICE), EPS), rms_norm_torch(x, w, EPS), torch.float32)
    wide = _rand(7, 200, dtype=torch.float32, seed=8)  # rows of 64 with row stride 200
    view = wide[:, 10:74]
    _check(rms_norm(wide.to(DEVICE)[:, 10:74], w.to(DEVICE), EPS), rms_norm_torch(view, w, EPS),
           torch.float32)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,inter", [(1, 1536), (37, 300), (4, 3072)])
def test_silu_mul(dtype, tokens, inter):
    gate_up = _rand(tokens, 2 * inter, dtype=dtype, seed=9, scale=4.0)
    _check(silu_mul(gate_up.to(DEVICE)), silu_mul_torch(gate_up), dtype)


# (tokens, q heads, kv heads, head_dim, heads per program or None for the default).
# Head blocks that are partly masked (9 q / 3 kv heads in blocks of 4), a single KV
# head, head_dim 96 (half not a power of two), T=1 and T=37.
ROPE_CASES = [
    (1, 16, 8, 128, None),
    (1, 9, 3, 64, None),
    (37, 16, 8, 128, 4),
    (37, 9, 3, 64, 4),
    (37, 6, 1, 64, 2),
    (5, 4, 2, 96, 1),
]
MAX_POS = 300
_ROTARY = {}


def _tables(head_dim: int):
    if head_dim not in _ROTARY:
        rot = RotaryEmbedding(head_dim, MAX_POS, 10000.0, None)
        _ROTARY[head_dim] = rot.cos, rot.sin
    return _ROTARY[head_dim]


def _rope_inputs(case, dtype, seed):
    tokens, hq, hk, d, _ = case
    qkv = _rand(tokens, (hq + 2 * hk) * d, dtype=dtype, seed=seed, scale=2.0)
    positions = torch.randint(0, MAX_POS, (tokens,), generator=torch.Generator().manual_seed(seed))
    positions[0] = MAX_POS - 1
    qw = _rand(d, dtype=dtype, seed=seed + 1)
    kw = _rand(d, dtype=dtype, seed=seed + 2)
    return qkv, positions, qw, kw


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("qk_norm", [True, False], ids=["qknorm", "plain"])
@pytest.mark.parametrize("case", ROPE_CASES, ids=lambda c: "T{}-{}x{}x{}-b{}".format(*c))
def test_qkv_norm_rope(dtype, qk_norm, case):
    """Packed qkv in, q/k normed + rotated in place, q/k/v views of qkv out."""
    tokens, hq, hk, d, per_program = case
    qkv, positions, qw, kw = _rope_inputs(case, dtype, seed=10 + tokens)
    cos, sin = _tables(d)
    norm = (qw, kw, EPS) if qk_norm else ()
    eq, ek, ev = qkv_norm_rope_torch(qkv, positions, cos, sin, hq, hk, d, *norm)
    dev = lambda t: t.to(DEVICE)  # noqa: E731
    qkv_d = dev(qkv)
    q, k, v = qkv_norm_rope(qkv_d, dev(positions), dev(cos), dev(sin), hq, hk, d,
                            *((dev(qw), dev(kw), EPS) if qk_norm else ()),
                            heads_per_program=per_program)
    for t in (q, k, v):
        assert t.untyped_storage().data_ptr() == qkv_d.untyped_storage().data_ptr()
    _check(q, eq, dtype)
    _check(k, ek, dtype)
    assert torch.equal(v.cpu(), ev)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_separate_tensors(dtype):
    """Unpacked q/k (contiguous, int32 positions) into new tensors; inputs untouched."""
    tokens, hq, hk, d = 37, 6, 2, 128
    q = _rand(tokens, hq, d, dtype=dtype, seed=20)
    k = _rand(tokens, hk, d, dtype=dtype, seed=21)
    positions = torch.randint(0, MAX_POS, (tokens,), generator=torch.Generator().manual_seed(22))
    cos, sin = _tables(d)
    eq, ek = rope_torch(positions, q, k, cos, sin)
    dev = lambda t: t.to(DEVICE)  # noqa: E731
    q_d, k_d = dev(q), dev(k)
    oq, ok = rope(q_d, k_d, dev(positions).int(), dev(cos), dev(sin), heads_per_program=2)
    _check(oq, eq, dtype)
    _check(ok, ek, dtype)
    assert oq.is_contiguous() and torch.equal(q_d.cpu(), q) and torch.equal(k_d.cpu(), k)


# The fused KV write is checked against the kernels it replaces (qkv_norm_rope, then write_kv),
# so bfloat16 runs on the CPU too: both sides see the interpreter's same arithmetic.
KV_DTYPES = [pytest.param(torch.float32, id="fp32", marks=[pytest.mark.gpu] if HAS_CUDA else []),
             pytest.param(torch.bfloat16, id="bf16", marks=[pytest.mark.gpu] if HAS_CUDA else [])]
# (tokens, q heads, kv heads, head_dim, heads per program or None): T 1, 3, 17; kv heads 1, 2,
# 8; head_dim 64, 128; the last has partly masked head blocks (3 kv heads in blocks of 2).
KV_CASES = [
    (1, 2, 1, 64, None), (1, 16, 8, 128, None), (3, 4, 2, 128, None), (3, 16, 8, 64, None),
    (3, 6, 1, 128, None), (17, 2, 1, 64, None), (17, 4, 2, 64, None), (17, 16, 8, 128, None),
    (17, 9, 3, 64, 2),
]
NUM_SLOTS = 40


def _kv_inputs(case, dtype, cache_dtype, seed, scale=1.0):
    """qkv (times `scale`) etc. as `_rope_inputs`, random caches, and loc: distinct random slots,
    except the last rows (a CUDA graph's padding) which all go to the dummy slot 0. Padding rows
    are copies of one row, so slot 0 ends the same whichever of them stores last."""
    tokens, _, hk, d, _ = case
    qkv, positions, qw, kw = _rope_inputs(case, dtype, seed)
    qkv = qkv * scale
    g = torch.Generator().manual_seed(seed + 3)
    loc = torch.randperm(NUM_SLOTS - 1, generator=g)[:tokens] + 1
    padding = 0 if tokens == 1 else max(1, tokens // 5)
    if padding:
        loc[-padding:] = 0
        qkv[-padding:] = qkv[-padding]
        positions[-padding:] = positions[-padding]
    caches = [torch.randn(NUM_SLOTS, hk, d, generator=g).to(cache_dtype) for _ in range(2)]
    return qkv, positions, qw, kw, loc, caches


def _fused_and_unfused(case, dtype, cache_dtype, qk_norm, seed, scale=1.0):
    """(qkv, k_cache, v_cache) after the fused launch and after qkv_norm_rope + write_kv."""
    tokens, hq, hk, d, per_program = case
    qkv, positions, qw, kw, loc, caches = _kv_inputs(case, dtype, cache_dtype, seed, scale)
    cos, sin = _tables(d)
    dev = lambda t: t.to(DEVICE, copy=True)  # noqa: E731  (on the CPU too: each side its own)
    args = (dev(positions), dev(cos), dev(sin), hq, hk, d, *((dev(qw), dev(kw), EPS) if qk_norm else ()))
    unfused = [dev(qkv), *map(dev, caches)]
    _, k, v = qkv_norm_rope(unfused[0], *args, heads_per_program=per_program)
    write_kv(unfused[1], unfused[2], dev(loc), k, v)
    fused = [dev(qkv), *map(dev, caches)]
    qkv_norm_rope(fused[0], *args, heads_per_program=per_program, cache=CacheOut(fused[1], fused[2], dev(loc)))
    return [t.cpu() for t in fused], [t.cpu() for t in unfused], loc, caches


@pytest.mark.parametrize("dtype", KV_DTYPES)
@pytest.mark.parametrize("qk_norm", [True, False], ids=["qknorm", "plain"])
@pytest.mark.parametrize("case", KV_CASES, ids=lambda c: "T{}-{}x{}x{}-b{}".format(*c))
def test_qkv_norm_rope_fused_kv_write(dtype, qk_norm, case):
    """The fused cache write leaves qkv and both caches bit-identical to RoPE then write_kv."""
    tokens, hq, hk, d, _ = case
    fused, unfused, loc, before = _fused_and_unfused(case, dtype, dtype, qk_norm, seed=30 + tokens)
    for got, expected in zip(fused, unfused):
        assert torch.equal(got, expected)
    # Directly, so the test fails without the K store or the V copy (not only by comparison):
    # each slot holds its token's rotated k and its v from qkv; no other slot changed.
    qkv, k_cache, v_cache = fused
    k = qkv[:, hq * d:(hq + hk) * d].reshape(tokens, hk, d)
    v = qkv[:, (hq + hk) * d:].reshape(tokens, hk, d)
    assert torch.equal(k_cache[loc], k) and torch.equal(v_cache[loc], v)
    untouched = torch.ones(NUM_SLOTS, dtype=torch.bool)
    untouched[loc] = False
    assert torch.equal(k_cache[untouched], before[0][untouched])
    assert torch.equal(v_cache[untouched], before[1][untouched])


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_fused_kv_write_casts_to_cache_dtype(cache_dtype):
    """float32 activations into a 16-bit cache: the same cast as write_kv's."""
    fused, unfused, _, _ = _fused_and_unfused((5, 4, 2, 64, None), torch.float32, cache_dtype, True, seed=40)
    assert fused[1].dtype == cache_dtype
    for got, expected in zip(fused, unfused):
        assert torch.equal(got, expected)


def test_fused_kv_write_saturates_into_an_fp8_cache():
    """An e4m3 cache (kv_cache_dtype="fp8"): the fused store's bytes are write_kv's, and
    activations beyond +-448 are stored saturated, not NaN. The activations are large (x 200)
    so that many are beyond the range after RoPE (no q/k norm, which would bring k back)."""
    case, fp8 = (17, 4, 2, 64, None), torch.float8_e4m3fn
    fused, unfused, loc, _ = _fused_and_unfused(case, torch.float32, fp8, False, seed=41, scale=200.0)
    for got, expected in zip(fused, unfused):
        assert torch.equal(got.view(torch.uint8) if got.dtype == fp8 else got,
                           expected.view(torch.uint8) if expected.dtype == fp8 else expected)
    for cache in fused[1:]:
        stored = cache[loc].float()
        assert not stored.isnan().any() and stored.abs().max() == 448


def test_empty_batch():
    x = torch.empty(0, 64, device=DEVICE)
    w = torch.ones(64, device=DEVICE)
    assert rms_norm(x, w, EPS).shape == (0, 64)
    assert fused_add_rms_norm(x, x, w, EPS)[1].shape == (0, 64)
    assert silu_mul(torch.empty(0, 128, device=DEVICE)).shape == (0, 64)
    cos, sin = _tables(64)
    q, k, v = qkv_norm_rope(torch.empty(0, 4 * 64, device=DEVICE), torch.empty(0, dtype=torch.long,
                            device=DEVICE), cos.to(DEVICE), sin.to(DEVICE), 2, 1, 64)
    assert q.shape == (0, 2, 64) and k.shape == v.shape == (0, 1, 64)


@pytest.mark.parametrize("variant,backend,fused_kv_write", [("qwen3", "triton", True), ("qwen2", "triton", True),
                                                            ("qwen3", "triton", False), ("qwen2", "torch", False)])
def test_model_forward_with_kernels(tmp_path, monkeypatch, variant, backend, fused_kv_write):
    """A tiny model's prefill + decode logits are unchanged when its modules use the
    kernels: checks the wiring (eps, head counts, q/k/v as in-place views of qkv fed to
    the attention backend, the KV-cache write fused into RoPE or not). Reference: the CPU
    torch path with the torch attention. With CUDA the model runs on the GPU; without,
    CPU tensors are made to report `is_cuda` so the modules take the same (kernel) branch
    under the interpreter."""
    from tiny_models import make_tiny_model

    from tandem.attention import TorchAttention
    from tandem.attention.triton_backend import TritonAttention
    from tandem.config import ModelConfig
    from tandem.forward_batch import ForwardBatch
    from tandem.memory.kv_cache import KVCache
    from tandem.models import decoder, layers
    from tandem.models.checkpoint import open_checkpoint
    from tandem.models.loader import load_model

    ckpt = open_checkpoint(make_tiny_model(tmp_path, variant))
    cfg = ModelConfig.from_hf(ckpt.config)
    model = load_model(ckpt, cfg, torch.float32, torch.device("cpu"), 64, dummy_weights=False)

    def run(attn, dev: str) -> torch.Tensor:
        kv = KVCache(cfg.num_layers, 32, cfg.num_kv_heads, cfg.head_dim, torch.float32,
                     torch.device(dev))
        table = torch.zeros(2, 32, dtype=torch.int32)
        logits = []
        for start, ids in ((0, [5, 17, 99, 3, 42, 250, 7]), (7, [64])):
            n = len(ids)
            locs = torch.arange(1 + start, 1 + start + n)
            table[1, start:start + n] = locs.to(torch.int32)
            on = lambda t: t.to(dev)  # noqa: E731
            fb = ForwardBatch(
                input_ids=on(torch.tensor(ids)), positions=on(torch.arange(start, start + n)),
                out_cache_loc=on(locs), req_slots=on(torch.tensor([1])),
                seq_lens=on(torch.tensor([start + n])), prefix_lens=on(torch.tensor([start])),
                qo_indptr=on(torch.tensor([0, n])), req_to_token=on(table), host_req_slots=[1],
                host_seq_lens=[start + n], host_extend_lens=[n], is_decode=n == 1,
                max_seq_len=start + n)
            with torch.no_grad():
                logits.append(model.compute_logits(model(fb, kv, attn)).cpu())
        return torch.cat(logits)

    expected = run(TorchAttention(), "cpu")
    attn = TritonAttention(fused_kv_write=fused_kv_write) if backend == "triton" else TorchAttention()
    assert attn.fused_kv_write == fused_kv_write
    if fused_kv_write:  # the RoPE launch writes the cache: the backend must not
        from tandem.attention import triton_backend
        monkeypatch.setattr(triton_backend, "write_kv", _unreachable)
    if HAS_CUDA:
        model.to(DEVICE)
    else:  # CPU tensors claim to be CUDA ones: the modules take their kernel branch
        monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
        for name in ("rms_norm_torch", "silu_mul_torch", "rope_torch"):
            monkeypatch.setattr(layers, name, _unreachable)
        monkeypatch.setattr(decoder, "qkv_norm_rope_torch", _unreachable)
    got = run(attn, DEVICE)
    monkeypatch.undo()
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


def _unreachable(*args, **kwargs):
    raise AssertionError("torch path taken where the kernel branch was expected")
