"""Neox-style RoPE for q and k in one launch, with Qwen3's per-head q/k RMSNorm fused in.

Numerics follow `Attention.forward` in torch (norm, then `RotaryEmbedding.forward`),
including its roundings to the input dtype: the norm as in `RMSNorm`; the float32
cos/sin tables rounded to the input dtype; `x*cos` and `rotate_half(x)*sin` each
rounded, then their sum. With float32 inputs every rounding is a no-op.

Programs are (token, block of heads); the first `cdiv(Hq, BLOCK_H)` head blocks are
q's, the rest k's. Each program loads both halves of its head rows, so the rotation can
write in place: `qkv_norm_rope` rotates q and k inside the packed qkv projection
output and returns q/k/v as views of it (no split copies, no allocation).
"""
import torch
import triton
import triton.language as tl


@triton.jit
def _norm_rope_heads(X, XO, W, t, h0, stride_t, stride_h, stride_ot, stride_oh, num_heads,
                     cos1, sin1, cos2, sin2, eps,
                     HEAD_DIM: tl.constexpr, HALF: tl.constexpr, BLOCK_H: tl.constexpr,
                     BLOCK_HALF: tl.constexpr, HAS_NORM: tl.constexpr):
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
    o1 = (x1 * cos1[None, :]).to(dtype).to(tl.float32) - (x2 * sin1[None, :]).to(dtype).to(tl.float32)
    o2 = (x2 * cos2[None, :]).to(dtype).to(tl.float32) + (x1 * sin2[None, :]).to(dtype).to(tl.float32)
    dst = XO + t * stride_ot + heads[:, None].to(tl.int64) * stride_oh + offs[None, :]
    tl.store(dst, o1.to(dtype), mask=mask)
    tl.store(dst + HALF, o2.to(dtype), mask=mask)


@triton.jit
def _qk_norm_rope_kernel(
    Q, K, QO, KO, QW, KW, Pos, Cos, Sin,
    stride_qt, stride_qh, stride_kt, stride_kh,
    stride_qot, stride_qoh, stride_kot, stride_koh, stride_cos, stride_sin,
    num_q_heads, num_k_heads, eps,
    HEAD_DIM: tl.constexpr, HALF: tl.constexpr, BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr, HAS_NORM: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    hb = tl.program_id(1)
    dtype = QO.dtype.element_ty
    pos = tl.load(Pos + t).to(tl.int64)
    offs = tl.arange(0, BLOCK_HALF)
    m = offs < HALF
    # The tables are float32; torch rounds them to the activation dtype first.
    cos1 = tl.load(Cos + pos * stride_cos + offs, mask=m, other=0.0).to(dtype).to(tl.float32)
    cos2 = tl.load(Cos + pos * stride_cos + HALF + offs, mask=m, other=0.0).to(dtype).to(tl.float32)
    sin1 = tl.load(Sin + pos * stride_sin + offs, mask=m, other=0.0).to(dtype).to(tl.float32)
    sin2 = tl.load(Sin + pos * stride_sin + HALF + offs, mask=m, other=0.0).to(dtype).to(tl.float32)
    num_q_blocks = tl.cdiv(num_q_heads, BLOCK_H)
    if hb < num_q_blocks:
        _norm_rope_heads(Q, QO, QW, t, hb * BLOCK_H, stride_qt, stride_qh, stride_qot, stride_qoh,
                         num_q_heads, cos1, sin1, cos2, sin2, eps,
                         HEAD_DIM, HALF, BLOCK_H, BLOCK_HALF, HAS_NORM)
    else:
        _norm_rope_heads(K, KO, KW, t, (hb - num_q_blocks) * BLOCK_H, stride_kt, stride_kh,
                         stride_kot, stride_koh, num_k_heads, cos1, sin1, cos2, sin2, eps,
                         HEAD_DIM, HALF, BLOCK_H, BLOCK_HALF, HAS_NORM)


def default_heads_per_program(num_tokens: int, num_q_heads: int) -> int:
    """One head per program for small batches (parallelism over SMs); four for large ones
    (fewer, fatter programs); docs/benchmarks.md (fused Triton kernels, 2026-11-30) has the timings."""
    return 1 if num_tokens <= 64 else min(4, triton.next_power_of_2(num_q_heads))


def rope(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
         sin: torch.Tensor, q_weight: torch.Tensor | None = None,
         k_weight: torch.Tensor | None = None, eps: float = 1e-6,
         out_q: torch.Tensor | None = None, out_k: torch.Tensor | None = None,
         heads_per_program: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q [T, Hq, D] and k [T, Hk, D] by `positions` [T] (neox, rotate halves) using
    the float32 tables cos/sin [max_pos, D]; with q_weight/k_weight [D], RMSNorm each head
    first (Qwen3). Inputs may be strided views (last dim contiguous). Outputs go to
    out_q/out_k (which may be q/k themselves: in place), else to new contiguous tensors."""
    num_tokens, num_q_heads, head_dim = q.shape
    num_k_heads = k.shape[1]
    assert k.shape == (num_tokens, num_k_heads, head_dim) and k.dtype == q.dtype
    assert head_dim % 2 == 0 and q.stride(2) == 1 and k.stride(2) == 1
    assert positions.shape == (num_tokens,)
    assert cos.shape[1] == head_dim and sin.shape[1] == head_dim
    assert cos.stride(1) == 1 and sin.stride(1) == 1
    has_norm = q_weight is not None
    assert has_norm == (k_weight is not None)
    if has_norm:
        assert q_weight.shape == (head_dim,) and k_weight.shape == (head_dim,)
        assert q_weight.is_contiguous() and k_weight.is_contiguous()
    out_q = torch.empty(q.shape, dtype=q.dtype, device=q.device) if out_q is None else out_q
    out_k = torch.empty(k.shape, dtype=k.dtype, device=k.device) if out_k is None else out_k
    assert out_q.shape == q.shape and out_k.shape == k.shape
    assert out_q.dtype == q.dtype and out_k.dtype == k.dtype
    assert out_q.stride(2) == 1 and out_k.stride(2) == 1
    if num_tokens == 0:
        return out_q, out_k
    half = head_dim // 2
    block_h = heads_per_program or default_heads_per_program(num_tokens, num_q_heads)
    assert block_h & (block_h - 1) == 0, "heads_per_program must be a power of two"
    block_half = triton.next_power_of_2(half)
    grid = (num_tokens, triton.cdiv(num_q_heads, block_h) + triton.cdiv(num_k_heads, block_h))
    _qk_norm_rope_kernel[grid](
        q, k, out_q, out_k, q_weight if has_norm else q, k_weight if has_norm else k,
        positions, cos, sin,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        out_q.stride(0), out_q.stride(1), out_k.stride(0), out_k.stride(1),
        cos.stride(0), sin.stride(0),
        num_q_heads, num_k_heads, eps,
        HEAD_DIM=head_dim, HALF=half, BLOCK_H=block_h, BLOCK_HALF=block_half,
        HAS_NORM=has_norm, num_warps=max(1, min(4, block_h * block_half // 64)),
    )
    return out_q, out_k


def qkv_norm_rope(qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
                  sin: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int,
                  q_weight: torch.Tensor | None = None, k_weight: torch.Tensor | None = None,
                  eps: float = 1e-6, heads_per_program: int | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Packed qkv [T, (Hq + 2*Hk) * D] -> q [T, Hq, D], k, v [T, Hk, D], all views of qkv,
    with q and k (optionally per-head normed and) rotated in place. One launch."""
    num_tokens = qkv.shape[0]
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    assert qkv.shape == (num_tokens, q_size + 2 * kv_size) and qkv.stride(1) == 1
    row = qkv.stride(0)
    q = qkv.as_strided((num_tokens, num_heads, head_dim), (row, head_dim, 1), qkv.storage_offset())
    k = qkv.as_strided((num_tokens, num_kv_heads, head_dim), (row, head_dim, 1),
                       qkv.storage_offset() + q_size)
    v = qkv.as_strided((num_tokens, num_kv_heads, head_dim), (row, head_dim, 1),
                       qkv.storage_offset() + q_size + kv_size)
    rope(q, k, positions, cos, sin, q_weight, k_weight, eps, out_q=q, out_k=k,
         heads_per_program=heads_per_program)
    return q, k, v
