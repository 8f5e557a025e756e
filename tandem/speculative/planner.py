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


# A verify row of k proposals costs about VERIFY_BASE_COST + VERIFY_COST_PER_PROPOSAL * k plain
# decode steps (H100, built-in model, batch 1, at 54acab2: 0.97 ms at k 7 and 1.10 at k 15 against
# 0.62 for a plain step) and emits its accepted proposals plus one sampled token: it pays for
# itself once it accepts that cost less one on average (0.56 at k 7, 0.77 at k 15). A request whose
# last VERIFY_WINDOW verify rows accepted less (its text does not repeat its context: chat, not
# copying; or it repeats in short runs) stops proposing for FIRST_PAUSE steps, twice as long after
# each further such row up to MAX_PAUSE; a window that pays resets it. A paused request decodes on
# plain steps (and their CUDA graphs) but for an occasional probe, whose row joins the window; the
# step planned while a probe is in flight (the overlap's lag) proposes nothing, so a failed probe
# costs one verify row, not two. The window of four: a single long accepted run (a copied line)
# pays for three misses around it. A draft model's proposals cost its k forwards besides: for them
# the rule errs towards speculating.
VERIFY_BASE_COST = 1.38
VERIFY_COST_PER_PROPOSAL = 0.026
VERIFY_WINDOW = 4
FIRST_PAUSE = 2
MAX_PAUSE = 64


def break_even_accepted(k: int) -> float:
    """Accepted proposals a verify row of k must average to cost no more a token than plain steps."""
    return VERIFY_BASE_COST - 1 + VERIFY_COST_PER_PROPOSAL * k


def note_verified(req: Request, k: int, accepted: int) -> None:
    """A processed verify row of `req` that carried `k` proposal slots."""
    if not k:
        note_plain(req)
        return
    window = req.spec_accepted_window
    window.append(accepted)
    if len(window) > VERIFY_WINDOW:
        del window[0]
    if len(window) < VERIFY_WINDOW:
        return
    if sum(window) >= break_even_accepted(k) * VERIFY_WINDOW:
        req.spec_pauses = 0
    else:
        req.spec_pause = min(MAX_PAUSE, FIRST_PAUSE << min(req.spec_pauses, 8))
        req.spec_pauses += 1


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
        if req.spec_pauses and req.spec_extra:  # a probe in flight: its result decides the next
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
