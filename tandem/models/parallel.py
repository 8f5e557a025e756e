"""Tensor-parallel layers: the vocab-parallel embedding and lm head (row-parallel linears are
`tandem.models.linear.Linear` with the all-reduce as their `reduce`).

Column-parallel layers (packed qkv, packed gate/up) need no class of their own: they are
plain linears over this rank's output rows (see `tandem.distributed.sharding`). With one
rank every layer here is the plain one and communicates nothing.
"""
import torch
import torch.nn.functional as F
from torch import nn

from tandem.distributed.group import TPGroup


class VocabParallelEmbedding(nn.Module):
    """Rows [start, start + rows) of the (padded) vocab; other ids look up zeros, and the
    all-reduce assembles every token's row."""

    def __init__(self, rows: int, hidden: int, start: int, tp: TPGroup):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(rows, hidden))
        self.start, self.rows, self.tp = start, rows, tp

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.start
        outside = (local < 0) | (local >= self.rows)
        x = F.embedding(local.masked_fill(outside, 0), self.weight)
        return self.tp.all_reduce(x.masked_fill(outside.unsqueeze(-1), 0.0))


def parallel_logits(hidden: torch.Tensor, weight: torch.Tensor, vocab_size: int, tp: TPGroup) -> torch.Tensor:
    """Full float32 logits [N, vocab_size] on every rank from this rank's vocab rows: gathered
    in the weights' dtype (half the bytes), padding columns cut off so they are never sampled."""
    logits = tp.all_gather_last(hidden @ weight.t())
    if logits.shape[-1] != vocab_size:
        logits = logits[..., :vocab_size]
    return logits.float()
