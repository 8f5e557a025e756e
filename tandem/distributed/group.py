"""The tensor-parallel group as the model layers see it: a rank, a size, two collectives.

Passed explicitly to the layers that communicate (no global state read by forward). The
collectives run on the default torch.distributed group, which the engine initializes
before the first forward; with size 1 they are identities and torch.distributed is never
touched.
"""
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TPGroup:
    rank: int = 0
    size: int = 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of `x` over the ranks, in place (captured into CUDA graphs like any kernel)."""
        if self.size > 1:
            dist.all_reduce(x)
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """[m, n] on every rank -> [m, size * n], rank-major along the last dimension."""
        if self.size == 1:
            return x
        m, n = x.shape
        out = torch.empty((self.size * m, n), dtype=x.dtype, device=x.device)
        _all_gather(out, x.contiguous())
        return out.view(self.size, m, n).transpose(0, 1).reshape(m, self.size * n)


SINGLE = TPGroup()


# torch renamed it (the old name warns from 2.13 on); accept both across supported versions.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
