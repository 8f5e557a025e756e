"""Per-request-row device state of speculative decoding: token history and sequence length.

Under the overlap the host plans step N+1 before it has seen how many tokens step N's verify
accepted, so the facts that depend on it live on the device (docs/async-model.md,
"Speculative decoding"). Every op here is queued on the forward stream, which orders it
after the step that wrote what it reads: no event is needed between steps.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from tandem.speculative.ngram import Proposal, propose_ngram
from tandem.speculative.verify import accept_point_mass

# The n-gram search looks this far back from each row's end: matches further back are not
# found, which only shortens proposals.
NGRAM_WINDOW = 8192


@dataclass
class SpecStep:
    """A verify step's device tensors from `prepare` to `finish` (kept alive by the step)."""

    lengths: Tensor  # [B] int64: tokens per row before the step, the last one's KV unwritten
    proposal: Proposal  # count already cut to each row's k
    token_row: Tensor  # [T] int64: the row of each query token
    token_offset: Tensor  # [T] int64: j, the query's offset in its row (0: the last token)


class SpecState:
    """history[slot, :length[slot]]: the request's tokens (prompt, then outputs); the last is
    the pending token, whose KV the next step writes. Row 0 is padding."""

    def __init__(self, max_slots: int, max_model_len: int, k: int, min_n: int, max_n: int,
                 device: torch.device) -> None:
        self.k, self.min_n, self.max_n = k, min_n, max_n
        # Width: a verify writes the k + 1 tokens after the last one; all stay below it.
        self.history = torch.zeros((max_slots + 1, max_model_len + k + 2), dtype=torch.int32, device=device)
        self.length = torch.zeros(max_slots + 1, dtype=torch.int64, device=device)
        self.window = min(NGRAM_WINDOW, max_model_len)

    def admit(self, slot: int, tokens: Tensor) -> None:
        """A (re)admitted request: its known tokens ([n] int64 on the device). Its prefill's
        sample then appends the first new one (`record`)."""
        n = tokens.shape[0]
        self.history[slot, :n] = tokens.to(torch.int32)
        # fill_ takes the int as a kernel argument; `length[slot] = n` copies a host scalar
        # (a synchronizing copy: the H200's sync guard caught it).
        self.length[slot:slot + 1].fill_(n)

    def record(self, slots: Tensor, positions: Tensor, token_ids: Tensor) -> None:
        """A plain step sampled `token_ids` at host-known `positions` (the pending tokens)."""
        self.history[slots, positions] = token_ids.to(torch.int32)
        self.length[slots] = positions + 1

    def prepare(self, slots: Tensor, k_rows: Tensor, token_row: Tensor, token_offset: Tensor) -> SpecStep:
        """Proposals for rows `slots` (each cut to its k_rows). Each row searches the last
        `window` tokens of its own history: fixed shapes, no host value (graph-capturable)."""
        lengths = self.length[slots]
        start = (lengths - self.window).clamp(min=0)
        cols = start[:, None] + torch.arange(self.window, device=slots.device)[None, :]
        recent = self.history[slots[:, None], cols].to(torch.int64)
        proposal = propose_ngram(recent, lengths - start, self.k, self.min_n, self.max_n)
        count = torch.minimum(proposal.count, k_rows)
        live = torch.arange(self.k, device=slots.device)[None, :] < count[:, None]
        proposal = Proposal(proposal.tokens.masked_fill(~live, 0), count)
        return SpecStep(lengths, proposal, token_row, token_offset)

    def inputs(self, step: SpecStep, last_tokens: Tensor) -> tuple[Tensor, Tensor]:
        """The query tokens' ids and positions: row b's last token, then its proposals."""
        r, j = step.token_row, step.token_offset
        positions = step.lengths[r] - 1 + j
        drafts = step.proposal.tokens[r, (j - 1).clamp(min=0)]
        return torch.where(j == 0, last_tokens[r], drafts), positions

    def finish(self, step: SpecStep, slots: Tensor, sampled: Tensor) -> tuple[Tensor, Tensor]:
        """Accept the leading proposals equal to the target's samples (`sampled` [T], one per
        query token); append the emitted tokens. Returns (accepted [B], tokens [B, k + 1]):
        row b emits tokens[b, :accepted[b] + 1]."""
        B = slots.shape[0]
        target = torch.zeros((B, self.k + 1), dtype=torch.int64, device=slots.device)
        target[step.token_row, step.token_offset] = sampled
        verdict = accept_point_mass(target, step.proposal.tokens, step.proposal.count)
        cols = step.lengths[:, None] + torch.arange(self.k + 1, device=slots.device)[None, :]
        # Past accepted + 1 these are stale samples; they lie past the new length, unread.
        self.history[slots[:, None], cols] = target.to(torch.int32)
        # Padding rows (slot 0, a graphed step's rows past the batch) stay empty: else every
        # step would lengthen row 0 until its history writes passed the end.
        self.length[slots] = (step.lengths + verdict.accepted + 1).masked_fill(slots == 0, 0)
        return verdict.accepted, target
