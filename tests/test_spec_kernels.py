"""Speculative decoding's fused bookkeeping kernels vs their torch forms (the CPU path).

Without CUDA the kernels run in Triton's interpreter on the CPU; with CUDA they run compiled
(marked `gpu`: the GPU suite runs them) against the torch form on the CPU.
"""
import random

import pytest
import torch

from kernel_setup import DEVICE, HAS_CUDA  # first: it sets up Triton's interpreter

pytest.importorskip("triton")

from tandem.overlap.future_map import FutureMap  # noqa: E402
from tandem.speculative.graphs import settle  # noqa: E402
from tandem.speculative.ngram import Proposal  # noqa: E402
from tandem.speculative.state import SpecState, SpecStep  # noqa: E402

SEEDS = [pytest.param(s, marks=[pytest.mark.gpu] if HAS_CUDA else []) for s in range(8)]
SLOTS, MAX_LEN = 11, 48


def _verify_step(rng: random.Random, k: int, queries: int) -> tuple[SpecState, FutureMap, SpecStep, torch.Tensor]:
    """A verify step's state on the CPU: random history, lengths and relay; rows with distinct
    slots, then padding rows (slot 0, length 0, no proposal); each real row's count is its
    k_row cut (0 included). Returns the state, map, step and slots."""
    g = torch.Generator().manual_seed(rng.randrange(1 << 30))
    spec = SpecState.ngram(SLOTS, MAX_LEN, k, 1, 3, torch.device("cpu"))
    spec.history.copy_(torch.randint(0, 50, spec.history.shape, generator=g, dtype=torch.int32))
    spec.length.copy_(torch.randint(1, MAX_LEN, spec.length.shape, generator=g))
    spec.length[0] = 0
    future_map = FutureMap(SLOTS, torch.device("cpu"), debug=True)
    real, padding = rng.randint(1, 6), rng.randint(0, 3)
    slots = torch.tensor(rng.sample(range(1, SLOTS + 1), real) + [0] * padding)
    lengths = spec.length[slots]
    count = torch.tensor([rng.randint(0, k) if queries > 1 else 0 for _ in range(real)] + [0] * padding)
    tokens = torch.randint(0, 4, (real + padding, k), generator=g)  # a small vocabulary: matches happen
    tokens.masked_fill_(torch.arange(k)[None, :] >= count[:, None], 0)
    rows = torch.arange(real + padding)
    step = SpecStep(lengths, Proposal(tokens, count), rows.repeat_interleave(queries), torch.arange(queries).repeat(len(rows)))
    return spec, future_map, step, slots


def _greedy_samples(rng: random.Random, step: SpecStep, queries: int) -> torch.Tensor:
    """Each row's argmax at its queries: all its proposals (full acceptance), a miss at the
    first (none accepted), a miss after a random run, or random tokens."""
    proposals, count = step.proposal.tokens, step.proposal.count
    out = torch.tensor([[rng.randrange(4) for _ in range(queries)] for _ in range(len(count))])
    for b in range(len(count)):
        n = min(int(count[b]), queries)
        run = rng.choice([n, 0, rng.randint(0, n), None])
        if run is not None:
            out[b, :run] = proposals[b, :run]
            if run < n:
                out[b, run] = proposals[b, run] + 1  # a miss
    return out.flatten()


@pytest.mark.parametrize("seed", SEEDS)
def test_settle_greedy_kernel_is_the_torch_settle(seed):
    """Acceptance, history, lengths, relay (the map and its debug copy) and the packed rows of
    a greedy verify step in one launch equal the torch form's: k + 1 queries a row or one,
    rows with k_row 0, full and zero acceptance, padding rows (whose slot-0 writes may race
    in either form: row 0 is compared only for its length, which stays 0)."""
    from tandem.kernels.spec_settle import settle_greedy
    rng = random.Random(seed)
    k = rng.choice([1, 3, 4, 7, 15])
    queries = 1 if seed % 4 == 3 else k + 1
    spec, future_map, step, slots = _verify_step(rng, k, queries)
    sampled = _greedy_samples(rng, step, queries)
    to = lambda t: t.clone().to(DEVICE)  # noqa: E731
    history, length, relay = to(spec.history), to(spec.length), tuple(map(to, future_map.stash_buffers()))
    packed = settle_greedy(to(sampled), queries, to(step.proposal.tokens), to(step.proposal.count),
                           to(step.lengths), to(slots), history, length, relay)
    want = settle(spec, future_map, step, slots, spec.point_mass_verdict(step, sampled))
    assert torch.equal(packed.cpu(), want)
    assert torch.equal(length.cpu(), spec.length) and int(spec.length[0]) == 0
    assert torch.equal(history.cpu()[1:], spec.history[1:])
    for got, ref in zip(relay, future_map.stash_buffers()):
        assert torch.equal(got.cpu()[1:], ref[1:])
    accepted = want.view(-1, k + 3)[:, 0]
    if queries > 1:  # the cases the samples were drawn for
        assert set(accepted.tolist()) >= {0} and (accepted == step.proposal.count).any()


@pytest.mark.parametrize("seed", SEEDS)
def test_verify_inputs_kernel_is_the_torch_form(seed):
    """A graphed verify step's query ids, positions and KV locations in one launch equal the
    torch form's: k + 1 queries a row or one, rows with k_row 0 (their later queries write
    the dummy slot), rows whose later positions pass the table's width, padding rows."""
    from tandem.kernels.verify_inputs import verify_inputs
    from tandem.speculative.graphs import query_inputs
    rng = random.Random(seed)
    k = rng.choice([1, 3, 4, 7, 15])
    queries = 1 if seed % 4 == 3 else k + 1
    spec, future_map, step, slots = _verify_step(rng, k, queries)
    g = torch.Generator().manual_seed(seed)
    table = torch.randint(1, 1000, (SLOTS + 1, MAX_LEN + rng.randint(-k, k)), generator=g, dtype=torch.int32)
    k_rows = torch.where(slots == 0, 0, step.proposal.count + torch.randint(0, 2, slots.shape, generator=g)).clamp(max=k)
    last = future_map.buf[slots] + torch.randint(0, 9, slots.shape, generator=g)
    want = query_inputs(spec, step, last, slots, k_rows, table)
    to = lambda t: t.to(DEVICE)  # noqa: E731
    got = verify_inputs(to(step.proposal.tokens), to(last), to(step.lengths), to(k_rows.to(torch.int32)), to(slots),
                        to(table), queries)
    for name, a, b in zip(("ids", "positions", "locs"), got, want):
        assert torch.equal(a.cpu(), b), name
