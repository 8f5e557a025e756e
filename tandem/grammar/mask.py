"""Per-request producers of the allowed-token mask for the request's next sample."""
from typing import Protocol

import torch


class MaskProducer(Protocol):
    """What the engine needs from a rule that depends on the tokens so far (a grammar; also
    usable for multi-token bad words). The host calls `fill_next_mask` once every earlier
    token was passed to `accept`, in the window while the forward of the step runs."""

    def fill_next_mask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write row `row` of `bitmask` ([rows, ceil(V/32)] int32; bit v % 32 of word v // 32
        set = token v allowed)."""

    def accept(self, token: int) -> bool:
        """Advance by a sampled token; False if the rule forbids it."""

    def is_terminated(self) -> bool:
        """True when the output is complete: the request finishes with reason "stop"."""


class GrammarMask:
    """A MaskProducer backed by an xgrammar matcher (its masks are batch-filled in C++)."""

    def __init__(self, compiled, stop_ids: frozenset[int]) -> None:
        import xgrammar

        self.matcher = xgrammar.GrammarMatcher(compiled)
        self.stop_ids = stop_ids  # the matcher terminates only by accepting one of these
        self.terminated = False

    def fill_next_mask(self, bitmask: torch.Tensor, row: int) -> None:
        self.matcher.fill_next_token_bitmask(bitmask, row)

    def accept(self, token: int) -> bool:
        ok = self.matcher.accept_token(token)
        # One call into the matcher per token, not two, on the host's per-step path.
        self.terminated = ok and token in self.stop_ids and self.matcher.is_terminated()
        return ok

    def is_terminated(self) -> bool:
        return self.terminated
