"""A greedy verify step's settling in one launch: acceptance, history, lengths, relay, result.

After a greedy verify step's argmax, the torch form (`speculative.graphs.settle` over
`SpecState.point_mass_verdict`) spreads the verdict over ~25 small kernels: the per-row
scatter of the samples, the leading-match cumprod, the history and length stores, the
relay's gather and scatter, the packed result's concatenation. Each costs a few microseconds
of GPU even inside a CUDA graph, on every step of a batch-1 decode. Here one program per row
does all of it. The torch form stays the CPU path and this kernel's reference (tested under
Triton's interpreter, and on CUDA in the GPU suite).
"""
import torch
import triton
import triton.language as tl

from tandem.kernels.grid import next_power_of_2


@triton.jit
def _settle_greedy_kernel(
    Sampled, Proposals, Count, Lengths, Slots, History, stride_h, Length, Relay, RelayCopy, Packed,
    Q, K, BLOCK: tl.constexpr,
):
    b = tl.program_id(0)
    j = tl.arange(0, BLOCK).to(tl.int64)
    # Row b's queries are b * Q .. b * Q + Q - 1; with fewer than k + 1 the rest read as 0,
    # as `SpecState.per_row` leaves them.
    tokens = tl.load(Sampled + b * Q + j, mask=j < Q, other=0).to(tl.int64)
    proposals = tl.load(Proposals + b * K + j, mask=j < K, other=0)
    count = tl.load(Count + b).to(tl.int64)
    # Accepted: the leading proposals equal to the target's samples, within count (which
    # `prepare` already cut to the row's k_row): the first miss's index, or K after none.
    miss = ((tokens != proposals) | (j >= count)) & (j < K)
    accepted = tl.min(tl.where(miss, j, K), axis=0)
    slot = tl.load(Slots + b).to(tl.int64)
    length = tl.load(Lengths + b).to(tl.int64)
    # All k + 1 samples from `length` on, as `SpecState.finish`: past accepted + 1 they are
    # stale and lie past the new length, unread.
    emit = j < K + 1
    tl.store(History + slot * stride_h + length + j, tokens.to(History.dtype.element_ty), mask=emit)
    # Padding rows (slot 0) keep row 0 empty, as `finish`.
    tl.store(Length + slot, tl.where(slot == 0, 0, length + accepted + 1))
    last = tl.sum(tl.where(j == accepted, tokens, 0), axis=0)  # the last emitted token
    tl.store(Relay + slot, last)
    tl.store(RelayCopy + slot, last)
    row = Packed + b * (K + 3)
    tl.store(row, accepted)
    tl.store(row + 1, count)
    tl.store(row + 2 + j, tokens, mask=emit)


def settle_greedy(sampled: torch.Tensor, queries: int, proposals: torch.Tensor, count: torch.Tensor,
                  lengths: torch.Tensor, slots: torch.Tensor, history: torch.Tensor, length: torch.Tensor,
                  relay: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """A greedy verify step's verdict and settling (`graphs.settle` of
    `SpecState.point_mass_verdict`): `sampled` [B * queries], the target's argmax at each query
    (row-major); `proposals` [B, k] with `count` [B] valid; `lengths` [B], the rows' lengths
    before the step. Writes history[slots, lengths + j] (j <= k), length[slots] and the relay
    `relay` (the FutureMap's buffers, `FutureMap.stash_buffers`); returns the packed result
    [B * (k + 3)] int64, row b = [accepted, count, tokens[0..k]]. Rows have distinct slots but
    padding rows (slot 0); fixed shapes, no host read (graph-capturable)."""
    B, k = proposals.shape
    assert sampled.shape == (B * queries,) and 1 <= queries <= k + 1 and history.stride(1) == 1
    packed = torch.empty(B * (k + 3), dtype=torch.int64, device=sampled.device)
    if B == 0:
        return packed
    _settle_greedy_kernel[(B,)](
        sampled, proposals, count, lengths, slots, history, history.stride(0), length, relay[0], relay[1], packed,
        queries, k, BLOCK=next_power_of_2(k + 1), num_warps=1)
    return packed
