"""Neox-style RoPE for q and k in one launch, with Qwen3's per-head q/k RMSNorm fused in,
and optionally the new tokens' KV-cache write.

Numerics follow `Attention.forward` in torch (norm, then `RotaryEmbedding.forward`),
including its roundings to the input dtype: the norm as in `RMSNorm`; the float32
cos/sin tables rounded to the input dtype; `x*cos` and `rotate_half(x)*sin` each
rounded, then their sum. With float32 inputs every rounding is a no-op.

Programs are (token, block of heads); the first `cdiv(Hq, BLOCK_H)` head blocks are
q's, the next k's. Each program loads both halves of its head rows, so the rotation can
write in place: `qkv_norm_rope` rotates q and k inside the packed qkv projection
output and returns q/k/v as views of it (no split copies, no allocation).

With a `CacheOut` (issue 21: one kernel a decoder layer fewer than RoPE + `write_kv`), the
k programs also store their rotated rows at cache slot `loc[t]`, and as many v head blocks
again follow the k ones, copying v to the cache. The stores are `write_kv`'s: the rotated
k rounded to the activation dtype, then cast to the cache dtype; padding rows write where
`loc` says (slot 0, the dummy). Everything comes from host shapes and device tensors, so
the launch can be captured in a CUDA graph.
"""
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from tandem.kernels.grid import cdiv, next_power_of_2
from tandem.kernels.kv_dtype import to_cache
from tandem.kernels.pdl import pdl_options, pdl_prologue


@triton.jit
def _norm_rope_heads(X, XO, W, t, h0, stride_t, stride_h, stride_ot, stride_oh, num_heads,
                     cos1, sin1, cos2, sin2, eps, Cache, slot, stride_ct, stride_ch,
                     HEAD_DIM: tl.constexpr, HALF: tl.constexpr, BLOCK_H: tl.constexpr,
                     BLOCK_HALF: tl.constexpr, HAS_NORM: tl.constexpr, TO_CACHE: tl.constexpr):
    dtype = XO.dtype.element_ty
    heads = h0 + tl.arange(0, BLOCK_H)
    offs = tl.arange(0, BLOCK_HALF)
    mask = (heads[:, None] < num_heads) & (offs[None, :] < HALF)
    src = X + t * stride_t + heads[:, None].to(tl.int64) * stride_h + offs[None, :]
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
    if HAS_NORM:
        ss = tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)
        rstd = 1.0 / tl.sqrt(ss / HEAD_DIM + eps)
        w1 = tl.load(W + offs, mask=offs < HALF, other=0.0).to(tl.float32)
        w2 = tl.load(W + HALF + offs, mask=offs < HALF, other=0.0).to(tl.float32)
        x1 = ((x1 * rstd[:, None]).to(dtype).to(tl.float32) * w1[None, :]).to(dtype).to(tl.float32)
        x2 = ((x2 * rstd[:, None]).to(dtype).to(tl.float32) * w2[None, :]).to(dtype).to(tl.float32)
    # out = x*cos + rotate_half(x)*sin, rotate_half(x) = (-x2, x1); each product rounded.
    o1 = ((x1 * cos1[None, :]).to(dtype).to(tl.float32) - (x2 * sin1[None, :]).to(dtype).to(tl.float32)).to(dtype)
    o2 = ((x2 * cos2[None, :]).to(dtype).to(tl.float32) + (x1 * sin2[None, :]).to(dtype).to(tl.float32)).to(dtype)
    dst = XO + t * stride_ot + heads[:, None].to(tl.int64) * stride_oh + offs[None, :]
    tl.store(dst, o1, mask=mask)
    tl.store(dst + HALF, o2, mask=mask)
    if TO_CACHE:
        # Rounded to the activation dtype first, then cast: what write_kv of the rotated k stores.
        _store_heads(Cache, slot, heads, offs, mask, stride_ct, stride_ch, o1, o2, HALF)


@triton.jit
def _store_heads(Cache, slot, heads, offs, mask, stride_ct, stride_ch, x1, x2, HALF: tl.constexpr):
    """Both halves of a block of head rows to cache slot `slot`, cast to the cache dtype
    (`to_cache`: saturating for an e4m3 pool, as write_kv)."""
    dst = Cache + slot * stride_ct + heads[:, None].to(tl.int64) * stride_ch + offs[None, :]
    tl.store(dst, to_cache(x1, Cache.dtype.element_ty), mask=mask)
    tl.store(dst + HALF, to_cache(x2, Cache.dtype.element_ty), mask=mask)


@triton.jit
def _copy_heads(V, VCache, t, h0, slot, stride_vt, stride_vh, stride_vct, stride_vch, num_heads,
                HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr):
    """A block of V head rows of token t, unchanged, to its cache slot."""
    heads = h0 + tl.arange(0, BLOCK_H)
    offs = tl.arange(0, BLOCK_HALF)
    mask = (heads[:, None] < num_heads) & (offs[None, :] < HALF)
    src = V + t * stride_vt + heads[:, None].to(tl.int64) * stride_vh + offs[None, :]
    v1 = tl.load(src, mask=mask)
    v2 = tl.load(src + HALF, mask=mask)
    _store_heads(VCache, slot, heads, offs, mask, stride_vct, stride_vch, v1, v2, HALF)


@triton.jit
def _qk_norm_rope_kernel(
    Q, K, QO, KO, QW, KW, Pos, Cos, Sin, V, KCache, VCache, Loc,
    stride_qt, stride_qh, stride_kt, stride_kh,
    stride_qot, stride_qoh, stride_kot, stride_koh, stride_cos, stride_sin,
    stride_vt, stride_vh, stride_kct, stride_kch, stride_vct, stride_vch,
    num_q_heads, num_k_heads, eps,
    HEAD_DIM: tl.constexpr, HALF: tl.constexpr, BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr, HAS_NORM: tl.constexpr, HAS_CACHE: tl.constexpr, USE_PDL: tl.constexpr,
):
    pdl_prologue(USE_PDL)
    t = tl.program_id(0).to(tl.int64)
    hb = tl.program_id(1)
    dtype = QO.dtype.element_ty
    num_q_blocks = tl.cdiv(num_q_heads, BLOCK_H)
    num_k_blocks = tl.cdiv(num_k_heads, BLOCK_H)
    # Padding rows store too, wherever Loc sends them (slot 0, the dummy): as write_kv does.
    slot = tl.load(Loc + t).to(tl.int64) if HAS_CACHE else t
    if hb >= num_q_blocks + num_k_blocks:  # V head blocks exist only with HAS_CACHE
        _copy_heads(V, VCache, t, (hb - num_q_blocks - num_k_blocks) * BLOCK_H, slot, stride_vt, stride_vh,
                    stride_vct, stride_vch, num_k_heads, HALF, BLOCK_H, BLOCK_HALF)
    else:
        pos = tl.load(Pos + t).to(tl.int64)
        offs = tl.arange(0, BLOCK_HALF)
        m = offs < HALF
        # The tables are float32; torch rounds them to the activation dtype first.
        cos1 = tl.load(Cos + pos * stride_cos + offs, mask=m, other=0.0).to(dtype).to(tl.float32)
        cos2 = tl.load(Cos + pos * stride_cos + HALF + offs, mask=m, other=0.0).to(dtype).to(tl.float32)
        sin1 = tl.load(Sin + pos * stride_sin + offs, mask=m, other=0.0).to(dtype).to(tl.float32)
        sin2 = tl.load(Sin + pos * stride_sin + HALF + offs, mask=m, other=0.0).to(dtype).to(tl.float32)
        if hb < num_q_blocks:
            _norm_rope_heads(Q, QO, QW, t, hb * BLOCK_H, stride_qt, stride_qh, stride_qot, stride_qoh,
                             num_q_heads, cos1, sin1, cos2, sin2, eps, KCache, slot, stride_kct, stride_kch,
                             HEAD_DIM, HALF, BLOCK_H, BLOCK_HALF, HAS_NORM, False)
        else:
            _norm_rope_heads(K, KO, KW, t, (hb - num_q_blocks) * BLOCK_H, stride_kt, stride_kh,
                             stride_kot, stride_koh, num_k_heads, cos1, sin1, cos2, sin2, eps,
                             KCache, slot, stride_kct, stride_kch,
                             HEAD_DIM, HALF, BLOCK_H, BLOCK_HALF, HAS_NORM, HAS_CACHE)


def default_heads_per_program(num_tokens: int, num_q_heads: int) -> int:
    """One head per program for small batches (parallelism over SMs); four for large ones
    (fewer, fatter programs); docs/benchmarks.md (fused Triton kernels, 2026-11-30) has the timings."""
    return 1 if num_tokens <= 64 else min(4, next_power_of_2(num_q_heads))


class CacheOut(NamedTuple):
    """Where the fused launch stores the new tokens' K/V: the layer's caches
    [num_slots, kv_heads, head_dim] (last dim contiguous), token t at slot `loc[t]` [T]."""

    k_cache: torch.Tensor
    v_cache: torch.Tensor
    loc: torch.Tensor


def rope(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
         sin: torch.Tensor, q_weight: torch.Tensor | None = None,
         k_weight: torch.Tensor | None = None, eps: float = 1e-6,
         out_q: torch.Tensor | None = None, out_k: torch.Tensor | None = None,
         heads_per_program: int | None = None, v: torch.Tensor | None = None,
         cache: CacheOut | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q [T, Hq, D] and k [T, Hk, D] by `positions` [T] (neox, rotate halves) using
    the float32 tables cos/sin [max_pos, D]; with q_weight/k_weight [D], RMSNorm each head
    first (Qwen3). Inputs may be strided views (last dim contiguous). Outputs go to
    out_q/out_k (which may be q/k themselves: in place), else to new contiguous tensors.
    With `cache` (and v [T, Hk, D]), the rotated k and v are also stored in the KV cache,
    exactly as `write_kv(cache.k_cache, cache.v_cache, cache.loc, out_k, v)` would."""
    num_tokens, num_q_heads, head_dim = q.shape
    num_k_heads = k.shape[1]
    _check_rope_args(q, k, positions, cos, sin, q_weight, k_weight)
    out_q = torch.empty(q.shape, dtype=q.dtype, device=q.device) if out_q is None else out_q
    out_k = torch.empty(k.shape, dtype=k.dtype, device=k.device) if out_k is None else out_k
    assert out_q.shape == q.shape and out_k.shape == k.shape
    assert out_q.dtype == q.dtype and out_k.dtype == k.dtype
    assert out_q.stride(2) == 1 and out_k.stride(2) == 1
    if cache is not None:
        _check_cache_args(k, v, cache)
    if num_tokens == 0:
        return out_q, out_k
    has_norm = q_weight is not None
    half = head_dim // 2
    block_h = heads_per_program or default_heads_per_program(num_tokens, num_q_heads)
    assert block_h & (block_h - 1) == 0, "heads_per_program must be a power of two"
    block_half = next_power_of_2(half)
    k_blocks = cdiv(num_k_heads, block_h)
    # V head blocks follow the K ones; each copies its rows to the cache.
    v_blocks = k_blocks if cache is not None else 0
    grid = (num_tokens, cdiv(num_q_heads, block_h) + k_blocks + v_blocks)
    # Without a cache the pointers are placeholders (HAS_CACHE=False never touches them).
    v_, k_cache, v_cache, loc = (v, *cache) if cache is not None else (k, k, k, positions)
    _qk_norm_rope_kernel[grid](
        q, k, out_q, out_k, q_weight if has_norm else q, k_weight if has_norm else k,
        positions, cos, sin, v_, k_cache, v_cache, loc,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        out_q.stride(0), out_q.stride(1), out_k.stride(0), out_k.stride(1),
        cos.stride(0), sin.stride(0),
        v_.stride(0), v_.stride(1), k_cache.stride(0), k_cache.stride(1),
        v_cache.stride(0), v_cache.stride(1),
        num_q_heads, num_k_heads, eps,
        HEAD_DIM=head_dim, HALF=half, BLOCK_H=block_h, BLOCK_HALF=block_half,
        HAS_NORM=has_norm, HAS_CACHE=cache is not None,
        num_warps=max(1, min(4, block_h * block_half // 64)), **pdl_options(q.device),
    )
    return out_q, out_k


def _check_rope_args(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
                     sin: torch.Tensor, q_weight: torch.Tensor | None, k_weight: torch.Tensor | None) -> None:
    num_tokens, num_q_heads, head_dim = q.shape
    assert k.shape == (num_tokens, k.shape[1], head_dim) and k.dtype == q.dtype
    assert head_dim % 2 == 0 and q.stride(2) == 1 and k.stride(2) == 1
    assert positions.shape == (num_tokens,)
    assert cos.shape[1] == head_dim and sin.shape[1] == head_dim
    assert cos.stride(1) == 1 and sin.stride(1) == 1
    assert (q_weight is None) == (k_weight is None)
    if q_weight is not None:
        assert q_weight.shape == (head_dim,) and k_weight.shape == (head_dim,)
        assert q_weight.is_contiguous() and k_weight.is_contiguous()


def _check_cache_args(k: torch.Tensor, v: torch.Tensor | None, cache: CacheOut) -> None:
    assert v is not None and v.shape == k.shape and v.dtype == k.dtype and v.stride(2) == 1
    assert cache.loc.shape == (k.shape[0],)
    assert cache.k_cache.shape[1:] == k.shape[1:] and cache.v_cache.shape == cache.k_cache.shape
    assert cache.k_cache.stride(2) == 1 and cache.v_cache.stride(2) == 1


def qkv_norm_rope(qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
                  sin: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int,
                  q_weight: torch.Tensor | None = None, k_weight: torch.Tensor | None = None,
                  eps: float = 1e-6, heads_per_program: int | None = None,
                  cache: CacheOut | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Packed qkv [T, (Hq + 2*Hk) * D] -> q [T, Hq, D], k, v [T, Hk, D], all views of qkv,
    with q and k (optionally per-head normed and) rotated in place; with `cache`, the
    rotated k and v are stored in the KV cache too. One launch."""
    num_tokens = qkv.shape[0]
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    assert qkv.shape == (num_tokens, q_size + 2 * kv_size) and qkv.stride(1) == 1
    row = qkv.stride(0)
    q = qkv.as_strided((num_tokens, num_heads, head_dim), (row, head_dim, 1), qkv.storage_offset())
    k = qkv.as_strided((num_tokens, num_kv_heads, head_dim), (row, head_dim, 1),
                       qkv.storage_offset() + q_size)
    v = qkv.as_strided((num_tokens, num_kv_heads, head_dim), (row, head_dim, 1),
                       qkv.storage_offset() + q_size + kv_size)
    # k is rotated in place even when the cache gets it too: the k view returned is the rotated key.
    rope(q, k, positions, cos, sin, q_weight, k_weight, eps, out_q=q, out_k=k,
         heads_per_program=heads_per_program, v=v, cache=cache)
    return q, k, v
