"""Speculative decoding with a draft model (issue 20): the draft's KV shares the target's slots
and stays valid wherever the target's is, greedy output is plain decoding's, a model drafting
for itself has every proposal accepted, and sampled rows keep the target's distribution
through rejection sampling against the draft's."""
import pytest
import torch

from tandem import SamplingParams
from tandem.config import Experiments
from tandem.speculative.draft import check_draft
from test_speculative_engine import _engine, _generate, _prompts
from tiny_models import TEST_DEVICE, make_cycling_model, make_tiny_model
from workload import assert_kv_conserved, assert_same_tokens, random_specs, run_workload


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return make_cycling_model(tmp_path_factory.mktemp("target"))


@pytest.fixture(scope="module")
def other_draft(tmp_path_factory):
    """Another cycling model (other weights, one layer): it agrees with the target often, not always."""
    return make_cycling_model(tmp_path_factory.mktemp("draft"), seed=7, num_hidden_layers=1, layer_scale=0.6)


def _draft(path, k: int = 4, **more) -> dict:
    return {"model": str(path), "num_speculative_tokens": k, **more}


@pytest.mark.parametrize("overlap", [True, False])
def test_a_model_drafting_for_itself_has_every_proposal_accepted(target, overlap):
    prompts = _prompts(8, seed=1)
    params = [SamplingParams(max_tokens=45, temperature=0, ignore_eos=True),
              SamplingParams(max_tokens=17, temperature=0, ignore_eos=True)]
    plain, _ = _generate(target, prompts, params, disable_overlap=not overlap)
    spec, stats = _generate(target, prompts, params, _draft(target), disable_overlap=not overlap)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    assert stats["spec_decode_num_draft_tokens"] > 100
    assert stats["spec_decode_num_accepted_tokens"] == stats["spec_decode_num_draft_tokens"]


def _fuzzed_workload(seed: int, temperature: float, overlap: bool) -> tuple[list, dict]:
    """40 requests at `temperature` (EOS ignored), every fourth sharing a prefix, and engine
    settings small enough for chunked prefill, prefix hits and preemption."""
    specs = random_specs(40, 256, seed=seed)
    for s in specs:
        s.params = s.params.clone(temperature=temperature, ignore_eos=True)
    for s in specs[::4]:
        s.prompt = specs[0].prompt[:30] + s.prompt[:10]
    return specs, dict(max_prefill_tokens=96, chunked_prefill_size=48, max_total_tokens=300,
                       disable_overlap=not overlap)


@pytest.mark.parametrize("overlap", [True, False])
def test_the_fuzzed_workload_with_another_draft_is_plain_decodings(target, other_draft, overlap):
    """Arrivals, chunked prefill, prefix hits, aborts and preemption, greedy: every request's
    tokens equal plain decoding's (an aborted one may have seen more before its abort)."""
    specs, kw = _fuzzed_workload(seed=4, temperature=0.0, overlap=overlap)
    plain_engine, spec_engine = _engine(target, **kw), _engine(target, _draft(other_draft), **kw)
    plain, spec = run_workload(plain_engine, specs), run_workload(spec_engine, specs)
    assert_same_tokens(plain, spec, specs)
    stats = spec_engine.stats()
    assert stats["num_preemptions"] > 0 and stats["prefix_cache_hit_tokens"] > 0
    drafted, accepted = stats["spec_decode_num_draft_tokens"], stats["spec_decode_num_accepted_tokens"]
    assert 0 < accepted < drafted  # another model: some proposals are wrong
    for engine in (plain_engine, spec_engine):
        assert_kv_conserved(engine)


def test_self_drafting_through_preemption_and_prefix_hits_accepts_everything(target):
    """The draft's KV at prefix-cache hits and after preemption is what its own forward wrote:
    with the target drafting for itself every proposal is still accepted."""
    specs = random_specs(30, 256, seed=6)
    for s in specs:
        s.params = s.params.clone(temperature=0.0, ignore_eos=True)
        s.abort_after = None
    for s in specs[::3]:
        s.prompt = specs[0].prompt[:30] + s.prompt[:10]
    engine = _engine(target, _draft(target), max_prefill_tokens=96, chunked_prefill_size=48, max_total_tokens=300)
    run_workload(engine, specs)
    stats = engine.stats()
    assert stats["num_preemptions"] > 0 and stats["prefix_cache_hit_tokens"] > 0
    assert stats["spec_decode_num_accepted_tokens"] == stats["spec_decode_num_draft_tokens"] > 50
    assert_kv_conserved(engine)


def _cycle_next(token: int, cycle: int, vocab: int = 256) -> int:
    """make_cycling_model's favourite next token."""
    start = token - token % cycle
    return start + (token + 1 - start) % cycle if start + cycle <= vocab else token


def _second_token_kinds(path, spec, trials: int, draft_cycle: int) -> torch.Tensor:
    """Counts of the second emitted token (the first a verify step emits) of `trials` seeded
    requests by kind: the target's favourite after the first, the draft's, anything else."""
    # Three tokens: the first verify step (after the prefill's sample) has room for one proposal.
    params = [SamplingParams(max_tokens=3, temperature=1.0, seed=s, ignore_eos=True) for s in range(trials)]
    outs, stats = _generate(path, [[7, 8, 9]] * trials, params, spec, max_running_requests=128)
    if spec is not None:
        assert stats["spec_decode_num_drafts"] > 0
    counts = torch.zeros(3, dtype=torch.float64)
    for o in outs:
        first, second = o.token_ids[:2]
        kind = 0 if second == _cycle_next(first, 5) else 1 if second == _cycle_next(first, draft_cycle) else 2
        counts[kind] += 1
    return counts


def _two_sample_p(a: torch.Tensor, b: torch.Tensor) -> float:
    """Chi-square test that two equal-size samples' counts come from one distribution."""
    pooled = (a + b) / 2
    small = pooled < 5  # too few for the test: counted together with the last kind
    if small.any():
        a, b = (torch.cat([x[~small][:-1], x[~small][-1:] + x[small].sum()]) for x in (a, b))
        pooled = (a + b) / 2
    stat = (((a - pooled) ** 2 + (b - pooled) ** 2) / pooled).sum()
    df = torch.tensor(float(len(a) - 1), dtype=torch.float64)
    return float(torch.special.gammaincc(df / 2, stat / 2))


@pytest.mark.slow
def test_sampled_rows_keep_the_targets_distribution(tmp_path_factory, monkeypatch):
    """Temperature 1 on a target whose next-token distribution is spread, with a draft that
    disagrees: the second token's distribution matches plain sampling's; accepting every
    proposal (no rejection step) gives the draft's, which the same test tells apart."""
    root = tmp_path_factory.mktemp("spread")
    # The target's favourite next token has about a third of the mass; the draft (other cycles)
    # mostly proposes another token.
    target = make_cycling_model(root / "t", sharpness=0.6, layer_scale=0.05)
    draft = make_cycling_model(root / "d", cycle=3, sharpness=1.0, layer_scale=0.05, seed=3, num_hidden_layers=1)
    trials = 600
    plain = _second_token_kinds(target, None, trials, 3)
    spec = _second_token_kinds(target, _draft(draft, k=2, disable_by_batch_size=128), trials, 3)
    assert _two_sample_p(plain, spec) > 1e-3

    import tandem.runner as runner
    original = runner.accept_rejection

    def accept_everything(p, q, proposals, count, keys, token_hash):  # the draft's distribution
        return original(q.new_ones(p.shape), q.new_ones(q.shape), proposals, count, keys, token_hash)

    monkeypatch.setattr(runner, "accept_rejection", accept_everything)
    broken = _second_token_kinds(target, _draft(draft, k=2, disable_by_batch_size=128), trials, 3)
    assert _two_sample_p(plain, broken) < 1e-4


def test_seeded_sampling_with_a_draft_is_reproducible(target, other_draft):
    """Counter-based keys: the same seeds give the same tokens, whatever else shares the batch."""
    prompts = _prompts(6, seed=8)
    params = [SamplingParams(max_tokens=30, temperature=0.9, top_p=0.9, seed=40 + i, ignore_eos=True)
              for i in range(6)]
    first, stats = _generate(target, prompts, params, _draft(other_draft))
    again, _ = _generate(target, prompts[:3], params[:3], _draft(other_draft))
    assert [o.token_ids for o in again] == [o.token_ids for o in first[:3]]
    assert stats["spec_decode_num_accepted_tokens"] > 0


def test_incompatible_drafts_are_refused(target, tmp_path):
    small_vocab = make_tiny_model(tmp_path, "llama", vocab_size=128)
    with pytest.raises(ValueError, match="vocabulary has 128 tokens, the target's 256"):
        _engine(target, _draft(small_vocab))
    with pytest.raises(ValueError, match="the draft model '/no/such/draft'.*does not exist"):
        _engine(target, _draft("/no/such/draft"))

    class Vocab:
        def __init__(self, vocab):
            self.vocab = vocab

        def get_vocab(self):
            return self.vocab

    class Config:
        vocab_size = 3

    check_draft(Config, Vocab({"a": 0, "b": 1, "c": 2}), Config, Vocab({"a": 0, "b": 1, "c": 2}))
    check_draft(Config, None, Config, Vocab({"a": 0}))  # no tokenizer to compare: the sizes agree
    with pytest.raises(ValueError, match="tokenizer differs from the target's.*'c' -> 2"):
        check_draft(Config, Vocab({"a": 0, "b": 1, "c": 2}), Config, Vocab({"a": 0, "b": 1, "d": 2}))


@pytest.mark.slow
def test_a_truncated_draft_is_the_targets_first_layers(tiny_text_model, tmp_path):
    """`tandem bench truncated-draft`: all layers kept drafts for its own model (every proposal
    accepted); one layer kept still gives plain decoding's greedy text."""
    import json

    from tandem.bench.truncated_draft import main
    main(["--model", str(tiny_text_model), "--layers", "2", "--dtype", "float32", "--out", str(tmp_path / "all")])
    main(["--model", str(tiny_text_model), "--layers", "1", "--dtype", "float32", "--out", str(tmp_path / "one")])
    assert json.loads((tmp_path / "one" / "config.json").read_text())["num_hidden_layers"] == 1
    prompts = _prompts(4, seed=3)
    params = [SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)]
    plain, _ = _generate(tiny_text_model, prompts, params)
    whole, stats = _generate(tiny_text_model, prompts, params, _draft(tmp_path / "all"))
    assert [o.token_ids for o in whole] == [o.token_ids for o in plain]
    drafted, accepted = stats["spec_decode_num_draft_tokens"], stats["spec_decode_num_accepted_tokens"]
    if TEST_DEVICE == "cpu":
        assert accepted == drafted > 0
    else:  # cuBLAS rounds a one-row draft step and a five-row verify apart: random logits' near-ties
        assert accepted >= 0.95 * drafted > 0
    one, stats = _generate(tiny_text_model, prompts, params, _draft(tmp_path / "one"))
    assert [o.token_ids for o in one] == [o.token_ids for o in plain]
    assert stats["spec_decode_num_draft_tokens"] > 0
    with pytest.raises(ValueError, match=r"--layers must be in \[1, 2\]"):
        main(["--model", str(tiny_text_model), "--layers", "3", "--out", str(tmp_path / "x")])


@pytest.mark.parametrize("single_query", [False, True], ids=["k_plus_1_queries", "single_query"])
@pytest.mark.parametrize("coupled", [False, True])
def test_the_fixed_shape_layout_with_a_draft(target, other_draft, coupled, single_query):
    """What a captured verify graph runs, eagerly on the CPU (every row k + 1 draft forwards
    and queries, padding rows), greedy and sampled rows together: greedy outputs are plain's,
    the greedy-only steps settle in the tail, sampled rows finish (coupled: as plain's too).
    `single_query`: the steps where no row proposes run the one-query set (the draft's
    forwards still run in it: its KV follows every token)."""
    from test_speculative_engine import _eager_verify_graphs, _record_replays
    prompts = _prompts(5, seed=12)
    params = [SamplingParams(max_tokens=20 + 7 * i, temperature=0.8 * (i % 2), seed=i, ignore_eos=True)
              for i in range(5)]
    plain, _ = _generate(target, prompts, params)
    engine = _engine(target, _draft(other_draft), experiments=Experiments(spec_coupled_draft=coupled))
    _eager_verify_graphs(engine, single_query=single_query)
    calls = _record_replays(engine)
    rids = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    while engine.has_unfinished():
        engine.step()
    outs = [engine.output(r).token_ids for r in rids]
    assert [o for o, p in zip(outs, params) if p.temperature == 0] == \
           [o.token_ids for o, p in zip(plain, params) if p.temperature == 0]
    assert [len(o) for o in outs] == [p.max_tokens for p in params]
    if coupled:
        assert outs == [o.token_ids for o in plain]
    assert {8, 4, 2, 1} & set(calls) and engine.stats()["spec_decode_num_accepted_tokens"] > 20
    assert any(b < 0 for b in calls) == single_query  # rows near max_tokens propose nothing
    assert int(engine.spec_state.length[0]) == 0
    assert_kv_conserved(engine)
    engine.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("coupled", [False, True])
def test_draft_steps_have_no_hidden_sync_on_cuda(target, coupled):
    """On the GPU, graphs captured with the draft inside (decode graphs mirror its KV, verify
    graphs run its k + 1 forwards), under sync-debug "error": the target drafting for itself
    has every greedy proposal accepted and gives plain decoding's greedy outputs (coupled
    draws: the sampled rows' too)."""
    from test_speculative_engine import _generate_on
    from workload import step_without_host_syncs
    prompts = _prompts(8, seed=4)
    params = [SamplingParams(max_tokens=40 + 9 * i, temperature=0.7 * (i % 2), seed=i, ignore_eos=True)
              for i in range(8)]
    outs = []
    for spec in (None, _draft(target, disable_by_batch_size=4)):
        engine = _engine(target, spec, device="cuda", experiments=Experiments(spec_coupled_draft=coupled))
        _generate_on(engine, prompts[:2], params[:2])  # compile every shape first
        for i, (p, sp) in enumerate(zip(prompts, params)):
            engine.add_request(p, sp, request_id=f"g{i}")
        step_without_host_syncs(engine)
        outs.append([engine.output(f"g{i}").token_ids for i in range(8)])
        if spec is not None:
            stats = engine.stats()
            assert stats["spec_decode_num_accepted_tokens"] > 50 and stats["spec_decode_verify_steps"] > 0
        engine.close()
    assert outs[0][::2] == outs[1][::2]  # the greedy rows
    assert [len(o) for o in outs[1]] == [p.max_tokens for p in params]
    if coupled:
        assert outs[0] == outs[1]


@pytest.mark.parametrize("overlap", [True, False])
def test_coupled_draws_make_sampled_rows_plain_decodings(target, other_draft, overlap):
    """`Experiments.spec_coupled_draft`: the draft draws with the noise plain sampling uses at
    each output index and the verify takes its draws as point masses, so sampled rows (seeds,
    temperature, top-k/top-p) emit plain decoding's tokens through arrivals, chunked prefill,
    prefix hits, aborts, preemption and a pool too short to propose at some steps. Rejection
    sampling (the default) keeps only the distribution: its tokens differ. The shared noise is
    what makes draws acceptable: with the draft's own noise (salted) 2 % of them were, coupled
    10 %, rejection sampling 12 % (this workload, no pool limit)."""
    specs, kw = _fuzzed_workload(seed=5, temperature=0.9, overlap=overlap)
    plain_engine = _engine(target, **kw)
    coupled_engine = _engine(target, _draft(other_draft), experiments=Experiments(spec_coupled_draft=True), **kw)
    rejection_engine = _engine(target, _draft(other_draft), **kw)
    plain = run_workload(plain_engine, specs)
    assert_same_tokens(plain, run_workload(coupled_engine, specs), specs)
    stats = coupled_engine.stats()
    assert stats["num_preemptions"] > 0 and stats["prefix_cache_hit_tokens"] > 0
    drafted, accepted = stats["spec_decode_num_draft_tokens"], stats["spec_decode_num_accepted_tokens"]
    assert 0 < accepted < drafted  # another model: some draws differ from the target's
    rejection = run_workload(rejection_engine, specs)
    assert any(rejection[s.rid][0] != plain[s.rid][0] for s in specs if s.abort_after is None)
    r = rejection_engine.stats()
    assert accepted / drafted > 0.5 * r["spec_decode_num_accepted_tokens"] / r["spec_decode_num_draft_tokens"]
    for engine in (plain_engine, coupled_engine, rejection_engine):
        assert_kv_conserved(engine)
