"""The one object a forward pass reads: token inputs plus attention metadata.

It is passed explicitly into `model.forward` (no module-global context). Device
tensors live on the forward device; the `host_*` fields are the same facts as
plain Python values, known to the CPU at schedule time, so kernels that need a
Python-side size (a loop bound, a grid) never read a device value.
"""
from dataclasses import dataclass

import torch

from tandem.cascade_layout import CascadeInputs


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # [T] int64, all new tokens of all requests, request-major
    positions: torch.Tensor  # [T] int64, absolute position of each new token
    out_cache_loc: torch.Tensor  # [T] int64, KV slot each new token is written to
    req_slots: torch.Tensor  # [B] int64, row of each request in req_to_token
    seq_lens: torch.Tensor  # [B] int32, tokens in cache after this step (prefix + new)
    prefix_lens: torch.Tensor  # [B] int32, tokens already cached before this step
    qo_indptr: torch.Tensor  # [B+1] int32, offsets of each request's new tokens in T
    req_to_token: torch.Tensor  # [max_reqs, max_context] int32, shared table
    # Host mirrors (no device reads needed):
    host_req_slots: list[int]
    host_seq_lens: list[int]
    host_extend_lens: list[int]
    is_decode: bool  # every request has exactly one new token
    max_seq_len: int
    cascade: CascadeInputs | None = None  # decode only: two-level attention over shared prefixes
    # Extend only: (rows, query-block indices) of each attention program, planned on the host
    # (a graphed prefill step's fixed grid); None: the dense grid over (row, query block).
    extend_blocks: tuple[torch.Tensor, torch.Tensor] | None = None
    # Extend only: every row has exactly this many new tokens and the kernels take the rows'
    # lengths from the device (`fixed_extend_batch`: a graphed verify step); the host fields
    # then hold placeholders. None: the host fields are the rows' real lengths.
    queries_per_row: int | None = None


def query_rows_batch(input_ids: torch.Tensor, positions: torch.Tensor, locs: torch.Tensor,
                     req_slots: torch.Tensor, req_to_token: torch.Tensor, max_seq_len: int) -> ForwardBatch:
    """A verify step as the model runs it: every query token is a decode row of its request
    (`req_slots` [T], one per query) whose length ends at the query's own position. Each layer
    writes every query's KV before its attention reads (the backends' order), so query j sees
    its row's cache and queries 0..j: causal masking from lengths alone. It is the decode
    kernel plain decoding runs at that position, and graph-capturable (device lengths;
    `max_seq_len` a host bound)."""
    t = input_ids.shape[0]
    seq_lens = (positions + 1).clamp(max=max_seq_len)
    return ForwardBatch(
        input_ids=input_ids, positions=positions, out_cache_loc=locs, req_slots=req_slots,
        seq_lens=seq_lens, prefix_lens=seq_lens - 1,
        qo_indptr=torch.arange(t + 1, device=input_ids.device), req_to_token=req_to_token,
        # Decode kernels read device lengths; these host fields only size extend kernels.
        host_req_slots=[0] * t, host_seq_lens=[1] * t, host_extend_lens=[1] * t,
        is_decode=True, max_seq_len=max_seq_len)


def fixed_extend_batch(input_ids: torch.Tensor, positions: torch.Tensor, locs: torch.Tensor,
                       req_slots: torch.Tensor, queries: int, req_to_token: torch.Tensor,
                       max_seq_len: int) -> ForwardBatch:
    """A verify step in the extend layout: row b's `queries` tokens (positions p0 .. p0 +
    queries - 1, request-major) are new tokens after its cache, attended causally by one
    extend launch a layer; `req_slots` [B], one per row. Lengths stay on the device (p0 =
    the row's first query position; lengths clamped to `max_seq_len`, the table's width:
    queries past the end are dead ones, never emitted), so it is graph-capturable. Same
    queries, same causal mask as `query_rows_batch`, one launch instead of a row per query."""
    b = req_slots.shape[0]
    prefix_lens = positions.view(b, queries)[:, 0].to(torch.int32)
    return ForwardBatch(
        input_ids=input_ids, positions=positions, out_cache_loc=locs, req_slots=req_slots,
        seq_lens=(prefix_lens + queries).clamp(max=max_seq_len), prefix_lens=prefix_lens,
        qo_indptr=torch.arange(0, b * queries + 1, queries, dtype=torch.int32, device=input_ids.device),
        req_to_token=req_to_token,
        # Placeholders (the lengths are on the device); host_extend_lens sizes the extend grid.
        host_req_slots=[0] * b, host_seq_lens=[queries] * b, host_extend_lens=[queries] * b,
        is_decode=False, max_seq_len=max_seq_len, queries_per_row=queries)
