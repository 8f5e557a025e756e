"""The draft-model proposer: a small model with the target's tokenizer proposes k tokens a row.

Its KV cache has the target pool's slots: a request's position p lives at the same KV
location in both, so the target's table, allocator and prefix cache serve the draft too.
The rule that keeps it right: **the draft's KV is valid wherever the target's is.**
- Every prefill, plain decode and mixed step of the target also runs the draft's forward over
  the same batch (`mirror`: KV only, no logits), in the same stream order.
- A verify step's proposal runs k + 1 draft forwards of one query a row before the target's
  verify forward: input d_i at position L - 1 + i (d_0 the row's last token, L its length),
  the logits of steps 0..k-1 give d_1..d_k; step k only writes d_k's KV. The target then
  writes positions L - 1 .. L - 1 + k from the same inputs, so after the verdict both caches
  hold the accepted tokens' KV and nothing else is read (positions past the new length are
  rewritten before any later query reads them).
Queries past a row's k_row have no reserved KV slot: they write the dummy slot 0, as the
verify's do.

Draws: greedy rows propose the draft's argmax (a point mass); sampled rows draw from the
draft's softmax at the request's temperature with counter-based keys of (seed ^ salt, output
index), and the verify's rejection step reads that distribution (`Proposal.probs`). The
draft's distribution may be anything for the rejection step to keep the target's; top-k/top-p
apply to the target only.

Coupled (`Experiments.spec_coupled_draft`): sampled rows draw with plain sampling's own key of
the output index (no salt), the Gumbel noise the target adds to its logits there; the verify
treats the draws as point masses (no `Proposal.probs`). A proposal is accepted where the
target's noisy argmax is the draft's, and every emitted token is the target's own sample:
plain decoding's tokens, whichever steps speculate.
"""
from __future__ import annotations

import torch
from torch import Tensor

from tandem.memory.kv_cache import KVCache
from tandem.memory.req_to_token import ReqToTokenTable
from tandem.sampling.inputs import seed_to_int64
from tandem.sampling.noise import gumbel_argmax, row_keys
from tandem.forward_batch import query_rows_batch
from tandem.speculative.ngram import Proposal

# Draft draws use other noise than the target's draws at the same output index.
DRAFT_SEED_SALT = 0x2545_F491_4F6C_DD1D


class DraftProposer:
    def __init__(self, model, kv: KVCache, backend, table: ReqToTokenTable, k: int, token_hash: Tensor,
                 max_slots: int, device: torch.device, coupled: bool = False) -> None:
        self.model, self.kv, self.backend, self.table, self.k = model, kv, backend, table, k
        self.token_hash, self.coupled = token_hash, coupled
        # Per request row, written at admission (fill_: no host sync): what draws need.
        self.temperature = torch.zeros(max_slots + 1, dtype=torch.float32, device=device)
        self.seed = torch.zeros(max_slots + 1, dtype=torch.int64, device=device)
        self.prompt_len = torch.zeros(max_slots + 1, dtype=torch.int64, device=device)

    def admit(self, slot: int, prompt_len: int, temperature: float, seed: int) -> None:
        self.temperature[slot:slot + 1].fill_(float(temperature))
        # Coupled: plain sampling's key, so a draw shares the target's noise at its output index.
        self.seed[slot:slot + 1].fill_(seed_to_int64(seed if self.coupled else seed ^ DRAFT_SEED_SALT))
        self.prompt_len[slot:slot + 1].fill_(prompt_len)

    def mirror(self, batch) -> None:
        """The draft's KV for every token of a target step (`batch`, the target's ForwardBatch)."""
        self.model(batch, self.kv, self.backend)

    def propose(self, history: Tensor, lengths: Tensor, slots: Tensor, last: Tensor, k_rows: Tensor,
                max_seq_len: int) -> Proposal:
        """k proposals a row (the caller cuts them to k_rows), their draft distributions."""
        table = self.table.table
        width = table.shape[1]
        temperature = self.temperature[slots]
        greedy = temperature == 0
        scale = torch.where(greedy, 1.0, temperature)[:, None]
        tokens, probs, ids = [], [], last
        for i in range(self.k + 1):
            positions = (lengths - 1 + i).clamp(min=0)  # padding rows have length 0
            live = i <= k_rows
            locs = torch.where(live, table[slots, positions.clamp(max=width - 1)].to(torch.int64), 0)
            hidden = self.model(query_rows_batch(ids, positions, locs, slots, table, max_seq_len),
                                self.kv, self.backend)
            if i == self.k:  # d_k's KV only
                break
            logits = self.model.compute_logits(hidden).to(torch.float32)
            ids, q = self._draw(logits, greedy, scale, self._keys(slots, lengths + i))
            tokens.append(ids)
            probs.append(q)
        return Proposal(torch.stack(tokens, dim=1), k_rows.clone(), None if self.coupled else torch.stack(probs, dim=1))

    def _keys(self, slots: Tensor, position: Tensor) -> Tensor:
        """The draw's key of the token at `position`: its output index, salted seed."""
        return row_keys(self.seed[slots], position - self.prompt_len[slots])

    def _draw(self, logits: Tensor, greedy: Tensor, scale: Tensor, keys: Tensor) -> tuple[Tensor, Tensor | None]:
        """(token [B], its distribution [B, V]): argmax and a point mass for greedy rows.
        Coupled: no distribution (the verify takes the draws as point masses)."""
        scaled = logits / scale
        point = logits.argmax(dim=-1)
        token = torch.where(greedy, point, gumbel_argmax(scaled, keys, self.token_hash))
        if self.coupled:
            return token, None
        one_hot = torch.nn.functional.one_hot(point, logits.shape[1]).to(torch.float32)
        return token, torch.where(greedy[:, None], one_hot, scaled.softmax(dim=-1))


def check_draft(draft_config, draft_tokenizer, target_config, target_tokenizer) -> None:
    """ValueError unless the draft proposes the target's tokens: the same vocabulary size and,
    where both checkpoints carry a tokenizer, the same token -> id map."""
    if draft_config.vocab_size != target_config.vocab_size:
        raise ValueError(f"speculative_config: the draft model's vocabulary has {draft_config.vocab_size} "
                         f"tokens, the target's {target_config.vocab_size}: a draft model must use the "
                         "target's tokenizer")
    if draft_tokenizer is None or target_tokenizer is None:
        return
    draft_vocab, target_vocab = draft_tokenizer.get_vocab(), target_tokenizer.get_vocab()
    if draft_vocab != target_vocab:
        differ = sorted(set(draft_vocab.items()) ^ set(target_vocab.items()), key=lambda kv: kv[1])[:3]
        raise ValueError("speculative_config: the draft model's tokenizer differs from the target's "
                         f"(e.g. {', '.join(f'{t!r} -> {i}' for t, i in differ)}): a draft model must use "
                         "the target's tokenizer")
