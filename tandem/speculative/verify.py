"""Exact verification of proposed tokens, on the device, without a host read.

The target model scores a row's last token and its k proposals in one forward: k + 1
positions, position j predicting the token after proposal j - 1.

Point-mass proposals (n-gram, and any proposal checked against greedy rows): sample the
target at every position exactly as plain decoding would at that output index (same
logits processing, same counter-based noise key), accept the leading proposals that equal
those samples, and emit the samples up to and including the first that differs (or the
bonus after all k). While every earlier proposal was accepted, position j's prefix is the
one plain decoding would have had, so each emitted token is the token plain decoding emits:
the output is token-identical with the same seed, greedy or sampled. (In distribution this
is rejection sampling with q a point mass: accept d with probability p(d), else sample p
restricted to other tokens.)

Draft-model proposals with q a distribution: standard rejection sampling (Leviathan et
al. 2023; Chen et al. 2023): accept d_j when u_j * q_j(d_j) <= p_j(d_j), else emit a sample
of the residual max(p_j - q_j, 0), normalized; after k acceptances emit a sample of p_k.
The target's distribution is preserved; uniforms and residual draws come from counter-based
keys, so a seeded request is reproducible.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from tandem.sampling.noise import _mix32, gumbel_argmax


@dataclass
class Verdict:
    accepted: Tensor  # [B] int64: leading proposals accepted, in [0, count]
    tokens: Tensor  # [B, k + 1] int64: the emitted tokens are tokens[b, :accepted[b] + 1]

    @property
    def emitted(self) -> Tensor:
        return self.accepted + 1


def accept_point_mass(target_ids: Tensor, proposals: Tensor, count: Tensor) -> Verdict:
    """target_ids [B, k + 1]: the target's own sample at each position; proposals [B, k] with
    `count` [B] valid. Accepted = the leading proposals equal to the target's samples."""
    k = proposals.shape[1]
    live = torch.arange(k, device=proposals.device)[None, :] < count[:, None]
    same = (target_ids[:, :k] == proposals) & live
    accepted = same.to(torch.int64).cumprod(dim=1).sum(dim=1)
    return Verdict(accepted, target_ids)


def uniforms(keys: Tensor, salt: int = 0x5BD1E995) -> Tensor:
    """[...] float64 in (0, 1), a pure function of each int64 key (32 significant bits)."""
    h = _mix32((keys ^ salt) & 0xFFFF_FFFF)
    return (h.to(torch.float64) + 0.5) * (1.0 / 4294967296.0)


def accept_rejection(target_probs: Tensor, draft_probs: Tensor, proposals: Tensor, count: Tensor,
                     keys: Tensor, token_hash: Tensor) -> Verdict:
    """target_probs [B, k + 1, V], draft_probs [B, k, V] (the distributions the target and the
    draft sampled from, after every logits processor), proposals [B, k] drawn from the draft,
    `count` [B] valid, keys [B, k + 1] int64 counter-based keys of the positions' output
    indices. Returns the emitted tokens (their distribution is the target's)."""
    B, k = proposals.shape
    p_at = target_probs[:, :k].gather(2, proposals[..., None]).squeeze(2)
    q_at = draft_probs.gather(2, proposals[..., None]).squeeze(2)
    live = torch.arange(k, device=proposals.device)[None, :] < count[:, None]
    ok = (uniforms(keys[:, :k]) * q_at.to(torch.float64) <= p_at.to(torch.float64)) & live
    accepted = ok.to(torch.int64).cumprod(dim=1).sum(dim=1)
    # Each position's replacement: the residual where a proposal stood, else p itself (a
    # position past `count`, or the bonus after k acceptances). Drawn for every position,
    # then the one at `accepted` is used: fixed shapes, no host read.
    residual = (target_probs[:, :k] - draft_probs).clamp(min=0)
    residual = torch.where(live[..., None] & (residual.sum(dim=2, keepdim=True) > 0), residual,
                           target_probs[:, :k])
    dist = torch.cat([residual, target_probs[:, k:]], dim=1)  # [B, k + 1, V]
    logp = torch.where(dist > 0, dist.log(), float("-inf")).flatten(0, 1).float()
    draws = gumbel_argmax(logp, keys.flatten(), token_hash)
    draws = draws.view(B, k + 1)
    tokens = torch.cat([proposals, proposals[:, :1]], dim=1)  # accepted proposals, then one draw
    tokens = torch.where(torch.arange(k + 1, device=proposals.device)[None, :] == accepted[:, None],
                         draws, tokens)
    return Verdict(accepted, tokens)
