"""Scatter the new tokens' K and V into the paged cache in one launch.

One program per token copies its [kv_heads, head_dim] rows of K and V to cache slot
`loc[t]`. The source may be a strided view (K/V sliced out of a fused QKV output),
so strides are honoured instead of forcing a copy; the cast to the cache dtype
happens in registers (`kv_dtype.to_cache`: saturating for an e4m3 pool).

A decoder layer on CUDA stores K/V in its RoPE launch instead (`tandem.kernels.rope`,
`CacheOut`), for decode and extend batches alike, when `Experiments.fused_kv_write` is on.
This kernel stays for the unfused path (`TritonAttention.forward` without `kv_written`:
the switch off) and defines the numerics the fused store must reproduce.
"""
import torch
import triton
import triton.language as tl

from tandem.kernels.grid import next_power_of_2
from tandem.kernels.kv_dtype import to_cache


@triton.jit
def _write_kv_kernel(
    KCache, VCache, Loc, K, V,
    stride_ct, stride_ch, stride_vct, stride_vch,
    stride_kt, stride_kh, stride_vt, stride_vh,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(Loc + t).to(tl.int64)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h[:, None] < NUM_KV_HEADS) & (offs_d[None, :] < HEAD_DIM)
    k = tl.load(K + t * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask)
    v = tl.load(V + t * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask)
    tl.store(KCache + slot * stride_ct + offs_h[:, None] * stride_ch + offs_d[None, :],
             to_cache(k, KCache.dtype.element_ty), mask=mask)
    tl.store(VCache + slot * stride_vct + offs_h[:, None] * stride_vch + offs_d[None, :],
             to_cache(v, VCache.dtype.element_ty), mask=mask)


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, loc: torch.Tensor,
             k: torch.Tensor, v: torch.Tensor) -> None:
    """Store k, v [T, kv_heads, head_dim] at cache slots `loc` [T]; matches the torch reference."""
    num_tokens, num_kv_heads, head_dim = k.shape
    assert v.shape == k.shape and loc.shape == (num_tokens,)
    assert k_cache.shape[1:] == (num_kv_heads, head_dim) and v_cache.shape == k_cache.shape
    assert k.stride(2) == 1 and v.stride(2) == 1
    assert k_cache.stride(2) == 1 and v_cache.stride(2) == 1
    if num_tokens == 0:
        return
    _write_kv_kernel[(num_tokens,)](
        k_cache, v_cache, loc, k, v,
        k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
        BLOCK_H=next_power_of_2(num_kv_heads), BLOCK_D=next_power_of_2(head_dim),
        num_warps=4,
    )
