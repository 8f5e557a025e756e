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
class DecodeColumns:
    """A plain decode step's rows as columns: row i computes the token at `positions[i]` of
    `reqs[i]` into KV slot `kv_locs[i]` and samples its output `sample_indices[i]` (a `Row`
    with `start`, `kv_slots=[loc]`, no prefill ids). The scheduler hands the steady decode step
    over this way (issue 21): at 256 rows a `Row` and its slot list each, and a journal tuple,
    were ~0.1 ms of the host's step on the CPU box; planning, staging and reading the result
    read the columns, and `ScheduledBatch.rows` is built only where something asks for rows."""

    reqs: list[Request]
    positions: list[int]
    kv_locs: list[int]
    sample_indices: list[int]

    def __len__(self) -> int:
        return len(self.reqs)

    def rows(self) -> list[Row]:
        return [Row(req, start, [loc], None, sample)
                for req, start, loc, sample in zip(self.reqs, self.positions, self.kv_locs, self.sample_indices)]


class ScheduledBatch:
    """One planned step. Immutable once built (nobody edits `rows` or a row's fields after the
    scheduler returns it), so its derived facts are computed once: the engine, the runner and
    the step record each read them, and at 256 rows each scan is host time on every step.

    A plain decode step comes as `decode` columns; its `rows` are then made on first use
    (launch failures, tensor-parallel workers, the eager forward)."""

    def __init__(self, step: int, rows: list[Row] | None = None, planned_ahead_ms: float | None = None,
                 tree_splits: int = 0, decode: DecodeColumns | None = None):
        assert (rows is None) != (decode is None), "a batch is rows or decode columns"
        self.step = step
        if rows is not None:
            self.rows = rows  # the cached property's value: given
        self.decode = decode
        # Host ms its plan took while the step before it was in flight (`Scheduler.plan_ahead`);
        # None: planned when it was due.
        self.planned_ahead_ms = planned_ahead_ms
        # The prefix tree's split count once planned (`RadixCache.splits`): the cascade planner's
        # read paths, kept between steps, hold while it stays the same.
        self.tree_splits = tree_splits

    def __repr__(self) -> str:
        kind = "decode columns" if self.decode is not None else "rows"
        return f"ScheduledBatch(step={self.step}, {self.size} {kind})"

    @cached_property
    def rows(self) -> list[Row]:
        return self.decode.rows()

    @cached_property
    def size(self) -> int:
        """Rows in the step (`len(rows)`, without making them)."""
        return len(self.decode) if self.decode is not None else len(self.rows)

    @cached_property
    def columns(self) -> DecodeColumns:
        """A plain decode step's rows as columns: the ones it was planned as, else read once
        from its rows (a worker's or a test's batch; one KV slot a row)."""
        if self.decode is not None:
            return self.decode
        rows = self.rows
        return DecodeColumns([r.req for r in rows], [r.start for r in rows], [r.kv_slots[0] for r in rows],
                             [r.sample_index for r in rows])

    @cached_property
    def reqs(self) -> list[Request]:
        """Each row's request, in row order."""
        return self.decode.reqs if self.decode is not None else [r.req for r in self.rows]

    @cached_property
    def is_decode(self) -> bool:
        return self.decode is not None or all(r.prefill_ids is None for r in self.rows)

    @cached_property
    def has_prefill(self) -> bool:
        return not self.is_decode  # any(prefill row) is not all(decode rows), empty included

    @cached_property
    def num_tokens(self) -> int:
        return len(self.decode) if self.decode is not None else sum(r.num_new for r in self.rows)

    @cached_property
    def is_verify(self) -> bool:
        """A speculative step: every row is a verify row (lengths on the device)."""
        return self.decode is None and bool(self.rows) and self.rows[0].spec_k is not None

    @cached_property
    def sample_rows(self) -> list[Row]:
        return [r for r in self.rows if r.sample_index is not None]

    @cached_property
    def sampled(self) -> tuple[list[Request], list[int]]:
        """The sampling rows' requests and the output index each samples, in row order."""
        if self.decode is not None:
            return self.decode.reqs, self.decode.sample_indices
        rows = self.sample_rows
        return [r.req for r in rows], [r.sample_index for r in rows]

    @cached_property
    def num_sampled(self) -> int:
        return len(self.decode) if self.decode is not None else len(self.sample_rows)
