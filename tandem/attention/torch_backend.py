"""Paged attention in plain PyTorch: the reference every kernel is tested against.

KV layout (shared with the Triton kernels): per layer, `k_cache` and `v_cache` are
[num_slots, num_kv_heads, head_dim]; a request's tokens live at the slots listed in
its row of `req_to_token`. Slot 0 is a dummy slot that padding rows may write to. An e4m3
pool is stored saturated (`to_cache_dtype`) and read back upcast to q's dtype (`_gather`).
"""
import torch
import torch.nn.functional as F

from tandem.forward_batch import ForwardBatch
from tandem.memory.kv_cache import to_cache_dtype


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, loc: torch.Tensor,
             k: torch.Tensor, v: torch.Tensor) -> None:
    """Store the new tokens' K/V ([T, kv_heads, head_dim]) at cache slots `loc` ([T])."""
    k_cache[loc] = to_cache_dtype(k, k_cache.dtype)
    v_cache[loc] = to_cache_dtype(v, v_cache.dtype)


def _gather(cache: torch.Tensor, idx: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """cache[idx] in the compute dtype: an e4m3 pool is upcast (no-op for a pool of `dtype`)."""
    return cache[idx].to(dtype)


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     req_to_token: torch.Tensor, req_slots: torch.Tensor, seq_lens: torch.Tensor,
                     scale: float, max_seq_len: int) -> torch.Tensor:
    """One query token per request, at position seq_lens - 1: q [B, H, D] -> [B, H, D]
    (`fixed_extend_attention` with one query a row)."""
    return fixed_extend_attention(q, k_cache, v_cache, req_to_token, req_slots, seq_lens - 1, seq_lens,
                                  scale, max_seq_len)


def cascade_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      req_to_token: torch.Tensor, req_slots: torch.Tensor, seq_lens: torch.Tensor,
                      shared_lens: torch.Tensor, shared_src: torch.Tensor, scale: float,
                      max_seq_len: int) -> torch.Tensor:
    """Two-level decode attention, q [B, H, D] -> [B, H, D]: row b's keys [0, shared_lens[b])
    are read from table row `shared_src[b]` (its group's leader), the rest from its own row;
    the two partial softmaxes merge by their log-sum-exps. Equals `decode_attention` when
    the leader's slots below the shared length are the row's own (the grouping's promise)."""
    positions = torch.arange(max_seq_len, device=q.device)
    shared = positions[None, :] < shared_lens[:, None]  # [B, L]
    own = req_to_token[req_slots, :max_seq_len].long()
    lead = req_to_token[shared_src, :max_seq_len].long()
    parts = []
    for idx, mask in ((lead, shared), (own, ~shared & (positions[None, :] < seq_lens[:, None]))):
        parts.append(_partial_attention(q, _gather(k_cache, idx, q.dtype), _gather(v_cache, idx, q.dtype),
                                        mask, scale))
    (o1, lse1), (o2, lse2) = parts
    m = torch.maximum(lse1, lse2)
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)  # both parts empty: padding row
    w1, w2 = torch.exp(lse1 - m), torch.exp(lse2 - m)
    denom = (w1 + w2).clamp_min(torch.finfo(w1.dtype).tiny)
    return ((w1[..., None] * o1 + w2[..., None] * o2) / denom[..., None]).to(q.dtype)


def _partial_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                       scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention over the masked keys, k/v [B, L, KVH, D], mask [B, L]: the normalised
    output [B, H, D] and natural log-sum-exp [B, H] (-inf, zeros where no key is unmasked)."""
    group = q.shape[1] // k.shape[2]
    k = k.repeat_interleave(group, dim=2).float()  # [B, L, H, D]
    v = v.repeat_interleave(group, dim=2).float()
    scores = torch.einsum("bhd,blhd->bhl", q.float(), k) * scale
    scores = scores.masked_fill(~mask[:, None, :], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [B, H]
    p = torch.exp(scores - torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)[..., None])
    return torch.einsum("bhl,blhd->bhd", p, v), lse


def extend_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     req_to_token: torch.Tensor, host_req_slots: list[int],
                     host_seq_lens: list[int], host_extend_lens: list[int],
                     scale: float) -> torch.Tensor:
    """New tokens attend causally to their request's cached prefix and to each other.

    q is [T, H, D] with requests packed back to back; the new tokens' K/V must already be
    in the cache. Loops over requests on the host (lengths are host ints).
    """
    out = torch.empty_like(q)
    start = 0
    for slot, seq_len, n in zip(host_req_slots, host_seq_lens, host_extend_lens):
        token_idx = req_to_token[slot, :seq_len].long()
        k = _gather(k_cache, token_idx, q.dtype).transpose(0, 1).unsqueeze(0)  # [1, KVH, L, D]
        v = _gather(v_cache, token_idx, q.dtype).transpose(0, 1).unsqueeze(0)
        q_pos = torch.arange(seq_len - n, seq_len, device=q.device)
        k_pos = torch.arange(seq_len, device=q.device)
        mask = k_pos[None, :] <= q_pos[:, None]  # [n, L] causal with prefix offset
        qi = q[start:start + n].transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
        oi = F.scaled_dot_product_attention(qi, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
        out[start:start + n] = oi.squeeze(0).transpose(0, 1)
        start += n
    return out


def fixed_extend_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           req_to_token: torch.Tensor, req_slots: torch.Tensor, prefix_lens: torch.Tensor,
                           seq_lens: torch.Tensor, scale: float, max_seq_len: int) -> torch.Tensor:
    """`extend_attention` for rows of the same number of new tokens (q [B * Q, H, D], request-
    major) with the lengths on the device: query j of row b sits at prefix_lens[b] + j and
    sees keys up to its own position, below seq_lens[b]. All rows are padded to `max_seq_len`
    (a host int) and masked: no per-request Python loop, no device value read."""
    b = req_slots.shape[0]
    queries = q.shape[0] // b
    token_idx = req_to_token[req_slots, :max_seq_len].long()  # [B, L]
    k = _gather(k_cache, token_idx, q.dtype).transpose(1, 2)  # [B, KVH, L, D]
    v = _gather(v_cache, token_idx, q.dtype).transpose(1, 2)
    k_pos = torch.arange(max_seq_len, device=q.device)
    q_pos = prefix_lens[:, None].long() + torch.arange(queries, device=q.device)  # [B, Q]
    mask = (k_pos[None, None, :] <= q_pos[:, :, None]) & (k_pos[None, None, :] < seq_lens[:, None, None])
    qb = q.view(b, queries, *q.shape[1:]).transpose(1, 2)  # [B, H, Q, D]
    # Every query sees key 0 at least (a padding row's too: prefix 0, length `queries`).
    out = F.scaled_dot_product_attention(qb, k, v, attn_mask=mask[:, None], scale=scale, enable_gqa=True)
    return out.transpose(1, 2).reshape(q.shape)


class TorchAttention:
    """Attention backend over the reference functions above."""

    name = "torch"
    # The reference writes its own cache: the model never stores K/V for it (not even on
    # CUDA, where its RoPE is a kernel), so it stays the reference for the fused path.
    fused_kv_write = False

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                k_cache: torch.Tensor, v_cache: torch.Tensor, batch: ForwardBatch,
                scale: float, kv_written: bool = False) -> torch.Tensor:
        """Attention output [T, H, D]; stores k, v at `batch.out_cache_loc` first unless the
        caller already did (`kv_written`)."""
        if not kv_written:
            write_kv(k_cache, v_cache, batch.out_cache_loc, k, v)
        if batch.is_decode and batch.cascade is not None:
            c = batch.cascade
            return cascade_attention(q, k_cache, v_cache, batch.req_to_token, batch.req_slots, batch.seq_lens,
                                     c.shared_lens, c.shared_src, scale, batch.max_seq_len)
        if batch.is_decode:
            return decode_attention(q, k_cache, v_cache, batch.req_to_token, batch.req_slots,
                                    batch.seq_lens, scale, batch.max_seq_len)
        if batch.queries_per_row is not None:
            return fixed_extend_attention(q, k_cache, v_cache, batch.req_to_token, batch.req_slots,
                                          batch.prefix_lens, batch.seq_lens, scale, batch.max_seq_len)
        return extend_attention(q, k_cache, v_cache, batch.req_to_token, batch.host_req_slots,
                                batch.host_seq_lens, batch.host_extend_lens, scale)
