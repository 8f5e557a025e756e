"""The engine's side of structured output: admission after compilation, matcher advance,
and each step's mask fill and copy (timed, for the step's host-time split)."""
import concurrent.futures
from concurrent.futures import Future
from dataclasses import dataclass
from time import perf_counter

import numpy as np
import torch

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


class GrammarManager:
    def __init__(self, tokenizer, vocab_size: int, stop_ids: list[int], streams: StreamSet,
                 max_rows: int, threads: int = 2) -> None:
        self.tokenizer, self.vocab_size, self.stop_ids = tokenizer, vocab_size, stop_ids
        self._stop_set = frozenset(stop_ids)
        self.streams, self.max_rows, self.threads = streams, max_rows, threads
        self.compiling: list[tuple[Request, Future]] = []
        self._compiler = None  # built on the first constrained request (imports xgrammar)
        self._stager: MaskStager | None = None
        self._batch_matcher = None
        # Host seconds spent on masks (fill + copy) and on advancing matchers: the bench's split.
        self.fill_s = self.accept_s = 0.0
        self.masked_steps = 0

    # ---- submission ----
    def check(self, params: SamplingParams) -> None:
        """At submission: a bad spec raises ValueError naming the field, never inside a step."""
        if params.constraint is None:
            return
        if self.tokenizer is None:
            raise ValueError(f"{params.constraint[0]} needs a tokenizer; this model has none")
        from tandem.grammar.compiler import check_spec

        check_spec(*params.constraint)
        _check_choice_reaches_min_tokens(params)

    def add(self, req: Request) -> None:
        """Compile in the pool; the request is scheduled once `take_ready` hands it back."""
        self.compiling.append((req, self._compiler_pool().submit(*req.params.constraint)))

    def has_pending(self) -> bool:
        return any(not req.finished for req, _ in self.compiling)

    def take_ready(self, block: bool) -> tuple[list[Request], list[tuple[Request, str]]]:
        """Requests whose grammar compiled (matcher attached), and those whose compile failed.
        With `block` (nothing else to do) waits briefly for a compilation rather than spin."""
        self.compiling = [(r, f) for r, f in self.compiling if not r.finished]
        if block and self.compiling:
            concurrent.futures.wait([f for _, f in self.compiling], timeout=0.05,
                                    return_when=concurrent.futures.FIRST_COMPLETED)
        ready, failed, still = [], [], []
        for req, fut in self.compiling:
            if not fut.done():
                still.append((req, fut))
            elif fut.exception() is not None:
                failed.append((req, f"grammar compilation failed: {fut.exception()}"))
            else:
                req.mask = GrammarMask(fut.result(), self._stop_set)
                ready.append(req)
        self.compiling = still
        return ready, failed

    # ---- the loop ----
    def constrains(self, batch: ScheduledBatch) -> bool:
        return any(r.req.mask is not None for r in batch.sample_rows)

    def accept(self, req: Request, token: int) -> bool:
        """Advance the request's matcher; True when its output is complete."""
        t0 = perf_counter()
        if not req.mask.accept(token):
            raise RuntimeError(f"request {req.rid}: token {token} broke its grammar; the mask "
                               "protocol let through a disallowed token")
        done = req.mask.is_terminated()
        self.accept_s += perf_counter() - t0
        return done

    def masks(self, batch: ScheduledBatch) -> StepMasks:
        """Fill the step's masks on the host and queue their copy (schedule stream). Every
        earlier token of each row's request has been accepted: the previous step was processed.
        A row whose grammar allows only tokens its bans forbid is reported in `no_token` (and
        left unmasked, so its draw stays finite); the engine ends that request."""
        t0 = perf_counter()
        rows = batch.sample_rows
        stager = self._mask_stager()
        host = stager.host_rows(batch.step, len(rows))
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
        if matchers:
            self._batch_matcher.batch_fill_next_token_bitmask(matchers, host, indices)
        empty = [i for i in indices if _bans_every_allowed_token(host[i], rows[i])]
        for i in empty:
            host[i].fill_(-1)
        device_rows, ready = stager.copy(batch.step, len(rows))
        self.fill_s += perf_counter() - t0
        self.masked_steps += 1
        return StepMasks(device_rows, ready, [rows[i].req for i in empty])

    def mark_consumed(self, batch: ScheduledBatch) -> None:
        self._stager.mark_consumed(batch.step)

    # ---- lazily built parts ----
    def _compiler_pool(self):
        if self._compiler is None:
            from tandem.grammar.compiler import GrammarCompiler

            self._compiler = GrammarCompiler(self.tokenizer, self.vocab_size, self.stop_ids, self.threads)
        return self._compiler

    def _mask_stager(self) -> MaskStager:
        if self._stager is None:
            import xgrammar as xgr

            self._stager = MaskStager(self.streams, self.max_rows, self.vocab_size)
            self._batch_matcher = xgr.BatchGrammarMatcher(max_threads=self.threads)
        return self._stager

    def shutdown(self) -> None:
        if self._compiler is not None:
            self._compiler.shutdown()


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
