"""Speculative decoding's device pieces: the n-gram proposer and exact verification.

The verification tests decode a toy target (a bigram table: logits depend on the last token)
with the sampler's own counter-based noise, once plainly and once through proposals and
verification: point-mass verification must give the same tokens (greedy and sampled), and
rejection sampling must give the target's distribution (a chi-square test that fails when
the rejection step is removed).
"""
import random

import pytest
import torch

from tandem.sampling.noise import _mix32, gumbel_argmax, row_keys
from tandem.speculative.ngram import propose_ngram, propose_ngram_reference
from tandem.speculative.verify import accept_point_mass, accept_rejection

V = 8
TOKEN_HASH = _mix32(torch.arange(V, dtype=torch.int64) ^ 0x9E3779B9)  # as Sampler makes it


@pytest.mark.parametrize("seed", range(6))
def test_ngram_proposals_match_the_plain_rule(seed):
    rng = random.Random(seed)
    k, min_n, max_n = rng.randint(1, 5), rng.randint(1, 2), rng.randint(2, 4)
    rows = [[rng.randrange(4) for _ in range(rng.randint(0, 40))] for _ in range(7)]
    T = 48
    history = torch.zeros((len(rows), T), dtype=torch.int64)
    for i, r in enumerate(rows):
        history[i, :len(r)] = torch.tensor(r, dtype=torch.int64)
        history[i, len(r):] = 3  # garbage past the length must not match
    lengths = torch.tensor([len(r) for r in rows])
    got = propose_ngram(history, lengths, k, min_n, max_n)
    for i, r in enumerate(rows):
        want = propose_ngram_reference(r, k, min_n, max_n)
        n = int(got.count[i])
        assert got.tokens[i, :n].tolist() == want, (r, k, min_n, max_n)
        assert got.tokens[i, n:].eq(0).all()


def test_ngram_window_only_shortens_what_is_found():
    row = [1, 2, 3, 9, 9, 9, 9, 9, 1, 2]
    history, lengths = torch.tensor([row]), torch.tensor([len(row)])
    assert propose_ngram(history, lengths, 3, 2, 2).tokens[0].tolist() == [3, 9, 9]
    outside = propose_ngram(history, lengths, 3, 2, 2, window=(4, len(row)))
    assert outside.count.tolist() == [0]


# ---- a toy target: logits depend on the last token only -------------------------------------
def _bigram(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn((V, V), generator=g) * 1.5


def _sample(logits: torch.Tensor, temperature: float, seed: int, index: torch.Tensor) -> torch.Tensor:
    """The sampler's draw: greedy, or Gumbel-max with the key of (seed, output index)."""
    if temperature == 0:
        return logits.argmax(dim=-1)
    keys = row_keys(torch.full_like(index, seed), index)
    return gumbel_argmax(logits / temperature, keys, TOKEN_HASH)


def _plain(table, first: int, n: int, temperature: float, seed: int) -> list[int]:
    out, last = [], first
    for i in range(n):
        last = int(_sample(table[last][None], temperature, seed, torch.tensor([i]))[0])
        out.append(last)
    return out


def _speculative(table, first: int, n: int, temperature: float, seed: int, k: int, rng) -> tuple[list[int], int]:
    """Proposals: half from the n-gram rule over the tokens so far, half random guesses."""
    out, steps = [], 0
    while len(out) < n:
        context = [first] + out
        guess = propose_ngram_reference(context, k, 1, 3) if rng.random() < 0.5 else []
        guess = guess or [rng.randrange(V) for _ in range(rng.randint(0, k))]
        proposals = torch.tensor([guess + [0] * (k - len(guess))])
        # The target at every position, each with its prefix: the last token, then proposals.
        inputs = [context[-1]] + guess + [0] * (k - len(guess))
        index = torch.arange(len(out), len(out) + k + 1)
        target = _sample(table[torch.tensor(inputs)], temperature, seed, index)[None]
        verdict = accept_point_mass(target, proposals, torch.tensor([len(guess)]))
        out += verdict.tokens[0, :int(verdict.emitted[0])].tolist()
        steps += 1
    return out[:n], steps


@pytest.mark.parametrize("temperature", [0.0, 0.8])
@pytest.mark.parametrize("seed", range(4))
def test_point_mass_verification_emits_exactly_the_plain_tokens(temperature, seed):
    table, rng = _bigram(seed), random.Random(seed)
    plain = _plain(table, 1, 60, temperature, seed)
    spec, steps = _speculative(table, 1, 60, temperature, seed, 4, rng)
    assert spec == plain
    assert steps < 60  # some proposals were accepted


def test_a_proposal_of_the_targets_own_tokens_is_always_accepted():
    target = torch.tensor([[5, 6, 7, 1]])
    verdict = accept_point_mass(target, torch.tensor([[5, 6, 7]]), torch.tensor([3]))
    assert verdict.accepted.tolist() == [3] and verdict.tokens[0].tolist() == [5, 6, 7, 1]
    short = accept_point_mass(target, torch.tensor([[5, 6, 7]]), torch.tensor([2]))
    assert short.accepted.tolist() == [2]  # the third is not a proposal: the target's 7 is emitted


def _first_token_counts(accept, trials: int, k: int = 2) -> torch.Tensor:
    """The first emitted token over `trials` seeds: p = softmax(table[0]), q = softmax(draft[0])."""
    p_row, q_row = torch.softmax(_bigram(1)[0], 0), torch.softmax(_bigram(2)[0] * 0.5, 0)
    seeds = torch.arange(trials, dtype=torch.int64)
    index = torch.arange(k + 1, dtype=torch.int64)
    keys = row_keys(seeds[:, None].expand(-1, k + 1), index[None, :].expand(trials, -1))
    draft_keys = row_keys(seeds + 10**6, torch.zeros_like(seeds))
    proposals = gumbel_argmax(q_row.log()[None].expand(trials, -1).contiguous(), draft_keys, TOKEN_HASH)
    proposals = torch.stack([proposals, proposals], dim=1)[:, :k]
    p = p_row.expand(trials, k + 1, V)  # positions beyond the first do not matter here
    q = q_row.expand(trials, k, V)
    verdict = accept(p, q, proposals, torch.full((trials,), k), keys, TOKEN_HASH)
    return torch.bincount(verdict.tokens[:, 0], minlength=V).double(), p_row.double() * trials


def _chi_square_p(counts: torch.Tensor, expected: torch.Tensor) -> float:
    """Pearson's test: P(chi2(df) >= stat) = Q(df / 2, stat / 2), the regularized upper gamma."""
    keep = expected > 5
    stat = ((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum()
    df = torch.tensor(float(keep.sum() - 1), dtype=torch.float64)
    return float(torch.special.gammaincc(df / 2, stat / 2))


def test_rejection_sampling_keeps_the_targets_distribution():
    counts, expected = _first_token_counts(accept_rejection, 20_000)
    assert _chi_square_p(counts, expected) > 1e-3


def test_the_distribution_test_catches_a_missing_rejection_step():
    def accept_everything(p, q, proposals, count, keys, token_hash):  # the draft's distribution
        return accept_rejection(q.new_ones(p.shape), q.new_ones(q.shape), proposals, count, keys, token_hash)

    counts, expected = _first_token_counts(accept_everything, 20_000)
    assert _chi_square_p(counts, expected) < 1e-6


def test_the_host_index_agrees_with_the_proposer_rule():
    """HostNgramIndex.matches (incremental, over prompt + outputs) says whether
    propose_ngram_reference finds a proposal, on random short-alphabet sequences."""
    import random
    from tandem.speculative.ngram import HostNgramIndex
    rng = random.Random(0)
    for trial in range(200):
        tokens = [rng.randrange(4) for _ in range(rng.randrange(1, 40))]
        split = rng.randrange(len(tokens) + 1)
        index = HostNgramIndex(1, 3) if trial % 2 else HostNgramIndex(2, 3)
        for cut in range(1, len(tokens) + 1):  # grown a token at a time, as outputs arrive
            prompt, outputs = tokens[:min(split, cut)], tokens[min(split, cut):cut]
            want = bool(propose_ngram_reference(tokens[:cut], 4, index.min_n, index.max_n))
            assert index.matches(prompt, outputs) == want, (tokens[:cut], split)


def test_the_host_match_length_is_the_longest_ngram_the_proposer_finds():
    """HostNgramIndex.match_length: the longest n in min_n..max_n for which the proposer's rule
    finds an earlier occurrence of the n-token suffix (0: none), grown a token at a time."""
    import random
    from tandem.speculative.ngram import HostNgramIndex
    rng = random.Random(1)
    for trial in range(200):
        tokens = [rng.randrange(3) for _ in range(rng.randrange(1, 40))]
        split = rng.randrange(len(tokens) + 1)
        index = HostNgramIndex(1 + trial % 2, 4)
        for cut in range(1, len(tokens) + 1):
            prompt, outputs = tokens[:min(split, cut)], tokens[min(split, cut):cut]
            want = max((n for n in range(index.min_n, index.max_n + 1)
                        if propose_ngram_reference(tokens[:cut], 1, n, n)), default=0)
            assert index.match_length(prompt, outputs) == want, (tokens[:cut], split)


@pytest.mark.parametrize("min_match, lookup, verifies", [
    (2, (1, 3), False),  # the suffix [9] recurs, [4, 9] does not: no verify row
    (1, (1, 3), True),  # the rule before session 28: any match
    (2, (1, 1), True),  # clamped to prompt_lookup_max: a one-token lookup verifies on one token
])
def test_a_row_verifies_after_a_match_of_min_match_tokens(min_match, lookup, verifies):
    from tandem.request import Request
    from tandem.sampling import SamplingParams
    from tandem.speculative.config import SpeculativeConfig
    from tandem.speculative.planner import VerifyPlanner
    cfg = SpeculativeConfig("ngram", 4, prompt_lookup_min=lookup[0], prompt_lookup_max=lookup[1])
    req = Request("r", [7, 9, 5, 4, 9], SamplingParams(max_tokens=50), seed=0, max_samples=50)
    assert (VerifyPlanner(cfg, min_match).k_for(req) > 0) == verifies
    req.output_token_ids = [5]  # now [9, 5] recurs: two tokens
    assert VerifyPlanner(cfg, min_match).k_for(req) > 0


def test_a_request_pauses_when_its_verify_rows_do_not_pay_for_themselves():
    """Four verify rows accepting 1 token between them (k 15: a verify costs ~1.8 plain steps,
    so it must average ~0.77): paused, though one accepted (the rule before session 36 reset on
    any accepted token); one long run among misses pays; the pause doubles while probes keep
    failing and a paying window resets it; plain steps count the pause down."""
    from tandem.request import Request
    from tandem.sampling import SamplingParams
    from tandem.speculative.planner import FIRST_PAUSE, break_even_accepted, note_plain, note_verified
    assert 0.5 < break_even_accepted(7) < break_even_accepted(15) < 0.9

    def request_after(accepted: list[int], k: int = 15) -> Request:
        req = Request("r", [1, 2, 3], SamplingParams(max_tokens=50), seed=0, max_samples=50)
        for a in accepted:
            note_verified(req, k, a)
        return req

    assert request_after([0, 0, 1]).spec_pause == 0  # three rows: too few to judge
    assert request_after([0, 0, 1, 0]).spec_pause == FIRST_PAUSE
    assert request_after([0, 0, 0, 8]).spec_pause == 0
    assert request_after([1, 1, 1, 0], k=7).spec_pause == 0  # 0.75 a row pays at k 7 (0.56)...
    assert request_after([1, 1, 1, 0], k=15).spec_pause == FIRST_PAUSE  # ...not at k 15 (0.77)
    req = request_after([0, 0, 0, 0])
    for _ in range(FIRST_PAUSE):
        note_plain(req)
    assert req.spec_pause == 0
    note_verified(req, 15, 0)  # the probe fails: twice as long
    assert req.spec_pause == 2 * FIRST_PAUSE
    req.spec_pause = 0
    note_verified(req, 15, 12)  # a probe that accepts a long run: the window pays again
    assert req.spec_pause == 0 and req.spec_pauses == 0
    note_verified(req, 0, 0)  # a row without proposal slots is a plain step
    assert req.spec_accepted_window == [0, 0, 0, 12]
