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

from tandem.speculative.draft import DraftProposer
from tandem.speculative.ngram import NgramProposer, Proposal
from tandem.speculative.verify import Verdict, accept_point_mass

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

    def __init__(self, max_slots: int, max_model_len: int, k: int, device: torch.device,
                 proposer: NgramProposer | DraftProposer) -> None:
        self.k, self.proposer = k, proposer
        # Width: a verify writes the k + 1 tokens after the last one; all stay below it.
        self.history = torch.zeros((max_slots + 1, max_model_len + k + 2), dtype=torch.int32, device=device)
        self.length = torch.zeros(max_slots + 1, dtype=torch.int64, device=device)

    @staticmethod
    def ngram(max_slots: int, max_model_len: int, k: int, min_n: int, max_n: int,
              device: torch.device, fused: bool = False) -> "SpecState":
        return SpecState(max_slots, max_model_len, k, device,
                         NgramProposer(k, min_n, max_n, min(NGRAM_WINDOW, max_model_len), fused))

    @property
    def draft(self) -> DraftProposer | None:
        """The draft model, when it proposes: every target forward also writes its KV."""
        return self.proposer if isinstance(self.proposer, DraftProposer) else None

    def admit(self, slot: int, tokens: Tensor, prompt_len: int, temperature: float, seed: int) -> None:
        """A (re)admitted request: its known tokens ([n] int64 on the device). Its prefill's
        sample then appends the first new one (`record`)."""
        n = tokens.shape[0]
        self.history[slot, :n] = tokens.to(torch.int32)
        # fill_ takes the int as a kernel argument; `length[slot] = n` copies a host scalar
        # (a synchronizing copy: the H200's sync guard caught it).
        self.length[slot:slot + 1].fill_(n)
        if self.draft is not None:
            self.draft.admit(slot, prompt_len, temperature, seed)

    def record(self, slots: Tensor, input_positions: Tensor, token_ids: Tensor) -> None:
        """A plain step sampled `token_ids` after inputs at host-known `input_positions`: the
        pending tokens, at input_positions + 1."""
        if slots.is_cuda:  # one launch instead of ~6 (host time: a plain step's critical path)
            from tandem.kernels.token_history import append_sampled
            append_sampled(self.history, self.length, slots, input_positions, token_ids)
            return
        positions = input_positions + 1
        self.history[slots, positions] = token_ids.to(torch.int32)
        self.length[slots] = positions + 1

    def prepare(self, slots: Tensor, k_rows: Tensor, token_row: Tensor, token_offset: Tensor,
                last: Tensor, max_seq_len: int) -> SpecStep:
        """Proposals for rows `slots` (each cut to its k_rows) whose last tokens are `last`:
        fixed shapes, no host value (graph-capturable); `max_seq_len` bounds every length."""
        lengths = self.length[slots]
        proposal = self.proposer.propose(self.history, lengths, slots, last, k_rows, max_seq_len)
        count = torch.minimum(proposal.count, k_rows)
        live = torch.arange(self.k, device=slots.device)[None, :] < count[:, None]
        proposal = Proposal(proposal.tokens.masked_fill(~live, 0), count, proposal.probs)
        return SpecStep(lengths, proposal, token_row, token_offset)

    def prepare_unproposed(self, slots: Tensor, k_rows: Tensor, token_row: Tensor, token_offset: Tensor,
                           last: Tensor, max_seq_len: int) -> SpecStep:
        """`prepare` for a step where no row proposes (every k_row is 0, the host knows it):
        the empty proposal `prepare` cuts to, without the n-gram search over the history (a
        one-query verify graph's largest launch). A draft model still runs `prepare`: its
        forward writes the draft's KV of each row's last token, which later steps read."""
        if self.draft is not None:
            return self.prepare(slots, k_rows, token_row, token_offset, last, max_seq_len)
        lengths = self.length[slots]
        B = slots.shape[0]
        empty = Proposal(torch.zeros((B, self.k), dtype=torch.int64, device=slots.device),
                         torch.zeros(B, dtype=torch.int64, device=slots.device))
        return SpecStep(lengths, empty, token_row, token_offset)

    def inputs(self, step: SpecStep, last_tokens: Tensor) -> tuple[Tensor, Tensor]:
        """The query tokens' ids and positions: row b's last token, then its proposals."""
        r, j = step.token_row, step.token_offset
        positions = step.lengths[r] - 1 + j
        drafts = step.proposal.tokens[r, (j - 1).clamp(min=0)]
        return torch.where(j == 0, last_tokens[r], drafts), positions

    def per_row(self, step: SpecStep, per_query: Tensor) -> Tensor:
        """[T, ...] values, one per query token, as [B, k + 1, ...] (zeros where a row has
        fewer queries)."""
        B = step.lengths.shape[0]
        out = per_query.new_zeros((B, self.k + 1, *per_query.shape[1:]))
        out[step.token_row, step.token_offset] = per_query
        return out

    def proposal_counts(self, step: SpecStep, vocab_size: int) -> Tensor:
        """[T, V] int32: per query, the row's proposals before it (query j follows proposals
        1..j), which penalties count as outputs while every one of them is accepted."""
        live = torch.arange(self.k, device=step.lengths.device)[None, :] < step.proposal.count[:, None]
        one_hot = torch.nn.functional.one_hot(step.proposal.tokens, vocab_size).to(torch.int32) * live[..., None]
        before = torch.cat([torch.zeros_like(one_hot[:, :1]), one_hot.cumsum(dim=1, dtype=torch.int32)], dim=1)
        return before[step.token_row, step.token_offset]

    def point_mass_verdict(self, step: SpecStep, sampled: Tensor) -> Verdict:
        """Accept the leading proposals equal to the target's samples (`sampled` [T], one per
        query token)."""
        return accept_point_mass(self.per_row(step, sampled), step.proposal.tokens, step.proposal.count)

    def finish(self, step: SpecStep, slots: Tensor, verdict: Verdict) -> tuple[Tensor, Tensor]:
        """Append each row's emitted tokens, verdict.tokens[b, :accepted[b] + 1], to its
        history and length. Returns (accepted [B], tokens [B, k + 1])."""
        target = verdict.tokens
        cols = step.lengths[:, None] + torch.arange(self.k + 1, device=slots.device)[None, :]
        # Past accepted + 1 these are stale samples; they lie past the new length, unread.
        self.history[slots[:, None], cols] = target.to(torch.int32)
        # Padding rows (slot 0, a graphed step's rows past the batch) stay empty: else every
        # step would lengthen row 0 until its history writes passed the end.
        self.length[slots] = (step.lengths + verdict.accepted + 1).masked_fill(slots == 0, 0)
        return verdict.accepted, target
