"""Sparse logit biases known at schedule time: logit_bias, single-token bad words, min_tokens.

Each request carries its entries as (token id, value) pairs; a value of -inf bans the
token. The runner packs a batch's pairs into `SamplingInputs` (one host-to-device copy
with the other sampling inputs) and the sampler adds them with one scatter-add.
"""
from __future__ import annotations

from typing import Any, Sequence

from tandem.sampling.params import SamplingParams

BAN = float("-inf")
Bias = tuple[tuple[int, float], ...]


def static_bias(params: SamplingParams, tokenizer: Any, vocab_size: int) -> Bias:
    """The request's entries for every step: its logit_bias, then bans for its bad words."""
    entries = dict(params.logit_bias or {})
    if params.bad_words:
        if tokenizer is None:
            raise ValueError("bad_words need a tokenizer; this model has none")
        entries.update((t, BAN) for t in bad_word_ids(params.bad_words, tokenizer))
    bad = [t for t in entries if t >= vocab_size]
    if bad:
        raise ValueError(f"logit_bias token ids must be in [0, {vocab_size}); got {bad[:5]}")
    return tuple(entries.items())


def min_tokens_bias(params: SamplingParams, stop_ids: Sequence[int]) -> Bias:
    """Bans on the ids that would end the request, applied while it is shorter than min_tokens."""
    return tuple((t, BAN) for t in sorted(stop_ids)) if params.min_tokens else ()


def bad_word_ids(words: Sequence[str], tokenizer: Any) -> list[int]:
    """The token of each bad word, as vLLM tokenizes it: on its own and after a space (mid-text).

    A word that takes several tokens would need the previously sampled token to ban its
    last one, which the host learns only after the next step is queued: refused for now.
    """
    ids = []
    for word in words:
        variants = [tokenizer.encode(prefix + word.lstrip(), add_special_tokens=False) for prefix in ("", " ")]
        for toks in variants:
            if len(toks) != 1:
                raise ValueError(f"bad_words: {word!r} is {len(toks)} tokens "
                                 f"({toks[:8]}); only words of one token are supported so far")
            ids.append(toks[0])
    return ids
