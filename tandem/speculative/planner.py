"""Which decode steps verify proposals, how many per row, and the KV slots they reserve.

The host never knows a speculating request's exact length while its verify is in flight,
only a bound (`length_bound`). A verify row writes KV at positions length - 1 .. length - 1
+ k, so before it launches the request's table covers every position below bound + k; the
surplus stays reserved for later steps and goes back with the request (its release frees
every slot past what is cached)."""
from __future__ import annotations

from typing import Callable

from tandem.request import Request
from tandem.scheduler.batch import Row
from tandem.speculative.config import SpeculativeConfig
from tandem.speculative.ngram import HostNgramIndex


# A request whose verify rows emit nothing MISSES_BEFORE_PAUSE times in a row (its text does
# not repeat: chat, not copying) stops proposing for FIRST_PAUSE steps, twice as long after
# each further miss up to MAX_PAUSE; an accepted proposal resets it. A verify row with no
# proposal costs k + 1 query tokens for one: the pause keeps such requests on plain decode
# steps (and their CUDA graphs) but for an occasional probe.
MISSES_BEFORE_PAUSE = 4
FIRST_PAUSE = 2
MAX_PAUSE = 64


def note_verified(req: Request, k: int, accepted: int) -> None:
    """A processed verify row of `req` that carried `k` proposal slots."""
    if not k:
        note_plain(req)
    elif accepted:
        req.spec_misses = 0
    else:
        req.spec_misses += 1
        if req.spec_misses >= MISSES_BEFORE_PAUSE:
            req.spec_pause = min(MAX_PAUSE, FIRST_PAUSE << (req.spec_misses - MISSES_BEFORE_PAUSE))


def note_plain(req: Request) -> None:
    """A processed step sampled one token of `req` without proposals."""
    if req.spec_pause:
        req.spec_pause -= 1


def length_bound(req: Request) -> int:
    """The most tokens (prompt, outputs, the pending one) the request can have once every
    launched step ran: each launched row samples one, a verify row up to spec_k more."""
    return len(req.prompt_token_ids) + req.num_scheduled_samples + req.spec_extra


def speculates(req: Request) -> bool:
    """Requests whose every token a verify step can check on the device: no per-token state
    that the host updates between tokens (grammar, bad-words masks), no min_tokens bans until
    min_tokens is reached (they end at a position the proposals may pass). Penalties count a
    query's earlier proposals; logprobs come for every emitted token; a static logit bias is
    the same at every position."""
    return req.mask is None and (not req.min_tokens_bias or req.num_scheduled_samples >= req.params.min_tokens)


class VerifyPlanner:
    def __init__(self, cfg: SpeculativeConfig, min_match: int = 2) -> None:
        self.cfg = cfg
        # n-gram: the shortest known-suffix match that makes a row verify (Experiments.spec_verify_min_match)
        self.min_match = max(cfg.prompt_lookup_min, min(min_match, cfg.prompt_lookup_max))

    def k_for(self, req: Request) -> int:
        """Proposals for the request's row: k, fewer near max_tokens (every emitted token is
        then within max_samples, so no position passes the context), 0 if it cannot speculate."""
        if req.spec_pause or not speculates(req):
            return 0
        if self.cfg.method == "ngram" and not self._match_likely(req):
            return 0
        room = req.max_samples - req.num_scheduled_samples - req.spec_extra - 1
        return max(0, min(self.cfg.num_speculative_tokens, room))

    def _match_likely(self, req: Request) -> bool:
        cfg = self.cfg
        if req.spec_index is None:
            req.spec_index = HostNgramIndex(cfg.prompt_lookup_min, cfg.prompt_lookup_max)
        return req.spec_index.match_length(req.prompt_token_ids, req.output_token_ids) >= self.min_match

    def plan(self, reqs: list[Request], available: int, alloc: Callable[[int], list[int]]) -> list[Row] | None:
        """Verify rows for every decoding request, or None: plain decode rows will do (every
        length is known and nothing speculates), or the KV pool is short even without
        proposals (the caller processes the step in flight, then plans plain rows)."""
        unknown = any(r.spec_extra for r in reqs)
        # A grammar's masks are per row: such a step verifies no proposals, one token a row.
        speculate = len(reqs) <= self.cfg.disable_by_batch_size and all(r.mask is None for r in reqs)
        ks = [self.k_for(r) if speculate else 0 for r in reqs]
        if not unknown and not any(ks):
            return None
        need = [_reserve(r, k) for r, k in zip(reqs, ks)]
        if sum(need) > available and any(ks):
            ks = [0] * len(reqs)
            need = [_reserve(r, 0) for r in reqs]
        if sum(need) > available:
            return None
        slots, rows, at = alloc(sum(need)), [], 0
        for req, k, n in zip(reqs, ks, need):
            rows.append(Row(req, req.num_computed, slots[at:at + n], None, req.num_scheduled_samples,
                            spec_k=k, length_bound=length_bound(req), reserved_from=len(req.kv_slots)))
            at += n
        return rows


def _reserve(req: Request, k: int) -> int:
    """New KV slots the request's row needs: positions below length_bound + k."""
    return max(0, length_bound(req) + k - len(req.kv_slots))
