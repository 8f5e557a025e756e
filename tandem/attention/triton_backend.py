"""Attention backend over the Triton kernels; same interface as `TorchAttention`.

Grid sizes come from the batch's host fields (`max_seq_len`, `host_extend_lens`), so a
forward never reads a device value.
"""
import torch

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
                 fp8_v_f16_where_loaded: bool = Experiments.fp8_v_f16_where_loaded):
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
        self.fp8_v_f16_where_loaded = fp8_v_f16_where_loaded  # Experiments.fp8_v_f16_where_loaded

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
                                    min_split_tokens=self.min_split_tokens, counters=self.split_counters,
                                    v_f16_where_loaded=self.fp8_v_f16_where_loaded)
        return extend_attention(q, k_cache, v_cache, batch.req_to_token, batch.req_slots,
                                batch.seq_lens, batch.prefix_lens, batch.qo_indptr, scale,
                                max(batch.host_extend_lens, default=0), blocks=batch.extend_blocks)
