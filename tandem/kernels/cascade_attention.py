"""Two-level (cascade) paged decode attention: a shared prefix read once per group.

Rows of a group begin with the same KV slots (a radix-tree prefix they all read). Their
attention splits into two disjoint key ranges whose partial softmaxes merge exactly:
- shared part, grid (work item, kv head): the group's queries, rows x query heads of one
  KV head, are the M dimension of `tl.dot` against the prefix's K/V tiles, so each tile is
  loaded once for the whole group (one read per group instead of one per row). The host cuts
  each prefix into chunks along the sequence (work items, flash-decoding style) so a few
  groups still fill the GPU and long and short prefixes balance;
- suffix part: the plain decode kernel over keys [shared_len, seq_len) of each row;
- merge, grid (row, head): every used split of both parts, weighted by its log-sum-exp.

Graph-safe layout (`tandem.cascade_layout`): the grid comes from host bounds (work item
capacity, split counts); a padding work item has no keys and writes nothing. Rows are not
reordered: a group lists its member rows (`group_rows`, `group_indptr`).
"""
import torch
import triton
import triton.language as tl

from tandem.cascade_layout import MAX_PARTS, WORK_INTS, CascadeInputs, max_group_rows
from tandem.kernels.decode_attention import (LOG2E, MIN_ROW_SPLIT_TOKENS, _merge_head, _used_splits,
                                             decode_num_splits, decode_suffix_partials, default_block_n)
from tandem.kernels.grid import next_power_of_2
from tandem.kernels.kv_dtype import dot_kv, dot_operand


# Per-step ints (the suffix split count, and the strides of the mid buffers, which hold
# suffix splits + MAX_PARTS) are not specialized on: each value class would compile another
# variant while serving (the suffix split count follows the batch and the longest context).
@triton.jit(do_not_specialize=["stride_mb", "stride_mh", "stride_lb", "stride_lh", "split_offset"])
def _shared_prefix_kernel(
    Q, K, V, ReqToToken, ReqSlots, GroupRows, GroupIndptr, Work, MidO, MidLse,
    stride_qb, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_r2t,
    stride_mb, stride_mh, stride_ms, stride_lb, stride_lh, qk_scale, split_offset,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    # Work item w = (group, first key, end key, part): one chunk of one group's prefix.
    w = tl.program_id(0)
    kv_head = tl.program_id(1)
    g = tl.load(Work + 4 * w)
    start = tl.load(Work + 4 * w + 1)
    end = tl.load(Work + 4 * w + 2)  # a padding item has end == start: it loads and writes nothing
    part = tl.load(Work + 4 * w + 3)
    first_row = tl.load(GroupIndptr + g)
    num_rows = tl.load(GroupIndptr + g + 1) - first_row
    offs_m = tl.arange(0, BLOCK_M)
    member = offs_m // GROUP  # query m is head (m % GROUP) of the group's row (m // GROUP)
    mask_m = (member < num_rows) & (offs_m < tl.where(start < end, BLOCK_M, 0))
    rows = tl.load(GroupRows + first_row + member, mask=mask_m, other=0).to(tl.int64)
    heads = kv_head * GROUP + offs_m % GROUP
    # Every member's table row holds the same slots below the shared length: read the leader's.
    leader = tl.load(GroupRows + first_row)
    slot_row = ReqToToken + tl.load(ReqSlots + leader).to(tl.int64) * stride_r2t
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM

    q = dot_operand(tl.load(Q + rows[:, None] * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                            mask=mask_m[:, None] & mask_d[None, :], other=0.0), K.dtype.element_ty)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for start_n in range(start, end, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        mask_n = offs_n < end
        slots = tl.load(slot_row + offs_n, mask=mask_n, other=0).to(tl.int64)
        k = tl.load(K + slots[None, :] * stride_kt + kv_head * stride_kh + offs_d[:, None],
                    mask=mask_n[None, :] & mask_d[:, None], other=0.0)  # [D, N]
        qk = dot_kv(q, k, None, DOT_PRECISION) * qk_scale
        qk = tl.where(mask_n[None, :], qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(V + slots[:, None] * stride_vt + kv_head * stride_vh + offs_d[None, :],
                    mask=mask_n[:, None] & mask_d[None, :], other=0.0)  # [N, D]
        acc = dot_kv(p, v, acc * alpha[:, None], DOT_PRECISION)
        m_i = m_new

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    lse = m_i + tl.log2(tl.where(l_i > 0, l_i, 1.0))
    split_idx = split_offset + part
    tl.store(MidO + rows[:, None] * stride_mb + heads[:, None] * stride_mh + split_idx * stride_ms
             + offs_d[None, :], out, mask=mask_m[:, None] & mask_d[None, :])
    tl.store(MidLse + rows * stride_lb + heads * stride_lh + split_idx, lse, mask=mask_m)


@triton.jit(do_not_specialize=["stride_mb", "stride_mh", "stride_lb", "stride_lh", "suffix_splits"])
def _cascade_merge_kernel(
    MidO, MidLse, Out, SeqLens, SharedLens, SharedParts,
    stride_mb, stride_mh, stride_ms, stride_lb, stride_lh, stride_ob, stride_oh,
    suffix_splits, min_split_tokens,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
):
    # The row's used splits only (decode's `_merge_head`, MERGE_TILE at a time): its used
    # suffix splits first, then its group's work items, stored from split `suffix_splits` on.
    b = tl.program_id(0)
    suffix = tl.load(SeqLens + b) - tl.load(SharedLens + b)
    used_suffix = _used_splits(suffix, suffix_splits, min_split_tokens, BLOCK_N)
    used = used_suffix + tl.load(SharedParts + b)  # + the row's group's work items (0: no group)
    _merge_head(MidO, MidLse, Out, b, tl.program_id(1), used, used_suffix, suffix_splits,
                stride_mb, stride_mh, stride_ms, stride_lb, stride_lh, stride_ob, stride_oh,
                HEAD_DIM=HEAD_DIM, BLOCK_D=BLOCK_D)


def cascade_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      req_to_token: torch.Tensor, req_slots: torch.Tensor, seq_lens: torch.Tensor,
                      c: CascadeInputs, scale: float, max_seq_len: int, out: torch.Tensor | None = None, *,
                      suffix_splits: int | None = None,
                      min_split_tokens: int = MIN_ROW_SPLIT_TOKENS) -> torch.Tensor:
    """q [B, H, D] -> [B, H, D]; matches `torch_backend.cascade_attention` (layout: `c`).

    Host bounds: `max_seq_len` sizes the suffix split count (any count is correct),
    `c.max_group_size` the M tile (at most `max_group_rows`). The mid buffers hold suffix splits +
    MAX_PARTS, whatever this step's work items: one size per batch, as in graphs.
    """
    batch, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    group = num_heads // num_kv_heads
    assert num_heads % num_kv_heads == 0 and q.stride(2) == 1
    assert 1 <= c.max_group_size <= max_group_rows(num_heads, num_kv_heads)
    if out is None:
        out = torch.empty_like(q)
    if batch == 0:
        return out
    if suffix_splits is None:
        suffix_splits = decode_num_splits(batch, num_kv_heads, group, max_seq_len, q.device)
    block_n = default_block_n(head_dim)
    splits = suffix_splits + MAX_PARTS
    mid_o = torch.empty(batch, num_heads, splits, head_dim, dtype=torch.float32, device=q.device)
    mid_lse = torch.empty(batch, num_heads, splits, dtype=torch.float32, device=q.device)
    decode_suffix_partials(q, k_cache, v_cache, req_to_token, req_slots, seq_lens, c.shared_lens, scale,
                           mid_o, mid_lse, suffix_splits, min_split_tokens, block_n)
    shared_prefix_partials(q, k_cache, v_cache, req_to_token, req_slots, c, scale, mid_o, mid_lse, suffix_splits)
    block_d = next_power_of_2(head_dim)
    _cascade_merge_kernel[(batch, num_heads)](
        mid_o, mid_lse, out, seq_lens, c.shared_lens, c.shared_parts,
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2), mid_lse.stride(0), mid_lse.stride(1),
        out.stride(0), out.stride(1), suffix_splits, min_split_tokens,
        HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_N=block_n,
        num_warps=4,
    )
    return out


def shared_prefix_partials(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           req_to_token: torch.Tensor, req_slots: torch.Tensor, c: CascadeInputs, scale: float,
                           mid_o: torch.Tensor, mid_lse: torch.Tensor, split_offset: int, *,
                           block_n: int | None = None, num_warps: int = 4, num_stages: int = 3) -> None:
    """The shared part alone: each work item's chunk of its group's prefix, attended by all the
    group's queries, into splits [split_offset, split_offset + MAX_PARTS) of the mid buffers.
    The tile and launch shape are parameters for the kernel sweep (`bench.cascade_kernels
    --sweep`). Three stages: on the H100 (session 40) 1.3-1.5x two (32 groups x 2,048 tokens:
    0.107 against 0.157 ms, 2.5 TB/s); a 128-key tile with 8 warps, and more chunks than two
    waves, were slower."""
    num_heads, head_dim = q.shape[1:]
    num_kv_heads = k_cache.shape[1]
    items = c.work.shape[0] // WORK_INTS
    if not items:
        return
    group = num_heads // num_kv_heads
    _shared_prefix_kernel[(items, num_kv_heads)](
        q, k_cache, v_cache, req_to_token, req_slots, c.group_rows, c.group_indptr, c.work,
        mid_o, mid_lse, q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1),
        v_cache.stride(0), v_cache.stride(1), req_to_token.stride(0),
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2), mid_lse.stride(0), mid_lse.stride(1),
        scale * LOG2E, split_offset,
        GROUP=group, HEAD_DIM=head_dim, BLOCK_M=max(16, next_power_of_2(c.max_group_size * group)),
        BLOCK_N=block_n or default_block_n(head_dim), BLOCK_D=next_power_of_2(head_dim),
        DOT_PRECISION="ieee" if k_cache.dtype == torch.float32 else "tf32", num_warps=num_warps, num_stages=num_stages,
    )
