"""Paged extend (prefill / chunked prefill) attention, all requests in one launch.

Grid (request, query block, head). A query block at offset m of a request with a
cached prefix of P tokens sees keys [0, P + m) unmasked and keys [P + m, P + m +
BLOCK_M) under the causal mask, so the attention loop is split in two and only the
diagonal part pays for the mask. The new tokens' K/V are already in the cache, so
both parts read keys the same way, through `req_to_token`. Query blocks past a
request's length (the grid is sized by the longest request) do no work.

With a block table (`blocks`: each program's row and query block, planned on the host) the
grid is (entries, head) instead: a CUDA graph of a prefill step sizes it by its token bucket,
not by rows x the longest row, so its padding costs a few idle programs, not R x T / BLOCK_M.
"""
import torch
import triton
import triton.language as tl

from tandem.kernels.grid import cdiv, next_power_of_2
from tandem.kernels.kv_dtype import dot_kv, dot_operand

LOG2E = 1.4426950408889634


@triton.jit
def _attend(q, acc, m_i, l_i, K, V, slot_row, kv_head, start, end, q_pos,
            stride_kt, stride_kh, stride_vt, stride_vh, qk_scale,
            CAUSAL: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr,
            BLOCK_D: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Online-softmax over keys [start, end); every row sees >= 1 key in the first block."""
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    for start_n in range(start, end, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        mask_n = offs_n < end
        slots = tl.load(slot_row + offs_n, mask=mask_n, other=0).to(tl.int64)
        k = tl.load(K + slots[None, :] * stride_kt + kv_head * stride_kh + offs_d[:, None],
                    mask=mask_n[None, :] & mask_d[:, None], other=0.0)  # [D, N]
        qk = dot_kv(q, k, None, DOT_PRECISION) * qk_scale
        if CAUSAL:
            visible = mask_n[None, :] & (offs_n[None, :] <= q_pos[:, None])
        else:
            visible = mask_n[None, :]
        qk = tl.where(visible, qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(V + slots[:, None] * stride_vt + kv_head * stride_vh + offs_d[None, :],
                    mask=mask_n[:, None] & mask_d[None, :], other=0.0)  # [N, D]
        acc = dot_kv(p, v, acc * alpha[:, None], DOT_PRECISION)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def _extend_kernel(
    Q, K, V, Out, ReqToToken, ReqSlots, SeqLens, PrefixLens, QoIndptr, BlockRows, BlockIndex,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
    stride_r2t, qk_scale,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_TABLE: tl.constexpr,
):
    if BLOCK_TABLE:  # grid (table entries, heads): the entry names the row and query block
        b = tl.load(BlockRows + tl.program_id(0)).to(tl.int32)
        block_m = tl.load(BlockIndex + tl.program_id(0)).to(tl.int32)
        h = tl.program_id(1)
    else:  # grid (rows, query blocks of the longest row, heads)
        b = tl.program_id(0)
        block_m = tl.program_id(1)
        h = tl.program_id(2)
    kv_head = h // GROUP

    q_start = tl.load(QoIndptr + b)
    extend_len = tl.load(QoIndptr + b + 1) - q_start
    prefix_len = tl.load(PrefixLens + b)
    seq_len = tl.load(SeqLens + b)
    slot_row = ReqToToken + tl.load(ReqSlots + b).to(tl.int64) * stride_r2t

    offs_m = block_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    mask_m = offs_m < extend_len
    mask_d = offs_d < HEAD_DIM
    q_rows = (q_start + offs_m).to(tl.int64)
    q = dot_operand(tl.load(Q + q_rows[:, None] * stride_qt + h * stride_qh + offs_d[None, :],
                            mask=mask_m[:, None] & mask_d[None, :], other=0.0), K.dtype.element_ty)
    q_pos = prefix_len + offs_m

    # An idle block (past this request's end) gets empty key ranges instead of an
    # early return, so control flow stays uniform. Both ranges end at the row's length: a
    # graphed step's padding row holds tokens but has length 0, so it reads no key (zeros).
    active = block_m * BLOCK_M < extend_len
    diag_start = tl.where(active, tl.minimum(prefix_len + block_m * BLOCK_M, seq_len), 0)
    diag_end = tl.where(active, tl.minimum(prefix_len + (block_m + 1) * BLOCK_M, seq_len), 0)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    acc, m_i, l_i = _attend(q, acc, m_i, l_i, K, V, slot_row, kv_head, 0, diag_start, q_pos,
                            stride_kt, stride_kh, stride_vt, stride_vh, qk_scale,
                            False, HEAD_DIM, BLOCK_N, BLOCK_D, DOT_PRECISION)
    acc, m_i, l_i = _attend(q, acc, m_i, l_i, K, V, slot_row, kv_head, diag_start, diag_end,
                            q_pos, stride_kt, stride_kh, stride_vt, stride_vh, qk_scale,
                            True, HEAD_DIM, BLOCK_N, BLOCK_D, DOT_PRECISION)
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(Out + q_rows[:, None] * stride_ot + h * stride_oh + offs_d[None, :],
             out.to(Out.dtype.element_ty), mask=mask_m[:, None] & mask_d[None, :])


def extend_block_rows(head_dim: int) -> int:
    """Query rows a program of the default tiles covers: a block table's unit."""
    return _default_blocks(head_dim)[0]


def _default_blocks(head_dim: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps): Hopper-sized tiles that fit shared memory."""
    if head_dim <= 128:
        return 128, 64, 8
    return 64, 32, 8


def extend_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     req_to_token: torch.Tensor, req_slots: torch.Tensor, seq_lens: torch.Tensor,
                     prefix_lens: torch.Tensor, qo_indptr: torch.Tensor, scale: float,
                     max_extend_len: int, out: torch.Tensor | None = None, *,
                     block_m: int | None = None, block_n: int | None = None,
                     blocks: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """q [T, H, D] packed request-major -> [T, H, D]; matches `torch_backend.extend_attention`.

    `max_extend_len` (a host int) only sizes the dense grid; it must be >= every request's
    new-token count. `blocks`: (rows, query-block indices), one program per entry and head, in
    units of `block_m` (default `extend_block_rows(D)`); they must cover every block of every
    row (entries past a row's end do nothing), and `max_extend_len` is then unused.
    """
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    assert num_heads % num_kv_heads == 0, "query heads must be a multiple of KV heads"
    assert q.stride(2) == 1 and k_cache.stride(2) == 1 and v_cache.stride(2) == 1
    if out is None:
        out = torch.empty_like(q)
    assert out.shape == q.shape and out.stride(2) == 1
    batch = req_slots.shape[0]
    if num_tokens == 0 or batch == 0 or (blocks is None and max_extend_len <= 0):
        return out
    default_m, default_n, num_warps = _default_blocks(head_dim)
    block_m = block_m or default_m
    block_n = block_n or default_n
    if blocks is None:
        grid = (batch, cdiv(max_extend_len, block_m), num_heads)
        block_rows = block_index = req_slots  # unread placeholders (BLOCK_TABLE is off)
    else:
        block_rows, block_index = blocks
        grid = (block_rows.shape[0], num_heads)
    _extend_kernel[grid](
        q, k_cache, v_cache, out, req_to_token, req_slots, seq_lens, prefix_lens, qo_indptr,
        block_rows, block_index,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1),
        v_cache.stride(0), v_cache.stride(1), out.stride(0), out.stride(1),
        req_to_token.stride(0), scale * LOG2E,
        GROUP=num_heads // num_kv_heads, HEAD_DIM=head_dim, BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_D=next_power_of_2(head_dim),
        DOT_PRECISION="ieee" if k_cache.dtype == torch.float32 else "tf32",
        BLOCK_TABLE=blocks is not None, num_warps=num_warps, num_stages=2,
    )
    return out
