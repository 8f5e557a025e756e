"""Attention backend over the Triton kernels; same interface as `TorchAttention`.

Grid sizes come from the batch's host fields (`max_seq_len`, `host_extend_lens`), so a
forward never reads a device value.
"""
import torch

from tandem.attention.unrotated import UnrotatedQKV, norm_rope_rows
from tandem.config import Experiments
from tandem.forward_batch import ForwardBatch
from tandem.kernels import decode_attention, extend_attention, write_kv
from tandem.kernels.cascade_attention import cascade_attention
from tandem.kernels.decode_attention import MIN_ROW_SPLIT_TOKENS, SplitCounters


class TritonAttention:
    """Paged attention: split-K decode kernel, single-launch extend kernel."""

    name = "triton"

    # Defaults: the engine's (`Experiments`), one place for them.
    def __init__(self, split_by_context: bool = Experiments.attention_split_by_context,
                 fused_kv_write: bool = Experiments.fused_kv_write,
                 fused_decode_merge: bool = Experiments.fused_decode_merge,
                 fused_rope_attention: bool = Experiments.fused_rope_attention):
        # On: each decode row uses only the splits its own length needs (device-side), so a
        # graph captured for the longest context runs short rows with few splits. Off: every
        # row spreads over all splits of the grid (the behaviour before, for comparison).
        self.min_split_tokens = MIN_ROW_SPLIT_TOKENS if split_by_context else 1
        # On: the model's RoPE launch stores the new K/V in the cache and calls forward with
        # kv_written=True, one launch a layer fewer (Experiments.fused_kv_write).
        self.fused_kv_write = fused_kv_write
        # On: split-K decode merges in the split launch, its last program per row and head
        # group (Experiments.fused_decode_merge). The counters live as long as the backend:
        # every layer's launch and every captured graph reuses them (all on one stream).
        self.split_counters = SplitCounters() if fused_decode_merge else None
        # On: decode batches take the projection output unrotated; the decode kernel norms,
        # rotates and stores the new K/V (Experiments.fused_rope_attention).
        self.fused_rope_attention = fused_rope_attention

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                k_cache: torch.Tensor, v_cache: torch.Tensor, batch: ForwardBatch,
                scale: float, kv_written: bool = False) -> torch.Tensor:
        """Attention output [T, H, D]; stores k, v at `batch.out_cache_loc` first unless the
        caller already did (`kv_written`: its stores are earlier in the same stream)."""
        if not kv_written:
            write_kv(k_cache, v_cache, batch.out_cache_loc, k, v)
        if batch.is_decode and batch.cascade is not None:
            return cascade_attention(q, k_cache, v_cache, batch.req_to_token, batch.req_slots, batch.seq_lens,
                                     batch.cascade, scale, batch.max_seq_len, min_split_tokens=self.min_split_tokens)
        if batch.is_decode:
            return decode_attention(q, k_cache, v_cache, batch.req_to_token, batch.req_slots,
                                    batch.seq_lens, scale, batch.max_seq_len,
                                    min_split_tokens=self.min_split_tokens, counters=self.split_counters)
        return extend_attention(q, k_cache, v_cache, batch.req_to_token, batch.req_slots,
                                batch.seq_lens, batch.prefix_lens, batch.qo_indptr, scale,
                                max(batch.host_extend_lens, default=0))

    def rope_in_attention(self, batch: ForwardBatch) -> bool:
        """Plain decode batches: one new token per row, each row its own request. Not cascade
        (its suffix kernel starts past the shared keys) nor verify query rows (a row reads the
        K/V its request's other rows store in the same launch)."""
        return self.fused_rope_attention and batch.is_decode and batch.cascade is None and not batch.query_rows

    def forward_unrotated(self, u: UnrotatedQKV, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          batch: ForwardBatch, scale: float) -> torch.Tensor:
        """One launch (two without the fused merge) for (q/k norm,) RoPE, the K/V store and
        decode attention; other batches: `norm_rope_rows`, then `forward`."""
        if not self.rope_in_attention(batch):
            q, k, v = norm_rope_rows(u)
            return self.forward(q, k, v, k_cache, v_cache, batch, scale)
        return decode_attention(u.q, k_cache, v_cache, batch.req_to_token, batch.req_slots, batch.seq_lens,
                                scale, batch.max_seq_len, min_split_tokens=self.min_split_tokens,
                                counters=self.split_counters, rope=u, loc=batch.out_cache_loc)
