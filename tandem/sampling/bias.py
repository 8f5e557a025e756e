"""Sparse logit biases known at schedule time: logit_bias, single-token bad words, min_tokens;
and multi-token bad words, which depend on the sampled tokens (a per-step mask).

Each request carries its entries as (token id, value) pairs; a value of -inf bans the
token. The runner packs a batch's pairs into `SamplingInputs` (one host-to-device copy
with the other sampling inputs) and the sampler adds them with one scatter-add.
"""
from __future__ import annotations

from typing import Any, Sequence

import torch

from tandem.sampling.params import SamplingParams

BAN = float("-inf")
Bias = tuple[tuple[int, float], ...]


def static_bias(params: SamplingParams, tokenizer: Any, vocab_size: int) -> tuple[Bias, list[list[int]]]:
    """The request's entries for every step (its logit_bias, then bans for single-token bad
    words), and the bad words of several tokens, which need the tokens sampled so far
    (`BadWordsMask`, through the per-step mask path)."""
    entries, multi = dict(params.logit_bias or {}), []
    if params.bad_words:
        if tokenizer is None:
            raise ValueError("bad_words need a tokenizer; this model has none")
        single, multi = bad_word_ids(params.bad_words, tokenizer)
        entries.update((t, BAN) for t in single)
    bad = [t for t in entries if t >= vocab_size]
    if bad:
        raise ValueError(f"logit_bias token ids must be in [0, {vocab_size}); got {bad[:5]}")
    return tuple(entries.items()), multi


def min_tokens_bias(params: SamplingParams, stop_ids: Sequence[int]) -> Bias:
    """Bans on the ids that would end the request, applied while it is shorter than min_tokens."""
    return tuple((t, BAN) for t in sorted(stop_ids)) if params.min_tokens else ()


def bad_word_ids(words: Sequence[str], tokenizer: Any) -> tuple[list[int], list[list[int]]]:
    """Each bad word as vLLM tokenizes it, on its own and after a space (mid-text): the
    single-token ones, and the token sequences of the longer ones."""
    single, multi = [], []
    for word in words:
        for prefix in ("", " "):
            toks = list(tokenizer.encode(prefix + word.lstrip(), add_special_tokens=False))
            if len(toks) == 1:
                single.append(toks[0])
            elif toks and toks not in multi:
                multi.append(toks)
    return single, multi


class BadWordsMask:
    """Multi-token bad words as a mask producer (tandem.grammar.MaskProducer): the last token
    of a bad word is banned when the tokens before it end the text so far. The host fills the
    mask after processing the previous step, while the forward runs (the grammar's path)."""

    def __init__(self, vocab_size: int, words: list[list[int]], prompt_token_ids: Sequence[int]):
        self.words = words
        self.longest = max(len(w) for w in words)
        self.history = list(prompt_token_ids[-self.longest:])
        self.row = torch.full(((vocab_size + 31) // 32,), -1, dtype=torch.int32)

    def fill_next_mask(self, bitmask: torch.Tensor, row: int) -> None:
        words = self.row.clone()
        for w in self.words:
            if len(self.history) >= len(w) - 1 and self.history[len(self.history) - len(w) + 1:] == w[:-1]:
                t = w[-1]
                bits = int(words[t // 32]) & ~(1 << (t % 32)) & 0xFFFFFFFF
                words[t // 32] = bits - (1 << 32) if bits >= 1 << 31 else bits  # as int32
        bitmask[row] = words

    def accept(self, token: int) -> bool:
        self.history = (self.history + [token])[-self.longest:]
        return True

    def is_terminated(self) -> bool:
        return False
