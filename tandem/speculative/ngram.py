"""The n-gram proposer (prompt lookup), batched on the device.

A request's tokens so far (prompt and outputs) live in a device history row, because under
the overlap the host has not seen the last accepted tokens when the next step is planned.
For each row the proposer takes the longest suffix of n tokens (n from `max_n` down to
`min_n`) that occurred earlier in the row, at its most recent earlier occurrence, and
proposes the (up to) k tokens that followed it there. Everything is tensor ops over a
column window the host bounds from the lengths it knows: no host read, graph-capturable
for fixed shapes.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass
class Proposal:
    tokens: Tensor  # [B, k] int64; entries at or beyond `count` are 0
    count: Tensor  # [B] int64 in [0, k]: how many of `tokens` are proposals
    # A draft model's: [B, k, V] float32, the distribution each proposal was drawn from (a
    # point mass for greedy rows). None: point masses (n-gram).
    probs: Tensor | None = None

    def rows(self, n: int) -> "Proposal":
        """The first n rows (a graphed step's real rows)."""
        return Proposal(self.tokens[:n], self.count[:n], None if self.probs is None else self.probs[:n])


def propose_ngram(history: Tensor, lengths: Tensor, k: int, min_n: int, max_n: int,
                  window: tuple[int, int] | None = None) -> Proposal:
    """history [B, T] (token ids, valid in [0, lengths[b])), lengths [B]: the proposals.

    `window` = (lo, hi) limits the columns searched to [lo, hi), a host-known bound (e.g. the
    last few thousand positions of the longest row): matches outside it are not found, which
    only shortens proposals. Rows shorter than min_n + 1 propose nothing.
    """
    if not 1 <= min_n <= max_n:
        raise ValueError(f"need 1 <= min_n <= max_n, got {min_n}, {max_n}")
    B, T = history.shape
    lo, hi = window if window is not None else (0, T)
    lo, hi = max(0, lo), min(T, hi)
    dev = history.device
    best_start = torch.full((B,), -1, dtype=torch.int64, device=dev)  # where the continuation begins
    cols = history[:, lo:hi]
    for n in range(max_n, min_n - 1, -1):
        if hi - lo < n + 1:
            continue
        suffix_at = (lengths - n).clamp(min=0)  # the suffix's first column
        suffix = history.gather(1, suffix_at[:, None] + torch.arange(n, device=dev)[None, :])  # [B, n]
        windows = cols.unfold(1, n, 1)  # [B, hi - lo - n + 1, n]: windows starting at lo + i
        starts = torch.arange(lo, hi - n + 1, device=dev)[None, :]
        hit = (windows == suffix[:, None, :]).all(dim=2)
        # An earlier occurrence, followed by at least one token: it starts before the suffix.
        hit &= (starts < suffix_at[:, None]) & (lengths[:, None] >= n + 1)
        latest = torch.where(hit, starts, -1).amax(dim=1)
        found = (latest >= 0) & (best_start < 0)  # the longest n wins
        best_start = torch.where(found, latest + n, best_start)
    offsets = torch.arange(k, device=dev)[None, :]
    at = best_start[:, None] + offsets
    valid = (best_start[:, None] >= 0) & (at < lengths[:, None])
    tokens = history.gather(1, at.clamp(0, T - 1)).masked_fill(~valid, 0)
    return Proposal(tokens, valid.sum(dim=1))


class NgramProposer:
    """Prompt lookup for the rows of a verify step, each over the last `window` tokens of its
    own device history: fixed shapes, no host value (graph-capturable). `fused`: one Triton
    launch (`tandem.kernels.ngram_match`) instead of the torch form's ~10 kernels per n-gram
    size; the engine fuses wherever its attention runs on Triton."""

    def __init__(self, k: int, min_n: int, max_n: int, window: int, fused: bool = False) -> None:
        self.k, self.min_n, self.max_n, self.window, self.fused = k, min_n, max_n, window, fused

    def propose(self, history: Tensor, lengths: Tensor, slots: Tensor, last: Tensor, k_rows: Tensor,
                max_seq_len: int) -> Proposal:
        """Up to k proposals a row (`last` and `max_seq_len` are the draft model's inputs)."""
        if self.fused:
            from tandem.kernels.ngram_match import ngram_match  # triton is optional: imported where it runs
            return Proposal(*ngram_match(history, slots, lengths, self.k, self.min_n, self.max_n, self.window))
        start = (lengths - self.window).clamp(min=0)
        cols = start[:, None] + torch.arange(self.window, device=slots.device)[None, :]
        recent = history[slots[:, None], cols].to(torch.int64)
        return propose_ngram(recent, lengths - start, self.k, self.min_n, self.max_n)


def propose_ngram_reference(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """The same rule on one host list, written plainly: the tests' oracle."""
    for n in range(max_n, min_n - 1, -1):
        if len(tokens) < n + 1:
            continue
        suffix = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start:start + n] == suffix:
                return tokens[start + n:start + n + k]
    return []


class HostNgramIndex:
    """The host's guess whether the device proposer will find a match: the same rule over the
    tokens the host has seen (one step behind the device, which is close enough: text that is
    being copied keeps matching). A verify row without proposals costs k + 1 query tokens for
    one, so rows whose known suffix occurred nowhere earlier do not speculate, and the planner
    asks for a match of a few tokens (`match_length`): after a one-token match the proposals
    were accepted about one time in seven (docs/benchmarks.md, session 28). Hashes of every
    n-gram (min_n..max_n) followed by a token, over the last `window` tokens when first built,
    then incrementally; a collision only costs a wasted proposal slot."""

    def __init__(self, min_n: int, max_n: int, window: int = 8192) -> None:
        self.min_n, self.max_n, self.window = min_n, max_n, window
        self.seen: set[int] = set()
        self.indexed: int | None = None  # tokens[:indexed] have had their n-grams added

    def matches(self, prompt: list[int], outputs: list[int]) -> bool:
        """Does a suffix of prompt + outputs (min_n..max_n tokens) occur earlier, followed by a token?"""
        return self.match_length(prompt, outputs) > 0

    def match_length(self, prompt: list[int], outputs: list[int]) -> int:
        """The longest n in min_n..max_n whose suffix of prompt + outputs occurs earlier, followed
        by a token (the n-gram the device proposer would match on); 0 if none does."""
        total = len(prompt) + len(outputs)
        if self.indexed is None:
            self.indexed = max(0, total - self.window)
        first = max(0, min(self.indexed, total) - self.max_n)  # the new tokens and the n-grams ending there
        tail = [*prompt[first:], *outputs] if first < len(prompt) else outputs[first - len(prompt):]
        for end in range(max(self.indexed, self.min_n, first), total):  # windows followed by a token
            for n in range(self.min_n, min(self.max_n, end - first) + 1):
                self.seen.add(hash((n, *tail[end - first - n:end - first])))
        self.indexed = max(self.indexed, total)
        for n in range(min(self.max_n, total - 1, len(tail)), self.min_n - 1, -1):
            if hash((n, *tail[len(tail) - n:])) in self.seen:
                return n
        return 0
