"""What the scheduler hands the runner: host-side facts about one step, no tensors."""
from dataclasses import dataclass
from functools import cached_property

from tandem.request import Request


@dataclass
class Row:
    """One request's share of a step."""

    req: Request
    start: int  # position of the first new token
    kv_slots: list[int]  # cache slots of the new tokens
    prefill_ids: list[int] | None  # known input ids; None for a decode row (ids come from the FutureMap)
    sample_index: int | None  # output index sampled at this row's last token; None: no sample
    # KV slots of positions [0, len) reused from the prefix cache, to write into the request's
    # table row before this row's attention reads it; None when the row holds nothing new.
    cached_prefix: list[int] | None = None
    # A verify row (speculative decoding): its length lives on the device and `kv_slots` are
    # slots newly reserved past the request's table; it scores its last token and up to
    # spec_k proposals and emits 1 to spec_k + 1 tokens. None: a row planned from host facts.
    spec_k: int | None = None
    length_bound: int = 0  # verify rows: the most tokens the request can have before the step
    # Verify rows: the table position of kv_slots[0] (the request's slots before this step's
    # reservations). A row field, not the request's, so tensor-parallel workers get it.
    reserved_from: int = 0
    # Prompt logprobs: the positions [a, b) of this prefill row whose logits score prompt
    # tokens a + 1 .. b (Request.prompt_logprob_span); None: none asked or owed.
    prompt_logprobs: tuple[int, int] | None = None

    @property
    def num_new(self) -> int:
        """Tokens this row computes (a verify row: its query tokens)."""
        return len(self.kv_slots) if self.spec_k is None else self.spec_k + 1


@dataclass
class ScheduledBatch:
    """One planned step. Immutable once built (nobody edits `rows` or a row's fields after the
    scheduler returns it), so its derived facts are computed once: the engine, the runner and
    the step record each read them, and at 256 rows each scan is host time on every step."""

    step: int
    rows: list[Row]
    # Host ms its plan took while the step before it was in flight (`Scheduler.plan_ahead`);
    # None: planned when it was due.
    planned_ahead_ms: float | None = None
    # The prefix tree's split count once planned (`RadixCache.splits`): the cascade planner's
    # read paths, kept between steps, hold while it stays the same.
    tree_splits: int = 0

    @cached_property
    def is_decode(self) -> bool:
        return all(r.prefill_ids is None for r in self.rows)

    @cached_property
    def has_prefill(self) -> bool:
        return not self.is_decode  # any(prefill row) is not all(decode rows), empty included

    @cached_property
    def num_tokens(self) -> int:
        return sum(r.num_new for r in self.rows)

    @cached_property
    def is_verify(self) -> bool:
        """A speculative step: every row is a verify row (lengths on the device)."""
        return bool(self.rows) and self.rows[0].spec_k is not None

    @cached_property
    def sample_rows(self) -> list[Row]:
        return [r for r in self.rows if r.sample_index is not None]
