"""SamplingParams validation and the batched, seeded, sync-free device sampler."""
import math

import pytest
import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tandem import sampling
from tandem.sampling import (
    SampleOutput,
    Sampler,
    SamplingInputs,
    SamplingParams,
    _mix32,
    gumbel_argmax_torch,
    gumbel_argmax_triton,
    row_keys,
    seed_to_int64,
)

V = 64


def make_inputs(params, seeds=None, output_index=None, slots=None) -> SamplingInputs:
    n = len(params)
    seeds = seeds if seeds is not None else [p.seed if p.seed is not None else 1234 for p in params]
    return SamplingInputs.build(
        params,
        seeds,
        output_index if output_index is not None else [0] * n,
        slots if slots is not None else list(range(1, n + 1)),
        pin_memory=False,
    )


def fixed_logits(v: int = V, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(v, generator=g)


def draw_many(params: SamplingParams, logits: torch.Tensor, n: int = 20000) -> torch.Tensor:
    """One row per output index, all with the same logits: n independent draws of one request."""
    sampler = Sampler(logits.shape[0], max_slots=2, device="cpu")
    inputs = make_inputs([params] * n, seeds=[params.seed] * n, output_index=list(range(n)), slots=[1] * n)
    return sampler.sample(logits.expand(n, -1).contiguous(), inputs).token_ids


def frequencies(ids: torch.Tensor, v: int) -> torch.Tensor:
    return torch.bincount(ids, minlength=v).double() / ids.numel()


def assert_matches(freq: torch.Tensor, probs: torch.Tensor, n: int) -> None:
    # Draws are a deterministic function of the seed, so this cannot flake; 5 sigma
    # per token plus a chi-square over the tokens with enough expected mass.
    probs = probs.double()
    sigma = (probs * (1 - probs) / n).sqrt()
    assert ((freq - probs).abs() <= 5 * sigma + 1e-12).all(), (freq, probs)
    big = probs * n >= 5
    chi2 = (((freq - probs)[big] * n) ** 2 / (probs[big] * n)).sum().item()
    df = int(big.sum()) - 1
    # Wilson-Hilferty approximation of the 0.999 quantile of chi-square(df).
    z = 3.09
    crit = df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3
    assert chi2 < crit, (chi2, crit)


# --------------------------------------------------------------------------- params


@pytest.mark.parametrize(
    "field, value",
    [
        ("max_tokens", 0),
        ("max_tokens", 1.0),
        ("max_tokens", True),
        ("max_tokens", "3"),
        ("temperature", -1),
        ("temperature", float("nan")),
        ("temperature", float("inf")),
        ("temperature", None),
        ("temperature", True),
        ("top_p", 0.0),
        ("top_p", 1.01),
        ("top_p", -0.5),
        ("top_k", 0),
        ("top_k", -2),
        ("top_k", 2.0),
        ("top_k", False),
        ("top_k", 2**31),
        ("top_k", 2**63),
        ("min_p", -0.1),
        ("min_p", 1.5),
        ("seed", 1.5),
        ("seed", "7"),
        ("seed", True),
        ("stop", ""),
        ("stop", [""]),
        ("stop", ["ok", 3]),
        ("stop", 5),
        ("stop_token_ids", [-1]),
        ("stop_token_ids", [1.0]),
        ("stop_token_ids", 3),
        ("stop_token_ids", [True]),
        ("stop_token_ids", [2**63]),
        ("stop", "a\ud800b"),
        ("stop", ["ok", "\udc00"]),
        ("stop", ["s"] * 129),
        ("stop", "x" * 1025),
        ("stop_token_ids", [1] * 1025),
        ("ignore_eos", 1),
        ("repetition_penalty", 0.0),
        ("repetition_penalty", -1.0),
        ("presence_penalty", 2.5),
        ("presence_penalty", -2.01),
        ("frequency_penalty", 3),
        ("frequency_penalty", -3),
        ("logprobs", -1),
        ("logprobs", 21),
        ("logprobs", 1.0),
        ("logprobs", True),
    ],
)
def test_invalid_field_raises_naming_it(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_top_k_zero_message_says_zero_is_not_disabled():
    with pytest.raises(ValueError, match="0 is not accepted"):
        SamplingParams(top_k=0)


def test_message_states_range_and_value():
    with pytest.raises(ValueError, match=r"temperature must be .*>= 0.*got -1"):
        SamplingParams(temperature=-1)


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(max_tokens=1),
        dict(temperature=0),
        dict(temperature=0.0),
        dict(temperature=100),
        dict(top_p=1.0),
        dict(top_p=1e-6),
        dict(top_k=-1),
        dict(top_k=1),
        dict(min_p=0.0),
        dict(min_p=1.0),
        dict(seed=0),
        dict(seed=-5),
        dict(seed=2**70),
        dict(stop_token_ids=[]),
        dict(stop_token_ids=[0, 7]),
        dict(repetition_penalty=1e-3),
        dict(presence_penalty=-2),
        dict(presence_penalty=2),
        dict(frequency_penalty=-2.0),
        dict(frequency_penalty=2.0),
        dict(logprobs=0),
        dict(logprobs=20),
        dict(ignore_eos=True),
    ],
)
def test_valid_edges_accepted(kwargs):
    SamplingParams(**kwargs)


def test_defaults_and_normalisation():
    p = SamplingParams()
    assert (p.max_tokens, p.temperature, p.top_p, p.top_k, p.min_p) == (16, 1.0, 1.0, -1, 0.0)
    assert p.stop is None and p.stop_token_ids is None and p.logprobs is None
    assert SamplingParams(stop="end").stop == ["end"]
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]
    assert SamplingParams(stop_token_ids=(3, 4)).stop_token_ids == [3, 4]
    assert isinstance(SamplingParams(temperature=1).temperature, float)


def test_host_helpers():
    assert SamplingParams(temperature=0).is_greedy
    assert not SamplingParams(temperature=0, top_k=5).uses_top_k
    assert SamplingParams(top_k=5).uses_top_k
    assert SamplingParams(top_p=0.9).uses_top_p and not SamplingParams().uses_top_p
    assert SamplingParams(min_p=0.1).uses_min_p and not SamplingParams().uses_min_p
    assert SamplingParams(temperature=0, presence_penalty=0.5).uses_penalties
    assert not SamplingParams().uses_penalties
    assert SamplingParams(top_k=3).clone(top_k=4).top_k == 4
    with pytest.raises(ValueError, match="top_k"):
        SamplingParams().clone(top_k=0)


def test_build_flags():
    inp = make_inputs([SamplingParams(temperature=0, top_k=5), SamplingParams(temperature=0)])
    assert inp.all_greedy and not inp.need_top_k and inp.max_logprobs is None
    inp = make_inputs(
        [SamplingParams(top_k=5), SamplingParams(top_k=9, temperature=0), SamplingParams(logprobs=3), SamplingParams(logprobs=0)]
    )
    assert not inp.all_greedy and inp.need_top_k and inp.max_top_k == 5 and inp.max_logprobs == 3
    assert not (inp.need_top_p or inp.need_min_p or inp.need_penalties)
    inp = make_inputs([SamplingParams(top_p=0.5, min_p=0.1, frequency_penalty=0.1, logprobs=0)])
    assert inp.need_top_p and inp.need_min_p and inp.need_penalties and inp.max_logprobs == 0
    assert inp.top_k.tolist() == [-1] and inp.slots.tolist() == [1] and not inp.top_p_within_top_k
    inp = make_inputs([SamplingParams(temperature=0, top_p=0.5, min_p=0.2), SamplingParams(top_k=7, top_p=0.9)])
    assert inp.need_top_p and inp.top_p_within_top_k and not inp.need_min_p and inp.max_top_k == 7
    inp = make_inputs([])
    assert inp.batch_size == 0 and inp.all_greedy and inp.max_logprobs is None
    with pytest.raises(ValueError):
        SamplingInputs.build([SamplingParams()], [1, 2], [0], [1])


def test_inputs_to_keeps_values_and_flags():
    inp = make_inputs([SamplingParams(top_p=0.5, seed=9), SamplingParams(temperature=0)], output_index=[3, 4])
    moved = inp.to("cpu", non_blocking=False)
    assert torch.equal(moved.floats, inp.floats) and torch.equal(moved.ints, inp.ints)
    assert moved.need_top_p and moved.batch_size == 2
    want = row_keys(torch.tensor([9, 1234]), torch.tensor([3, 4]))
    assert torch.equal(moved.noise_key, want)


def test_host_row_keys_match_device_row_keys():
    seeds = [0, 1, -1, -(2**63), 2**63 - 1, 2**64 + 5, 2**70 + 3, 123456789]
    index = [0, 1, 2**31, 2**32 - 1, 2**32 + 7, 5, 0, 99]
    want = row_keys(torch.tensor([seed_to_int64(s) for s in seeds]), torch.tensor(index))
    keys = [sampling.seed_key(s) for s in seeds]
    assert sampling.row_keys_host(np.array(keys), index).tolist() == want.tolist()
    assert sampling.row_keys_host(np.array(keys, dtype=np.float64), index).tolist() == want.tolist()  # as packed
    assert [sampling.row_keys_host(np.array([k]), [i]).item() for k, i in zip(keys, index)] == want.tolist()
    assert len(set(want.tolist())) == len(seeds)


def test_seed_to_int64_keeps_low_bits():
    assert seed_to_int64(5) == 5
    assert seed_to_int64(-1) == -1
    assert seed_to_int64(2**63) == -(2**63)
    assert seed_to_int64(2**64 + 7) == 7


# --------------------------------------------------------------------------- noise


def _lowbias32_ref(x: int) -> int:
    x ^= x >> 16
    x = (x * 0x7FEB352D) & 0xFFFFFFFF
    x ^= x >> 15
    x = (x * 0x846CA68B) & 0xFFFFFFFF
    x ^= x >> 16
    return x


def test_mix32_is_lowbias32():
    g = torch.Generator().manual_seed(1)
    xs = torch.randint(0, 2**32, (1000,), generator=g, dtype=torch.int64)
    xs = torch.cat([xs, torch.tensor([0, 1, 2**31, 2**32 - 1])])
    got = _mix32(xs).tolist()
    assert got == [_lowbias32_ref(x) for x in xs.tolist()]


def _interpreted_or_cuda() -> str | None:
    from triton.runtime.interpreter import InterpretedFunction

    if isinstance(sampling.gumbel_kernel(), InterpretedFunction):
        return "cpu"
    return "cuda" if torch.cuda.is_available() else None


@pytest.mark.parametrize("B, vocab", [(3, 50), (4, 4096), (2, 9000)])
def test_fused_gumbel_kernel_matches_torch_reference(B, vocab):
    """The Triton kernel (interpreted on the CPU, compiled on CUDA) draws exactly what
    the torch reference draws: same hash, same float64 logs, same tie-breaking."""
    device = _interpreted_or_cuda()
    if device is None:
        pytest.skip("Triton kernel neither interpreted nor on CUDA")
    g = torch.Generator().manual_seed(B * vocab)
    scores = torch.randn(B, vocab, generator=g) * 3
    scores[0, : vocab // 2] = float("-inf")
    scores[1] = 0.0  # every token ties before noise
    keys = row_keys(torch.tensor([5, -9, 2**40, 7] * 2)[:B], torch.arange(B) * 11)
    token_hash = _mix32(torch.arange(vocab) ^ 0x9E3779B9)
    want = gumbel_argmax_torch(scores, keys, token_hash)
    got = gumbel_argmax_triton(scores.to(device), keys.to(device), token_hash.to(device)).cpu()
    assert torch.equal(got, want)
    # Pure ties: both must pick the lowest index.
    tied = torch.full((B, vocab), float("-inf"))
    tied[:, [3, vocab - 1]] = 1e30  # noise is negligible against this and equal after rounding
    got = gumbel_argmax_triton(tied.to(device), keys.to(device), token_hash.to(device)).cpu()
    assert torch.equal(got, gumbel_argmax_torch(tied, keys, token_hash)) and (got == 3).all()


# --------------------------------------------------------------------------- greedy and mixing


def test_greedy_is_argmax():
    logits = torch.randn(5, V, generator=torch.Generator().manual_seed(2))
    inp = make_inputs([SamplingParams(temperature=0)] * 5)
    assert inp.all_greedy
    out = Sampler(V, 8, "cpu").sample(logits, inp)
    assert torch.equal(out.token_ids, logits.argmax(-1))
    assert out.token_ids.dtype == torch.int64 and out.logprobs is None and out.top_ids is None


@pytest.mark.parametrize("temperature", [1e-38, 1e-45, 1e-300, 5e-6])
def test_tiny_temperature_is_greedy(temperature):
    """A temperature too small to divide by (logits / 1e-38 overflow) samples greedily."""
    p = SamplingParams(temperature=temperature)
    assert p.is_greedy and p.temperature == 0.0
    logits = torch.stack([fixed_logits(seed=1), fixed_logits(seed=2)])
    out = Sampler(V, 4, "cpu").sample(logits, make_inputs([p, SamplingParams(temperature=1.0, seed=3)]))
    assert out.token_ids[0] == logits[0].argmax()


def test_greedy_argmax_in_half_precision_logits():
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    out = Sampler(V, 8, "cpu").sample(logits, make_inputs([SamplingParams(temperature=0)] * 3))
    assert torch.equal(out.token_ids, logits.float().argmax(-1))


MIXED = [
    SamplingParams(temperature=0),
    SamplingParams(temperature=0.7, seed=1),
    SamplingParams(temperature=1.0, top_k=3, seed=2),
    SamplingParams(temperature=1.3, top_p=0.6, seed=3),
    SamplingParams(temperature=0.9, min_p=0.2, seed=4),
    SamplingParams(temperature=1.0, top_k=10, top_p=0.8, min_p=0.05, seed=5),
    SamplingParams(temperature=2.0, seed=6),
]


def test_mixed_batch_rows_equal_rows_alone():
    sampler = Sampler(V, 16, "cpu")
    logits = torch.randn(len(MIXED), V, generator=torch.Generator().manual_seed(4)) * 3
    for step in range(20):
        idx = [step + i for i in range(len(MIXED))]
        batch = sampler.sample(logits, make_inputs(MIXED, output_index=idx)).token_ids
        alone = [
            sampler.sample(logits[i : i + 1], make_inputs([p], output_index=[idx[i]])).token_ids[0]
            for i, p in enumerate(MIXED)
        ]
        assert batch.tolist() == [int(t) for t in alone]
    assert batch[0] == logits[0].argmax()


def test_same_seed_same_token_across_batch_compositions_and_rows():
    sampler = Sampler(V, 16, "cpu")
    row = fixed_logits(seed=5)
    target = SamplingParams(temperature=1.0, top_p=0.9, seed=42)
    other_logits = torch.randn(6, V, generator=torch.Generator().manual_seed(6))
    others = [SamplingParams(temperature=0.5, seed=s, top_k=4) for s in range(6)]
    for out_idx in range(10):
        alone = sampler.sample(row[None], make_inputs([target], output_index=[out_idx])).token_ids[0]
        for pos in range(0, 7, 3):
            params = others[:pos] + [target] + others[pos:]
            logits = torch.cat([other_logits[:pos], row[None], other_logits[pos:]])
            out = sampler.sample(logits, make_inputs(params, output_index=[7] * pos + [out_idx] + [7] * (6 - pos)))
            assert out.token_ids[pos] == alone


def test_different_seeds_and_output_indices_differ():
    logits = torch.zeros(V)  # uniform: the draw is the noise alone
    a = draw_many(SamplingParams(seed=1), logits, n=200)
    b = draw_many(SamplingParams(seed=2), logits, n=200)
    assert (a != b).float().mean() > 0.9
    assert len(set(a.tolist())) > 40  # successive output indices are not stuck
    assert torch.equal(a, draw_many(SamplingParams(seed=1), logits, n=200))


def test_huge_and_negative_seeds_use_all_bits():
    logits = torch.zeros(V)
    lo = draw_many(SamplingParams(seed=7), logits, n=200)
    hi = draw_many(SamplingParams(seed=7 + 2**40), logits, n=200)
    neg = draw_many(SamplingParams(seed=-7), logits, n=200)
    assert (lo != hi).float().mean() > 0.9 and (lo != neg).float().mean() > 0.9


# --------------------------------------------------------------------------- statistics


N = 20000


def test_temperature_one_matches_softmax():
    logits = fixed_logits(16, seed=7)
    ids = draw_many(SamplingParams(seed=11), logits, N)
    assert_matches(frequencies(ids, 16), logits.softmax(-1), N)


def test_temperature_scales_distribution():
    logits = fixed_logits(16, seed=8)
    ids = draw_many(SamplingParams(temperature=0.5, seed=12), logits, N)
    assert_matches(frequencies(ids, 16), (logits / 0.5).softmax(-1), N)


def test_top_k_stays_in_k_largest_with_renormalised_frequencies():
    logits = fixed_logits(16, seed=9)
    ids = draw_many(SamplingParams(top_k=4, seed=13), logits, N)
    top = logits.topk(4).indices
    assert torch.isin(ids, top).all()
    probs = torch.zeros(16)
    probs[top] = logits[top].softmax(-1)
    assert_matches(frequencies(ids, 16), probs, N)


def nucleus(probs: torch.Tensor, p: float) -> torch.Tensor:
    order = probs.argsort(descending=True)
    before = probs[order].cumsum(0) - probs[order]
    return order[before < p]


def test_top_p_stays_in_nucleus_with_renormalised_frequencies():
    logits = fixed_logits(16, seed=10)
    probs = logits.softmax(-1)
    keep = nucleus(probs, 0.7)
    assert 1 < len(keep) < 16
    ids = draw_many(SamplingParams(top_p=0.7, seed=14), logits, N)
    assert torch.isin(ids, keep).all()
    expect = torch.zeros(16)
    expect[keep] = probs[keep] / probs[keep].sum()
    assert_matches(frequencies(ids, 16), expect, N)


def test_top_p_tiny_keeps_only_top_token():
    logits = fixed_logits(16, seed=11)
    ids = draw_many(SamplingParams(top_p=1e-6, seed=15), logits, 500)
    assert (ids == logits.argmax()).all()


def test_top_p_applies_to_tempered_distribution():
    logits = fixed_logits(16, seed=12)
    probs = (logits / 2.0).softmax(-1)
    keep = nucleus(probs, 0.5)
    ids = draw_many(SamplingParams(temperature=2.0, top_p=0.5, seed=16), logits, 5000)
    assert torch.isin(ids, keep).all()
    assert set(ids.tolist()) == set(keep.tolist())


def test_min_p_never_below_threshold():
    logits = fixed_logits(16, seed=13)
    probs = logits.softmax(-1)
    allowed = (probs >= 0.1 * probs.max()).nonzero().flatten()
    assert 1 < len(allowed) < 16
    ids = draw_many(SamplingParams(min_p=0.1, seed=17), logits, N)
    assert torch.isin(ids, allowed).all()
    expect = torch.zeros(16)
    expect[allowed] = probs[allowed] / probs[allowed].sum()
    assert_matches(frequencies(ids, 16), expect, N)


@pytest.mark.parametrize("full_sort", [False, True])
def test_top_k_then_top_p_combined(full_sort):
    """Both paths: topk-only (every top-p row has top-k) and full sort (forced by a
    top-p-only row in the batch). The combined row must sample the same either way."""
    logits = fixed_logits(16, seed=14)
    top = logits.topk(6).indices
    cut = torch.full((16,), float("-inf"))
    cut[top] = logits[top]
    keep = nucleus(cut.softmax(-1), 0.6)
    n = 5000
    params = [SamplingParams(top_k=6, top_p=0.6, seed=18)] * n
    if full_sort:
        params = params + [SamplingParams(top_p=0.5, seed=3)]
    inputs = make_inputs(params, seeds=[p.seed for p in params], output_index=list(range(len(params))), slots=[1] * len(params))
    assert inputs.top_p_within_top_k != full_sort
    ids = Sampler(16, 2, "cpu").sample(logits.expand(len(params), -1).contiguous(), inputs).token_ids[:n]
    assert torch.isin(ids, keep).all() and set(ids.tolist()) == set(keep.tolist())
    assert torch.equal(ids, draw_many(SamplingParams(top_k=6, top_p=0.6, seed=18), logits, n))


def test_top_p_within_top_k_leaves_plain_rows_alone():
    logits = fixed_logits(16, seed=16)
    n = N
    params = [SamplingParams(seed=5)] * n + [SamplingParams(top_k=3, top_p=0.5, seed=1)]
    inputs = make_inputs(params, seeds=[5] * n + [1], output_index=list(range(n)) + [0], slots=[1] * (n + 1))
    assert inputs.need_top_p and inputs.top_p_within_top_k
    ids = Sampler(16, 2, "cpu").sample(logits.expand(n + 1, -1).contiguous(), inputs).token_ids[:n]
    assert torch.equal(ids, draw_many(SamplingParams(seed=5), logits, n))


def test_neutral_rows_unaffected_in_batch_needing_every_mask():
    """A plain temperature-1 row next to rows that switch on top-k/top-p/min-p still
    samples the full softmax, because its own parameters are neutral."""
    logits = fixed_logits(16, seed=15)
    n = N
    neutral = SamplingParams(seed=19)
    params = [neutral] * n + [SamplingParams(top_k=2, top_p=0.3, min_p=0.5, seed=1)]
    inputs = make_inputs(params, seeds=[19] * n + [1], output_index=list(range(n)) + [0], slots=[1] * (n + 1))
    assert inputs.need_top_k and inputs.need_top_p and inputs.need_min_p
    ids = Sampler(16, 2, "cpu").sample(logits.expand(n + 1, -1).contiguous(), inputs).token_ids[:n]
    assert_matches(frequencies(ids, 16), logits.softmax(-1), n)
    assert torch.equal(ids, draw_many(neutral, logits, n))


# --------------------------------------------------------------------------- penalties


def penalty_reference(logits, prompt, outputs, rep, pres, freq):
    """vLLM's formulas, token by token."""
    out = logits.clone()
    counts = torch.bincount(torch.tensor(outputs, dtype=torch.int64), minlength=logits.shape[0])
    for v in range(logits.shape[0]):
        if v in prompt or counts[v] > 0:
            out[v] = out[v] / rep if out[v] > 0 else out[v] * rep
        out[v] -= freq * counts[v]
        out[v] -= pres * (counts[v] > 0)
    return out


def test_penalties_follow_vllm_formulas_per_slot():
    sampler = Sampler(V, 8, "cpu")
    pen = SamplingParams(temperature=0, repetition_penalty=1.5, presence_penalty=0.4, frequency_penalty=0.3)
    rep_only = SamplingParams(temperature=0, repetition_penalty=0.8)
    plain = SamplingParams(temperature=0)
    prompts = {3: [1, 2, 5], 5: [7, 8], 6: [1, 9]}
    sampler.start_request(3, prompts[3], pen)
    sampler.start_request(5, prompts[5], rep_only)
    sampler.start_request(6, prompts[6], plain)
    history = {3: [4, 4, 2, 11], 5: [4, 12], 6: [1, 1, 30]}
    for step in range(4):
        slots = [s for s in (3, 5, 6) if step < len(history[s])]
        toks = [history[s][step] for s in slots]
        sampler.record(torch.tensor(slots), torch.tensor(toks))
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(20)) * 2
    inputs = make_inputs([pen, rep_only, plain], slots=[3, 5, 6])
    got = sampler.apply_penalties(logits, inputs)
    torch.testing.assert_close(got[0], penalty_reference(logits[0], prompts[3], history[3], 1.5, 0.4, 0.3))
    torch.testing.assert_close(got[1], penalty_reference(logits[1], prompts[5], history[5], 0.8, 0.0, 0.0))
    assert torch.equal(got[2], logits[2])
    out = sampler.sample(logits, inputs)
    assert torch.equal(out.token_ids, got.argmax(-1))


def test_penalties_steer_greedy_away_from_repeats():
    sampler = Sampler(V, 4, "cpu")
    p = SamplingParams(temperature=0, frequency_penalty=2.0)
    sampler.start_request(1, [0], p)
    logits = torch.zeros(1, V)
    logits[0, 10], logits[0, 11] = 3.0, 2.5
    seen = []
    inputs = make_inputs([p], slots=[1])
    for _ in range(3):
        tok = sampler.sample(logits, inputs).token_ids
        sampler.record(inputs.slots, tok)
        seen.append(int(tok))
    # 10 (3.0 > 2.5); then 10 is at 3-2 = 1 < 2.5 so 11; then 11 is at 0.5 < 1 so 10.
    assert seen == [10, 11, 10]


def test_start_request_resets_reused_slot():
    sampler = Sampler(V, 4, "cpu")
    p = SamplingParams(repetition_penalty=2.0, frequency_penalty=1.0)
    sampler.start_request(2, [5, 6], p)
    sampler.record(torch.tensor([2]), torch.tensor([9]))
    logits = torch.ones(1, V)
    inputs = make_inputs([p], slots=[2])
    before = sampler.apply_penalties(logits, inputs)
    assert before[0, 5] == 0.5 and before[0, 9] == 0.5 - 1.0
    sampler.start_request(2, torch.tensor([7]), p)
    after = sampler.apply_penalties(logits, inputs)
    expect = torch.ones(V)
    expect[7] = 0.5
    assert torch.equal(after[0], expect)


def test_penalty_state_is_lazy():
    sampler = Sampler(V, 4, "cpu")
    sampler.start_request(1, [1, 2], SamplingParams())
    sampler.record(torch.tensor([1]), torch.tensor([3]))  # no state yet: a no-op
    assert not sampler.has_penalty_state
    p = SamplingParams(presence_penalty=1.0)
    with pytest.raises(RuntimeError, match="start_request"):
        sampler.sample(torch.zeros(1, V), make_inputs([p], slots=[1]))
    sampler.start_request(2, [], p)
    assert sampler.has_penalty_state
    assert sampler._output_counts.shape == (4, V)
    with pytest.raises(ValueError, match="slot"):
        sampler.start_request(4, [1], p)


def test_record_counts_repeats_and_padding_rows():
    sampler = Sampler(V, 4, "cpu")
    sampler.start_request(1, [], None)
    sampler.record(torch.tensor([1, 0, 0]), torch.tensor([3, 8, 8]))
    sampler.record(torch.tensor([1, 0, 0]), torch.tensor([3, 8, 8]))
    assert sampler._output_counts[1, 3] == 2 and sampler._output_counts[0, 8] == 4
    assert sampler._output_counts.sum() == 6


# --------------------------------------------------------------------------- logprobs


def test_logprobs_are_raw_log_softmax_at_chosen_token():
    sampler = Sampler(V, 8, "cpu")
    params = [
        SamplingParams(temperature=0, logprobs=0),
        SamplingParams(temperature=0.5, top_k=5, seed=3, logprobs=4),
        SamplingParams(temperature=1.5, seed=4, repetition_penalty=1.7, presence_penalty=1.0),
    ]
    for slot, p in enumerate(params, start=1):
        sampler.start_request(slot, [1, 2, 3], p)
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(21)) * 3
    out = sampler.sample(logits, make_inputs(params))
    ref = torch.log_softmax(logits, -1)
    torch.testing.assert_close(out.logprobs, ref.gather(1, out.token_ids[:, None]).squeeze(1))
    assert out.top_ids.shape == (3, 4) and out.top_logprobs.dtype == torch.float32
    assert (out.top_logprobs[:, :-1] >= out.top_logprobs[:, 1:]).all()
    torch.testing.assert_close(out.top_logprobs, ref.topk(4).values)
    torch.testing.assert_close(out.top_logprobs, ref.gather(1, out.top_ids))


def test_logprobs_zero_gives_chosen_only_and_none_gives_nothing():
    logits = torch.randn(2, V, generator=torch.Generator().manual_seed(22))
    sampler = Sampler(V, 4, "cpu")
    out = sampler.sample(logits, make_inputs([SamplingParams(logprobs=0), SamplingParams()]))
    assert out.logprobs.shape == (2,) and out.top_ids is None and out.top_logprobs is None
    out = sampler.sample(logits, make_inputs([SamplingParams()] * 2))
    assert out.logprobs is None


# --------------------------------------------------------------------------- sync freedom

# aten ops whose result the host must wait for, or whose output shape depends on data.
FORBIDDEN = {
    "_local_scalar_dense",  # .item(), bool(t), int(t), float(t)
    "nonzero",
    "nonzero_static",
    "masked_select",
    "unique",
    "_unique",
    "_unique2",
    "unique_consecutive",
    "unique_dim",
    "repeat_interleave",
    "masked_scatter",
    "_assert_async",  # fine on CUDA, but must not appear where we claim no asserts
}


class OpRecorder(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name.split("::")[-1]
        self.ops.append(name)
        if name in ("index", "index_put", "index_put_", "_index_put_impl_"):
            # Boolean-mask indexing (read or write) needs a nonzero on CUDA; integer indexing is fine.
            assert all(i is None or i.dtype not in (torch.bool, torch.uint8) for i in args[1]), "bool index"
        return func(*args, **(kwargs or {}))


def _forbid(monkeypatch):
    def boom(*_a, **_k):
        raise AssertionError("host read in the sampling path")

    for name in ("item", "tolist", "nonzero", "__bool__", "numpy", "cpu"):
        monkeypatch.setattr(torch.Tensor, name, boom)
    monkeypatch.setattr(torch, "nonzero", boom)


def test_sampling_path_has_no_host_reads(monkeypatch):
    sampler = Sampler(V, 8, "cpu")
    params = MIXED + [
        SamplingParams(temperature=0.8, seed=8, repetition_penalty=1.2, presence_penalty=0.3, frequency_penalty=0.2, logprobs=5),
        SamplingParams(temperature=0, frequency_penalty=0.5, logprobs=0),
    ]
    for slot, p in enumerate(params, start=1):
        sampler.start_request(slot % 8, [1, 4, 9], p)
    # top_p path and top_k-only path both audited.
    batches = [make_inputs(params, slots=[i % 8 for i in range(1, len(params) + 1)])]
    batches.append(make_inputs([SamplingParams(top_k=3, seed=1), SamplingParams(min_p=0.3, seed=2)]))
    batches.append(make_inputs([SamplingParams(temperature=0)] * 2))
    biased = make_inputs([SamplingParams(temperature=0), SamplingParams(seed=3)])  # logit_bias, bans
    batches.append(SamplingInputs.build([SamplingParams(temperature=0), SamplingParams(seed=3)], [1, 3], [0, 0],
                                        [1, 2], biases=[((5, 2.0), (7, float("-inf"))), ((1, -3.0),)]))
    assert biased.bias_index is None and batches[-1].need_bias
    logits = torch.randn(len(params), V, generator=torch.Generator().manual_seed(23))
    for inputs in batches:
        rec = OpRecorder()
        _forbid_ctx = pytest.MonkeyPatch.context()
        with _forbid_ctx as mp, rec:
            _forbid(mp)
            out = sampler.sample(logits[: inputs.batch_size], inputs)
            sampler.record(inputs.slots, out.token_ids)
        assert rec.ops and not (set(rec.ops) & FORBIDDEN), set(rec.ops) & FORBIDDEN
        assert isinstance(out, SampleOutput)


def test_forbid_actually_catches_host_reads(monkeypatch):
    """The audit above would pass vacuously if the patches did nothing."""
    t = torch.tensor([1.0, 2.0])
    with pytest.MonkeyPatch.context() as mp:
        _forbid(mp)
        with pytest.raises(AssertionError):
            t.max().item()
        with pytest.raises(AssertionError):
            bool(t[0])
    rec = OpRecorder()
    with rec:
        _ = int(t.sum())
        with pytest.raises(AssertionError, match="bool index"):
            t[t > 1]
        with pytest.raises(AssertionError, match="bool index"):
            t[t > 1] = 0.0
    assert "_local_scalar_dense" in rec.ops


# --------------------------------------------------------------------------- CUDA (device machine)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_matches_cpu_and_is_sync_free():
    vocab = 4096
    params = MIXED + [SamplingParams(temperature=0.9, seed=77, repetition_penalty=1.3, frequency_penalty=0.5, logprobs=3)]
    n = len(params)
    logits = torch.randn(n, vocab, generator=torch.Generator().manual_seed(24)) * 3
    results = {}
    for dev in ("cpu", "cuda"):
        sampler = Sampler(vocab, 16, dev)
        for slot, p in enumerate(params, start=1):
            sampler.start_request(slot, [1, 2, 3, 500], p)
        toks = []
        for step in range(8):
            host = make_inputs(params, output_index=[step] * n)
            if dev == "cuda":
                host = SamplingInputs.build(params, [p.seed or 1234 for p in params], [step] * n, list(range(1, n + 1)), pin_memory=True)
            inputs = host.to(dev)
            dl = logits.to(dev)
            if dev == "cuda":
                torch.cuda.synchronize()
                torch.cuda.set_sync_debug_mode("error")
            try:
                out = sampler.sample(dl, inputs)
                sampler.record(inputs.slots, out.token_ids)
            finally:
                if dev == "cuda":
                    torch.cuda.set_sync_debug_mode(0)
            toks.append(out.token_ids.cpu())
        results[dev] = torch.stack(toks)
    assert torch.equal(results["cpu"], results["cuda"])


def test_sparse_bias_adds_per_row_and_bans():
    """logit_bias values add to their row only; -inf bans; rows without entries are untouched."""
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(5))
    top = logits.argmax(dim=-1)
    inputs = SamplingInputs.build([SamplingParams(temperature=0)] * 3, [1, 2, 3], [0, 0, 0], [1, 2, 3],
                                  biases=[((9, 100.0),), ((int(top[1]), float("-inf")),), ()])
    out = Sampler(V, 8, "cpu").sample(logits, inputs)
    assert out.token_ids[0] == 9 and out.token_ids[1] != top[1] and out.token_ids[2] == top[2]
