"""Counters of speculative decoding, as vLLM names them (`spec_decode_num_*`)."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecCounters:
    k: int  # proposals a row may verify per step (0: speculation off)
    num_drafts: int = 0  # verify rows that carried at least one proposal
    num_draft_tokens: int = 0  # proposals verified
    num_accepted_tokens: int = 0  # proposals accepted (each a token emitted without its own step)
    verify_steps: int = 0  # steps planned as verify steps (lengths on the device)
    accepted_per_position: list[int] = field(default_factory=list)  # [j]: rows that accepted proposal j

    def __post_init__(self) -> None:
        self.accepted_per_position = [0] * self.k

    def count(self, proposed: int, accepted: int) -> None:
        if proposed:
            self.num_drafts += 1
            self.num_draft_tokens += proposed
            self.num_accepted_tokens += accepted
            for j in range(accepted):
                self.accepted_per_position[j] += 1

    def as_dict(self) -> dict:
        """For engine.stats(): the counters, and the mean tokens a draft emits (acceptance length)."""
        return {"spec_decode_num_drafts": self.num_drafts,
                "spec_decode_num_draft_tokens": self.num_draft_tokens,
                "spec_decode_num_accepted_tokens": self.num_accepted_tokens,
                "spec_decode_num_accepted_tokens_per_pos": list(self.accepted_per_position),
                "spec_decode_verify_steps": self.verify_steps,
                "spec_decode_mean_acceptance_length": (1 + self.num_accepted_tokens / self.num_drafts
                                                       if self.num_drafts else None)}
