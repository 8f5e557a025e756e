"""Prompt lookup in one launch: each row's longest recent suffix found earlier in its own
history, and the tokens that followed it there.

The torch form (`tandem.speculative.ngram.propose_ngram`) takes ~10 small kernels per n-gram
size over a gathered [B, window] copy; at batch 1 of a small model those launches are a
visible part of a verify step. Here one program per row scans the row's last `window`
columns in place: for each candidate end column e it counts how many of the row's last
MAX_N tokens match backwards from e (m(e)), keeps the largest m (>= MIN_N), the latest e
among those, and copies the up to K tokens after it. Same rule as the torch form: the longest
n wins, then its most recent earlier occurrence.
"""
import torch
import triton
import triton.language as tl

from tandem.kernels.grid import next_power_of_2


@triton.jit
def _ngram_match_kernel(
    History, stride_h, Slots, Lengths, Tokens, Count,
    WINDOW, K,
    MIN_N: tl.constexpr, MAX_N: tl.constexpr, BLOCK: tl.constexpr, BLOCK_K: tl.constexpr,
):
    b = tl.program_id(0)
    row = History + tl.load(Slots + b).to(tl.int64) * stride_h
    length = tl.load(Lengths + b).to(tl.int64)
    lo = tl.maximum(length - WINDOW, 0)  # the first column searched
    # An n-gram and the suffix both lie in the window, and a token follows the n-gram.
    # (As a block: Triton's interpreter rejects masks mixing scalars and blocks.)
    n_cap = tl.zeros((BLOCK,), tl.int64) + tl.minimum(length - lo - 1, MAX_N)
    scale = WINDOW + 1  # score = m * scale + (e - lo): the largest m, then the latest e
    best = tl.full((BLOCK,), -1, tl.int64)
    for start in range(0, WINDOW, BLOCK):
        e = lo + start + tl.arange(0, BLOCK).to(tl.int64)  # candidate end columns
        in_range = e < length - 1  # followed by a token, before the suffix's end
        alive = in_range
        m = tl.zeros((BLOCK,), tl.int64)
        for t in tl.static_range(MAX_N):
            want = tl.load(row + tl.maximum(length - 1 - t, 0))  # used only where n_cap > t
            ok = alive & (e - t >= lo) & (n_cap > t)
            got = tl.load(row + e - t, mask=ok, other=-2)
            alive = ok & (got == want)
            m += alive.to(tl.int64)
        score = tl.where(m >= MIN_N, m * scale + (e - lo), -1)
        best = tl.maximum(best, score)
    top = tl.max(best, axis=0)
    j = tl.arange(0, BLOCK_K)
    follow = tl.zeros((BLOCK_K,), tl.int64) + tl.where(top >= 0, lo + top % scale + 1, -1)  # continuation
    at = follow + j
    valid = (follow >= 0) & (j < K) & (at < length)
    tokens = tl.load(row + at, mask=valid, other=0).to(tl.int64)
    tl.store(Tokens + b * K + j, tokens, mask=j < K)
    tl.store(Count + b, tl.sum(valid.to(tl.int64), axis=0))


def ngram_match(history: torch.Tensor, slots: torch.Tensor, lengths: torch.Tensor, k: int,
                min_n: int, max_n: int, window: int) -> tuple[torch.Tensor, torch.Tensor]:
    """history [S, T] int32 token rows, rows `slots` [B] of valid length `lengths` [B]:
    (tokens [B, k] int64, zero past count; count [B] int64), searching each row's last
    `window` columns. Fixed shapes, no host value: graph-capturable."""
    assert history.stride(1) == 1 and 1 <= min_n <= max_n and k >= 1
    B = slots.shape[0]
    tokens = torch.empty((B, k), dtype=torch.int64, device=history.device)
    count = torch.empty(B, dtype=torch.int64, device=history.device)
    if B == 0:
        return tokens, count
    _ngram_match_kernel[(B,)](
        history, history.stride(0), slots, lengths, tokens, count, window, k,
        MIN_N=min_n, MAX_N=max_n, BLOCK=min(1024, next_power_of_2(window)),
        BLOCK_K=next_power_of_2(k), num_warps=4)
    return tokens, count
