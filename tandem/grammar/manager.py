"""The engine's side of structured output: admission after compilation, matcher advance,
and each step's mask fill and copy (timed, for the step's host-time split).

On the engine loop a spec gets only cheap checks (`check_limits`); its parse, its compilation
and xgrammar's preparation (import, tokenizer info) run in the grammar pool."""
import concurrent.futures
from concurrent.futures import Future
from dataclasses import dataclass
from time import perf_counter
from typing import NamedTuple

import numpy as np
import torch

from tandem.grammar.compiler import Compilation, GrammarCompiler, InvalidGrammar, check_limits
from tandem.grammar.mask import GrammarMask
from tandem.grammar.stager import MaskStager
from tandem.overlap.streams import StreamSet
from tandem.request import Request
from tandem.sampling import SamplingParams
from tandem.sampling.bias import BAN
from tandem.scheduler.batch import ScheduledBatch


@dataclass
class StepMasks:
    """One step's token masks on the device, the event their copy records, and the requests
    whose constraints leave no token at this step."""

    bitmask: torch.Tensor
    ready: object
    no_token: list[Request]


@dataclass
class MaskFill:
    """A step's masks between `start_masks` and `finish_masks`: the host rows being filled,
    the rows that have grammar matchers, and the fill thread's future (None: no matcher)."""

    batch: ScheduledBatch
    host: torch.Tensor
    indices: list[int]
    filled: Future | None


class Compiling(NamedTuple):
    req: Request
    future: Future  # job.future, second as before: callers wait on `compiling[i][1]`
    job: Compilation  # shared by the requests with its spec; when it started compiling


@dataclass
class GrammarFailure:
    """A constrained request that ends before its first step: why, and the HTTP status."""

    req: Request
    message: str
    status: int  # 400 the spec is at fault (invalid, too slow to compile), 500 the engine
    code: str


class GrammarManager:
    def __init__(self, tokenizer, vocab_size: int, stop_ids: list[int], streams: StreamSet,
                 max_rows: int, threads: int = 2, compile_timeout: float = 60.0,
                 enabled: bool = True) -> None:
        self.tokenizer, self.vocab_size, self.stop_ids = tokenizer, vocab_size, stop_ids
        self._stop_set = frozenset(stop_ids)
        self.streams, self.max_rows = streams, max_rows
        if not compile_timeout > 0:
            raise ValueError(f"grammar_compile_timeout must be > 0 seconds, got {compile_timeout!r}")
        self.compile_timeout = compile_timeout
        self.compiling: list[Compiling] = []
        # xgrammar is prepared in the background from the first grammar on, so neither
        # start-up nor the loop waits for it (None: no tokenizer, or constraints refused).
        self._compiler = (GrammarCompiler(tokenizer, vocab_size, stop_ids, threads)
                          if enabled and tokenizer is not None else None)
        self._stager: MaskStager | None = None
        self._batch_matcher = None
        self._filler: concurrent.futures.ThreadPoolExecutor | None = None
        # Host seconds spent on masks (fill + copy) and on advancing matchers: the bench's split.
        self.fill_s = self.accept_s = 0.0
        self.masked_steps = 0
        # Requests given a token mask (a grammar here, bad words by the engine), pruned of the
        # finished ones as steps pass: without one alive no step scans its rows for masks.
        self._masked: list[Request] = []

    # ---- submission ----
    def check(self, params: SamplingParams) -> None:
        """At submission, on the engine loop: an oversized spec raises ValueError naming the
        field. Only cheap checks: an invalid one is found by the pool (its request ends there)."""
        constraint = _constraint(params)
        if constraint is None:
            return
        kind, spec = constraint
        if self.tokenizer is None:
            raise ValueError(f"{kind} needs a tokenizer; this model has none")
        check_limits(kind, spec)  # the parse is the pool's: a valid-looking spec may still fail there
        _check_choice_reaches_min_tokens(params)

    def add(self, req: Request) -> None:
        """Parse and compile in the pool; the request is scheduled once `take_ready` hands it
        back, or ends there (invalid, or compiling for longer than `compile_timeout`)."""
        job = self._compiler.submit(*req.params.constraint)
        self.compiling.append(Compiling(req, job.future, job))

    def has_pending(self) -> bool:
        return any(not c.req.finished for c in self.compiling)

    def take_ready(self, block: bool) -> tuple[list[Request], list[GrammarFailure]]:
        """Requests whose grammar compiled (matcher attached), and those that end instead.
        With `block` (nothing else to do) waits briefly for a compilation rather than spin."""
        self._forget_finished()
        if block and self.compiling:
            concurrent.futures.wait([c.future for c in self.compiling], timeout=0.05,
                                    return_when=concurrent.futures.FIRST_COMPLETED)
        now = perf_counter()
        ready, failed, still = [], [], []
        for entry in self.compiling:
            if entry.future.done():
                failure = self._failure(entry)
                if failure is None:
                    self.give_mask(entry.req, GrammarMask(entry.future.result(), self._stop_set))
                    ready.append(entry.req)
                else:
                    failed.append(failure)
            elif entry.job.running_for(now) >= self.compile_timeout:
                failed.append(self._timed_out(entry.req))
            else:
                still.append(entry)
        self.compiling = still
        return ready, failed

    def _failure(self, entry: Compiling) -> GrammarFailure | None:
        if entry.future.cancelled():
            return GrammarFailure(entry.req, "grammar compilation was cancelled", 500, "engine_error")
        exc = entry.future.exception()
        if exc is None:
            return None
        if isinstance(exc, InvalidGrammar):
            return GrammarFailure(entry.req, str(exc), 400, "invalid_grammar")
        return GrammarFailure(entry.req, f"grammar compilation failed: {exc}", 500, "engine_error")

    def _timed_out(self, req: Request) -> GrammarFailure:
        kind = req.params.constraint[0]
        return GrammarFailure(req, f"the {kind} grammar took too long to compile: not done after "
                                   f"{self.compile_timeout:g} s (the engine's grammar_compile_timeout)",
                              400, "grammar_compile_timeout")

    def _forget_finished(self) -> None:
        """Aborted requests stop waiting. A queued compilation no one else waits for is
        cancelled (a running one cannot be: it finishes, cached for the same spec later)."""
        dropped = [c for c in self.compiling if c.req.finished]
        self.compiling = [c for c in self.compiling if not c.req.finished]
        wanted = {id(c.future) for c in self.compiling}
        for c in dropped:
            if id(c.future) not in wanted:
                c.future.cancel()

    # ---- the loop ----
    def give_mask(self, req: Request, mask) -> None:
        """Every token mask a request gets goes through here (`constrains` counts on it)."""
        req.mask = mask
        self._masked.append(req)

    def constrains(self, batch: ScheduledBatch) -> bool:
        if not self._masked:  # the common step: no masked request alive, no pass over the rows
            return False
        self._masked = [r for r in self._masked if not r.finished]
        return bool(self._masked) and any(req.mask is not None for req in batch.sampled[0])

    def accept(self, req: Request, token: int) -> bool:
        """Advance the request's matcher; True when its output is complete."""
        t0 = perf_counter()
        if not req.mask.accept(token):
            raise RuntimeError(f"request {req.rid}: token {token} broke its grammar; the mask "
                               "protocol let through a disallowed token")
        done = req.mask.is_terminated()
        self.accept_s += perf_counter() - t0
        return done

    def start_masks(self, batch: ScheduledBatch) -> MaskFill:
        """Begin the step's masks on the host: rows without a grammar matcher are filled here,
        the matchers' rows on the fill thread (xgrammar releases the GIL while it fills), so
        the caller can make the previous step's text meanwhile. Every earlier token of each
        row's request has been accepted: the previous step's tokens were taken. `finish_masks`
        must follow, on every path (it owns the host ring slot until then)."""
        t0 = perf_counter()
        rows = batch.sample_rows
        host = self._mask_stager().host_rows(batch.step, len(rows))
        matchers, indices = [], []
        for i, row in enumerate(rows):
            req = row.req
            if req.mask is None or req.finished:
                host[i].fill_(-1)  # all allowed: unconstrained, or a dropped token after a finish
                continue
            assert len(req.output_token_ids) == row.sample_index, "mask filled before its token was known"
            if isinstance(req.mask, GrammarMask):
                matchers.append(req.mask.matcher)
                indices.append(i)
            else:
                req.mask.fill_next_mask(host, i)
        filled = None
        if matchers:  # the matchers are only read by the fill until finish_masks joins it
            filled = self._fill_thread().submit(self._grammar_batch_matcher().batch_fill_next_token_bitmask,
                                                matchers, host, indices)
        self.fill_s += perf_counter() - t0
        return MaskFill(batch, host, indices, filled)

    def finish_masks(self, fill: MaskFill) -> StepMasks:
        """Wait for the fill, then queue the masks' copy (schedule stream). A row whose grammar
        allows only tokens its bans forbid is reported in `no_token` (and left unmasked, so
        its draw stays finite); the engine ends that request."""
        t0 = perf_counter()
        if fill.filled is not None:
            fill.filled.result()  # re-raises the fill's error here, on the engine loop
        rows, host = fill.batch.sample_rows, fill.host
        # Only a row with bans can be left without a token; most constrained rows have none.
        empty = [i for i in fill.indices if (rows[i].req.bias or rows[i].req.min_tokens_bias)
                 and _bans_every_allowed_token(host[i], rows[i])]
        for i in empty:
            host[i].fill_(-1)
        device_rows, ready = self._mask_stager().copy(fill.batch.step, len(rows))
        self.fill_s += perf_counter() - t0
        self.masked_steps += 1
        return StepMasks(device_rows, ready, [rows[i].req for i in empty])

    def mark_consumed(self, batch: ScheduledBatch) -> None:
        self._stager.mark_consumed(batch.step)

    # ---- lazily built parts ----
    def _mask_stager(self) -> MaskStager:
        if self._stager is None:
            self._stager = MaskStager(self.streams, self.max_rows, self.vocab_size)
        return self._stager

    def _fill_thread(self) -> concurrent.futures.ThreadPoolExecutor:
        # One thread: fills are joined before the next starts.
        if self._filler is None:
            self._filler = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="tandem-mask-fill")
        return self._filler

    def _grammar_batch_matcher(self):
        # Built once a grammar compiled, so xgrammar is imported by then (by the pool): a
        # bad-words mask alone never waits for that import on the loop.
        if self._batch_matcher is None:
            import xgrammar as xgr

            # One thread: a row's fill is ~1 us, so spreading a step's fill costs more than it
            # saves (64 rows: 0.04 ms on one thread, 0.12 on two; docs/benchmarks.md, session 34);
            # the fill already runs beside the loop's text. `threads` is for compiling.
            self._batch_matcher = xgr.BatchGrammarMatcher(max_threads=1)
        return self._batch_matcher

    def shutdown(self) -> None:
        if self._compiler is not None:
            self._compiler.shutdown()
        if self._filler is not None:
            self._filler.shutdown(wait=True)  # a fill in progress writes pinned memory close() frees


def _bans_every_allowed_token(mask_row: torch.Tensor, row) -> bool:
    """True when the sample's bans (min_tokens' stop ids, single-token bad words) cover every
    token the grammar allows. Host-only: the mask row is host memory, the bans host data."""
    bans = [t for t, value in row.req.bias_at(row.sample_index) if value == BAN]
    if not bans:
        return False  # a grammar that is not terminated allows at least one token
    words = mask_row.numpy().view(np.uint32)
    allowed = int(np.bitwise_count(words).sum())
    if allowed > len(bans):
        return False
    banned_allowed = sum((int(words[t >> 5]) >> (t & 31)) & 1 for t in set(bans))
    return banned_allowed == allowed


def _constraint(params: SamplingParams) -> tuple[str, str] | None:
    """(kind, spec text); a schema nested past what json can encode is refused by name."""
    try:
        return params.constraint
    except RecursionError:
        kind = next(k for k in ("json_schema", "choice") if getattr(params, k) is not None)
        raise ValueError(f"{kind} nests too deeply to encode as JSON") from None


def _check_choice_reaches_min_tokens(params: SamplingParams) -> None:
    """Decidable at submission: a choice of k bytes is written in at most k tokens (a token
    inside the grammar carries at least one byte), after which only a stop token is allowed,
    and min_tokens bans those. Shorter choices than min_tokens leave no token: refuse them."""
    if params.choice is None or not params.min_tokens or params.ignore_eos:
        return
    longest = max(len(c.encode()) for c in params.choice)
    if longest < params.min_tokens:
        raise ValueError(f"no token satisfies the request's constraints: min_tokens={params.min_tokens} "
                         f"but every choice ends within {longest} tokens, after which only the "
                         "end-of-sequence token is allowed (and min_tokens bans it)")
