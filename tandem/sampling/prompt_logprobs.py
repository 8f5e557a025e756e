"""Prompt logprobs on the device: the LM head over a prefill's scored rows, in bounded chunks.

Row p of a prompt scores prompt token p + 1. For each scored row this gathers the log-softmax
(float32, of the raw logits: no penalty, bias, mask or temperature, as vLLM reports them) at
the actual token, its rank (1-based: tokens with a logprob >= its own, vLLM's count) and the
top k. Only queued device work with host-known shapes: no host sync.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor

# Elements of one chunk's [rows, vocab] float32 logits (64 MiB): a prompt of thousands of
# tokens x a vocabulary of ~150k never materialises whole. Each chunk makes a few temporaries
# of this size (logits, log-softmax, the rank compare); the memory budget's profile runs one.
CHUNK_ELEMENTS = 1 << 24


@dataclass
class PromptLogprobs:
    """One step's scored rows, in the order of the step's rows, on the device (or host)."""

    logprobs: Tensor  # [L] float32: the actual next prompt token's logprob
    ranks: Tensor  # [L] int64, 1-based
    top_ids: Tensor | None  # [L, k] int64, best first; None when k == 0
    top_logprobs: Tensor | None  # [L, k] float32


def chunk_rows(vocab_size: int) -> int:
    """Scored rows per chunk (CHUNK_ELEMENTS read at each call: tests shrink it)."""
    return max(1, CHUNK_ELEMENTS // vocab_size)


def compute_prompt_logprobs(hidden: Tensor, token_idx: Tensor, targets: Tensor, k: int,
                            logits_of: Callable[[Tensor], Tensor], vocab_size: int,
                            rows_per_chunk: int | None = None) -> PromptLogprobs:
    """`hidden` [T, H] the step's last hidden states; `token_idx` [L] the scored rows in it;
    `targets` [L] the prompt token each scores; `logits_of` the model's LM head (float32
    logits; under tensor parallelism a collective every rank runs on the same rows)."""
    n, device = token_idx.shape[0], hidden.device
    step = rows_per_chunk or chunk_rows(vocab_size)
    k = min(k, vocab_size)
    out = PromptLogprobs(torch.empty(n, dtype=torch.float32, device=device),
                         torch.empty(n, dtype=torch.int64, device=device),
                         torch.empty((n, k), dtype=torch.int64, device=device) if k else None,
                         torch.empty((n, k), dtype=torch.float32, device=device) if k else None)
    for a in range(0, n, step):
        b = min(a + step, n)
        logprobs = torch.log_softmax(logits_of(hidden.index_select(0, token_idx[a:b])), dim=-1)
        actual = logprobs.gather(1, targets[a:b, None])
        out.logprobs[a:b] = actual.squeeze(1)
        out.ranks[a:b] = (logprobs >= actual).sum(dim=-1)
        if k:
            top = torch.topk(logprobs, k, dim=-1)
            out.top_logprobs[a:b], out.top_ids[a:b] = top.values, top.indices
    return out
