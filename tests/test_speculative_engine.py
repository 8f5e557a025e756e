"""Speculative decoding in the engine (issue 20): n-gram proposals verified inside the overlap
loop. Greedy and seeded sampling are token-identical to plain decoding (point-mass verify with
plain decoding's noise keys); the accepted run is cut by stops and max_tokens; KV of accepted
tokens is what plain decoding computes, and rejected positions' slots go back; requests that
cannot speculate (penalties, logprobs, grammars) run in the same steps without proposals."""
import json
import time

import pytest
import torch

from tandem import LLM, SamplingParams
from tandem.config import EngineConfig, Experiments
from tandem.engine import Engine
from tandem.options import add_engine_options, engine_config
from tandem.speculative.config import SpeculativeConfig
from tiny_models import TEST_DEVICE, make_cycling_model
from workload import assert_kv_conserved, assert_same_tokens, random_specs, run_workload

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}


@pytest.fixture(scope="module")
def cycling_model(tmp_path_factory):
    """Greedy outputs cycle through 5 tokens: n-gram proposals are mostly accepted."""
    return make_cycling_model(tmp_path_factory.mktemp("cycling"))


@pytest.fixture(scope="module")
def cycling_text_model(tmp_path_factory, builtin_tokenizer):
    """The same with the built-in tokenizer (stop strings, text)."""
    path = make_cycling_model(tmp_path_factory.mktemp("cycling_text"), sharpness=4.0, layer_scale=0.05,
                              vocab_size=len(builtin_tokenizer), eos_token_id=2)
    builtin_tokenizer.save_pretrained(path)
    return path


def _engine(path, spec=None, **kw) -> Engine:
    # On CUDA fewer decode graphs to capture per engine (the suite's tests part is budgeted).
    kw = {"device": TEST_DEVICE, "cuda_graph_max_batch": 8, **kw}
    return Engine(EngineConfig(model=str(path), dtype="float32", speculative_config=spec, **kw))


def _generate(path, prompts, params, spec=None, **kw) -> tuple[list, dict]:
    engine = _engine(path, spec, **kw)
    rids = [engine.add_request(p, params[i % len(params)]) for i, p in enumerate(prompts)]
    while engine.has_unfinished():
        engine.step()
    outs = [engine.output(r) for r in rids]
    stats = engine.stats()
    assert_kv_conserved(engine)
    engine.close()
    return outs, stats


def _prompts(n: int, vocab: int = 256, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (int(torch.randint(3, 40, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


# ---- the interface ----
@pytest.mark.parametrize("value, message", [
    ({"method": "medusa", "num_speculative_tokens": 2}, "method must be one of"),
    ({"method": "ngram"}, "'num_speculative_tokens' is required"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens must be an integer in [1, 16]"),
    ({"method": "ngram", "num_speculative_tokens": 2.5}, "must be an integer"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 5, "prompt_lookup_max": 3},
     "prompt_lookup_min (5) must not exceed prompt_lookup_max (3)"),
    ({"method": "ngram", "num_speculative_tokens": 2, "lookahead": 1}, "unknown key(s) 'lookahead'"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, "needs 'model'"),
    ({"model": "/some/draft", "num_speculative_tokens": 2, "prompt_lookup_max": 3},
     "prompt_lookup_max are for method 'ngram'"),
    ({"method": "ngram", "model": "/some/draft", "num_speculative_tokens": 2}, "'model' is for method"),
    ("{not json", "must be a JSON object"),
    ([1, 2], "must be a dict"),
])
def test_bad_configs_are_refused_naming_the_problem(value, message):
    with pytest.raises(ValueError) as err:
        SpeculativeConfig.from_user(value)
    assert message in str(err.value)


def test_the_flag_takes_json_and_llm_the_dict(cycling_model):
    import argparse
    parser = argparse.ArgumentParser()
    add_engine_options(parser)
    cfg = engine_config(parser.parse_args(["--speculative-config", json.dumps(NGRAM)]))
    assert SpeculativeConfig.from_user(cfg.speculative_config) == SpeculativeConfig("ngram", 4, prompt_lookup_max=3)
    assert engine_config(parser.parse_args([])).speculative_config is None
    with pytest.raises(SystemExit):
        parser.parse_args(["--speculative-config", "[1]"])
    with pytest.raises(ValueError, match="method must be one of"):
        _engine(cycling_model, {"method": "eagle", "num_speculative_tokens": 1})


# ---- exactness ----
@pytest.mark.parametrize("overlap", [True, False])
def test_greedy_and_seeded_outputs_are_those_of_plain_decoding(cycling_model, overlap):
    prompts = _prompts(10)
    params = [SamplingParams(max_tokens=60, temperature=0, ignore_eos=True),
              SamplingParams(max_tokens=23, temperature=0, ignore_eos=True),
              SamplingParams(max_tokens=40, temperature=1.0, top_p=0.95, top_k=50, min_p=0.01, seed=11,
                             ignore_eos=True)]
    plain, _ = _generate(cycling_model, prompts, params, disable_overlap=not overlap)
    spec, stats = _generate(cycling_model, prompts, params, NGRAM, disable_overlap=not overlap)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    assert [o.finish_reason for o in spec] == [o.finish_reason for o in plain]
    # Proposals were accepted, most of them: the outputs cycle.
    assert stats["spec_decode_num_accepted_tokens"] > 0.6 * stats["spec_decode_num_draft_tokens"] > 0
    assert stats["spec_decode_mean_acceptance_length"] > 3
    # Most greedy tokens came as accepted proposals (their outputs cycle).
    greedy_tokens = sum(len(o.token_ids) for o, p in zip(plain, params * 4) if p.temperature == 0)
    assert stats["spec_decode_num_accepted_tokens"] > 0.5 * greedy_tokens


@pytest.mark.parametrize("overlap", [True, False])
def test_the_fuzzed_workload_is_unchanged(cycling_model, overlap):
    """Arrivals, chunked prefill, prefix hits, aborts and preemption (a KV pool of 300
    tokens): every request's tokens equal plain decoding's; an aborted one may have seen more
    tokens before its abort (a verify emits several), so the shorter is a prefix of the longer."""
    specs = random_specs(40, 256, seed=3)
    for s in specs[::4]:  # shared prefixes: prefix-cache hits
        s.prompt = specs[0].prompt[:30] + s.prompt[:10]
    kw = dict(max_prefill_tokens=96, chunked_prefill_size=48, max_total_tokens=300, disable_overlap=not overlap)
    plain_engine, spec_engine = _engine(cycling_model, **kw), _engine(cycling_model, NGRAM, **kw)
    plain, spec = run_workload(plain_engine, specs), run_workload(spec_engine, specs)
    assert_same_tokens(plain, spec, specs)
    stats = spec_engine.stats()
    assert stats["num_preemptions"] > 0 and stats["prefix_cache_hit_tokens"] > 0
    assert stats["spec_decode_num_accepted_tokens"] > 100
    for engine in (plain_engine, spec_engine):
        assert_kv_conserved(engine)


def test_stops_and_max_tokens_cut_the_accepted_run(cycling_text_model):
    """A verify emits up to five tokens; a stop token, a stop string or max_tokens inside that
    run ends the request there, with plain decoding's text and finish reason."""
    greedy = SamplingParams(max_tokens=30, temperature=0)
    [probe], _ = _generate(cycling_text_model, [[100, 200, 300]], [greedy])
    cycle_token, text = probe.token_ids[7], probe.text
    params = [greedy.clone(max_tokens=9), greedy.clone(stop_token_ids=[cycle_token]),
              greedy.clone(stop=[text[12:15]]), greedy.clone(stop=[text[12:15]], include_stop_str_in_output=True),
              greedy.clone(max_tokens=1)]
    prompts = [[100, 200, 300]] * len(params)
    plain, _ = _generate(cycling_text_model, prompts, params)
    spec, stats = _generate(cycling_text_model, prompts, params, NGRAM)
    assert [(o.token_ids, o.text, o.finish_reason, o.outputs[0].stop_reason) for o in spec] == \
           [(o.token_ids, o.text, o.finish_reason, o.outputs[0].stop_reason) for o in plain]
    assert [o.finish_reason for o in spec] == ["length", "stop", "stop", "stop", "length"]
    assert len(spec[0].token_ids) == 9 and spec[1].token_ids[-1] == cycle_token
    assert stats["spec_decode_num_accepted_tokens"] > 0


def test_accepted_tokens_kv_is_plain_decodings_and_enters_the_cache(cycling_model):
    """The KV that verify steps wrote for accepted tokens, found in the radix tree after the
    request finished, equals what plain decoding wrote (float32 on the CPU: the same values
    up to rounding of batched vs one-token attention)."""
    prompt, params = _prompts(1, seed=5)[0], SamplingParams(max_tokens=50, temperature=0, ignore_eos=True)
    caches = []
    for spec in (None, NGRAM):
        engine = _engine(cycling_model, spec)
        rid = engine.add_request(prompt, params)
        while engine.has_unfinished():
            engine.step()
        tokens = prompt + engine.output(rid).token_ids
        slots, _ = engine.prefix_cache.tree.match(tokens[:-1])
        assert len(slots) == len(tokens) - 1  # every token whose KV exists was cached
        index = torch.tensor(slots)
        caches.append([(layer_k[index].clone(), layer_v[index].clone())
                       for layer_k, layer_v in zip(engine.kv.k, engine.kv.v)])
        if spec is not None:
            assert engine.stats()["spec_decode_num_accepted_tokens"] > 10
        engine.close()
    for (k0, v0), (k1, v1) in zip(*caches):
        torch.testing.assert_close(k1, k0, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(v1, v0, atol=1e-4, rtol=1e-4)


def test_penalties_logprobs_and_grammars_with_speculation(cycling_text_model):
    """Penalties (applied position by position: a query counts the row's proposals before
    it), logprobs (for every emitted token), a logit bias and min_tokens speculate beside
    plain rows; every output, logprobs included, is plain decoding's. A grammar's step
    verifies nothing (its masks are per row), and its output is still plain's."""
    pytest.importorskip("xgrammar")
    greedy = SamplingParams(max_tokens=24, temperature=0)
    params = [greedy, greedy.clone(repetition_penalty=1.3, frequency_penalty=0.5), greedy.clone(logprobs=3),
              greedy.clone(max_tokens=24, min_tokens=20, ignore_eos=False), greedy.clone(seed=4, temperature=0.7),
              greedy.clone(presence_penalty=1.5, seed=5, temperature=0.8, logprobs=0)]
    prompts = [[100 + i, 200, 300] for i in range(len(params))]
    plain, _ = _generate(cycling_text_model, prompts, params)
    spec, stats = _generate(cycling_text_model, prompts, params, NGRAM)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    for i in (2, 5):
        lp_spec, lp_plain = spec[i].outputs[0].logprobs, plain[i].outputs[0].logprobs
        # The same tokens; values up to float32 rounding (a verify step's attention is batched).
        assert [(lp.token_id, [t for t, _ in lp.top]) for lp in lp_spec] == \
               [(lp.token_id, [t for t, _ in lp.top]) for lp in lp_plain]
        flat = lambda lps: [v for lp in lps for v in [lp.logprob] + [x for _, x in lp.top]]  # noqa: E731
        assert flat(lp_spec) == pytest.approx(flat(lp_plain), abs=1e-4)
    assert stats["spec_decode_num_accepted_tokens"] > 0
    for i in (1, 2, 5):  # alone: these requests' own proposals are accepted
        _, alone = _generate(cycling_text_model, prompts[i:i + 1], params[i:i + 1], NGRAM)
        assert alone["spec_decode_num_accepted_tokens"] > 5, i
    # With a grammar in the batch the steps verify nothing, and the output is still plain's.
    constrained = [greedy.clone(regex="(ab|cd){3,8}")] + params[:2]
    plain, _ = _generate(cycling_text_model, prompts[:3], constrained)
    spec, _ = _generate(cycling_text_model, prompts[:3], constrained, NGRAM)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]


def test_penalties_count_each_querys_earlier_proposals(tmp_path):
    """Outputs cycling through two tokens, so a row's k = 4 proposals repeat each token, and
    penalties that break the cycle after some count: a query that did not count the proposals
    before it would break it at another position than plain decoding. Greedy and sampled,
    n-gram and a self-drafting model."""
    model = make_cycling_model(tmp_path, cycle=2)
    prompts = _prompts(6, seed=21)
    params = [SamplingParams(max_tokens=40, temperature=0, frequency_penalty=0.9, ignore_eos=True),
              SamplingParams(max_tokens=40, temperature=0, frequency_penalty=0.4, presence_penalty=1.0,
                             ignore_eos=True),
              SamplingParams(max_tokens=40, temperature=0.8, seed=9, frequency_penalty=0.6, ignore_eos=True)]
    plain, _ = _generate(model, prompts, params)
    # n-gram rows verify after any match: the broken cycles' one-token matches verify too (more
    # queries counting earlier proposals than the default rule's two-token matches give).
    any_match = Experiments(spec_verify_min_match=1)
    for spec in (NGRAM, {"model": str(model), "num_speculative_tokens": 4}):
        outs, stats = _generate(model, prompts, params, spec, experiments=any_match)
        got = [o.token_ids for o in outs]
        if "model" in spec:  # sampled rows are the target's distribution, not plain's tokens
            got, want = got[0::3] + got[1::3], [o.token_ids for o in plain[0::3] + plain[1::3]]
        else:
            want = [o.token_ids for o in plain]
        assert got == want
        assert stats["spec_decode_num_accepted_tokens"] > 20


def test_large_batches_decode_without_proposals(cycling_model):
    """disable_by_batch_size: steps with more decoding rows verify nothing (plain decode
    rows, after one step whose lengths are still on the device)."""
    prompts = _prompts(6, seed=2)
    params = [SamplingParams(max_tokens=30 + 7 * i, temperature=0, ignore_eos=True) for i in range(6)]
    plain, _ = _generate(cycling_model, prompts, params)
    spec, stats = _generate(cycling_model, prompts, params, {**NGRAM, "disable_by_batch_size": 3})
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    # Speculation began only once at most three requests were left.
    assert 0 < stats["spec_decode_num_drafts"] and stats["spec_decode_verify_steps"] < stats["steps"]


def test_llm_with_n_samples(cycling_model):
    prompts = _prompts(3, seed=9)
    params = SamplingParams(n=3, max_tokens=20, temperature=1.0, seed=1, ignore_eos=True)
    outs = []
    for spec in (None, NGRAM):
        llm = LLM(model=str(cycling_model), device=TEST_DEVICE, dtype="float32", speculative_config=spec)
        outs.append([[c.token_ids for c in o.outputs] for o in llm.generate(prompts, params, use_tqdm=False)])
        llm.close()
    assert outs[0] == outs[1]


def test_the_server_takes_the_flag_and_counts_in_metrics(cycling_text_model, tmp_path):
    """`tandem serve --speculative-config JSON`: the completion is plain decoding's, and
    /metrics counts drafts, proposals and accepted tokens (per position too)."""
    import openai
    from test_server import _metrics, running_server

    [plain], _ = _generate(cycling_text_model, [[100, 200, 300]], [SamplingParams(max_tokens=40, temperature=0)])
    with running_server(cycling_text_model, tmp_path / "server.log", "--speculative-config", json.dumps(NGRAM)) \
            as (url, proc):
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        done = client.completions.create(model=cycling_text_model.name, prompt=[100, 200, 300], max_tokens=40, temperature=0)
        assert done.choices[0].text == plain.text
        deadline = time.monotonic() + 10
        while (m := _metrics(url)).get("tandem_spec_decode_num_accepted_tokens_total", 0) == 0:
            assert time.monotonic() < deadline, m
            time.sleep(0.1)
    assert m["tandem_spec_decode_num_drafts_total"] > 0
    assert m["tandem_spec_decode_num_draft_tokens_total"] >= m["tandem_spec_decode_num_accepted_tokens_total"]
    assert m['tandem_spec_decode_num_accepted_tokens_per_pos_total{position="0"}'] > 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_verify_steps_have_no_hidden_sync_on_cuda(cycling_model):
    """On the GPU (Triton kernels, CUDA graphs for plain steps) under sync-debug "error":
    verify steps, the switch to plain decode rows above disable_by_batch_size and back, and
    sampled rows run with no host sync but the one completion wait; outputs are plain's."""
    from workload import step_without_host_syncs
    prompts = _prompts(8, seed=4)
    params = [SamplingParams(max_tokens=40 + 9 * i, temperature=0.7 * (i % 2), seed=i, ignore_eos=True)
              for i in range(8)]
    outs = []
    for spec in (None, {**NGRAM, "disable_by_batch_size": 4}):
        engine = _engine(cycling_model, spec, device="cuda")
        _generate_on(engine, prompts[:2], params[:2])  # compile every shape first
        for i, (p, sp) in enumerate(zip(prompts, params)):
            engine.add_request(p, sp, request_id=f"g{i}")
        step_without_host_syncs(engine)
        outs.append([engine.output(f"g{i}").token_ids for i in range(8)])
        if spec is not None:
            stats = engine.stats()
            assert stats["spec_decode_num_accepted_tokens"] > 50 and stats["spec_decode_verify_steps"] > 0
        engine.close()
    assert outs[0] == outs[1]


def _generate_on(engine: Engine, prompts, params) -> None:
    for p, sp in zip(prompts, params):
        engine.add_request(p, sp)
    while engine.has_unfinished():
        engine.step()


def test_the_timeline_shows_verify_steps(cycling_model):
    engine = _engine(cycling_model, NGRAM, timeline=True)
    _generate_on(engine, _prompts(2, seed=6), [SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)] * 2)
    records = list(engine.timeline.records)
    verify = [r for r in records if r.verify_k is not None]
    assert any(r.verify_k == 8 for r in verify)  # both rows with k = 4 proposals
    assert all(r.num_tokens == r.verify_k + r.batch_size for r in verify)
    assert sum(r.accepted for r in verify) == engine.stats()["spec_decode_num_accepted_tokens"] > 0
    assert all(r.proposed is None for r in records if r.verify_k is None)
    engine.close()


def _eager_verify_graphs(engine, extend_max_rows: int = 1, single_query: bool = False):
    """Verify graphs for buckets 1..8 run eagerly (capture=False: what a captured graph runs,
    here on any device), installed in the engine's runner; buckets up to `extend_max_rows`
    in the extend layout, the others a decode row per query. `single_query`: also the set of
    one query a row for the steps where no row proposes."""
    from tandem.speculative.graphs import VerifyGraphs
    e = engine

    def graph_set(queries):
        return VerifyGraphs(e.model, e.kv, e.table, e.backend, e.future_map, e.streams, e.stager, e.spec_state,
                            [1, 2, 4, 8], e.max_model_len, capture=False, extend_max_rows=extend_max_rows,
                            queries=queries)
    graphs = graph_set(None)
    engine.runner.verify_graphs = graphs
    engine.runner.single_query_graphs = graph_set(1) if single_query else None
    return graphs


def _record_replays(engine) -> list[int]:
    """The bucket of every verify-graph replay from now on, negative for the one-query set."""
    calls = []
    for graphs, sign in ((engine.runner.verify_graphs, 1), (engine.runner.single_query_graphs, -1)):
        if graphs is not None:
            real = graphs.replay
            graphs.replay = (lambda real, sign: lambda bucket, ring: calls.append(sign * bucket)
                             or real(bucket, ring))(real, sign)
    return calls


# Experiments.verify_extend_max_rows: every bucket a decode row per query, or every one extend.
LAYOUTS = pytest.mark.parametrize("extend_max_rows", [0, 8], ids=["query_rows", "extend"])


SINGLE_QUERY = pytest.mark.parametrize("single_query", [False, True], ids=["k_plus_1_queries", "single_query"])


@SINGLE_QUERY
@LAYOUTS
def test_the_fixed_shape_layout_of_graphed_verify_steps(cycling_model, extend_max_rows, single_query):
    """What a captured verify graph runs (k + 1 queries every row, those past a row's k_row
    writing the dummy slot, padding rows), here eagerly on the CPU, in either query layout:
    outputs are plain's."""
    prompts = _prompts(7, seed=8)
    extra = {3: {"repetition_penalty": 1.2}, 4: {"logprobs": 2}}
    params = [SamplingParams(max_tokens=20 + 9 * i, temperature=0.8 * (i % 2), seed=i, ignore_eos=True,
                             **extra.get(i, {})) for i in range(7)]
    plain, _ = _generate(cycling_model, prompts, params)
    engine = _engine(cycling_model, NGRAM)
    _eager_verify_graphs(engine, extend_max_rows, single_query)
    calls = _record_replays(engine)  # steps where no row proposes replay the one-query set
    rids = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    while engine.has_unfinished():
        engine.step()
    assert [engine.output(r).token_ids for r in rids] == [o.token_ids for o in plain]
    got, want = engine.output(rids[4]).outputs[0].logprobs, plain[4].outputs[0].logprobs
    assert [lp.token_id for lp in got] == [lp.token_id for lp in want]
    assert [lp.logprob for lp in got] == pytest.approx([lp.logprob for lp in want], abs=1e-4)
    assert {8, 4, 2, 1} & set(calls) and engine.stats()["spec_decode_num_accepted_tokens"] > 50
    assert any(b < 0 for b in calls) == single_query
    assert_kv_conserved(engine)
    engine.close()


@SINGLE_QUERY
@LAYOUTS
def test_greedy_verify_steps_settle_in_the_graphed_tail(cycling_model, extend_max_rows, single_query):
    """A greedy-only graphed verify step samples and settles in its second graph (argmax,
    verdict, lengths, history, the relay): here eagerly on the CPU, the same fixed-shape
    work. Outputs are plain's; a step with a sampled row settles eagerly instead."""
    prompts = _prompts(5, seed=9)
    greedy = [SamplingParams(max_tokens=24 + 7 * i, temperature=0, ignore_eos=True) for i in range(5)]
    plain, _ = _generate(cycling_model, prompts, greedy)
    engine = _engine(cycling_model, NGRAM)
    graphs = _eager_verify_graphs(engine, extend_max_rows, single_query)
    tails = []
    for g in filter(None, (graphs, engine.runner.single_query_graphs)):
        g.replay_tail = (lambda real: lambda *a: tails.append(a[2]) or real(*a))(g.replay_tail)
    rids = [engine.add_request(p, sp) for p, sp in zip(prompts, greedy)]
    while engine.has_unfinished():
        engine.step()
    assert [engine.output(r).token_ids for r in rids] == [o.token_ids for o in plain]
    assert len(tails) > 5 and engine.stats()["spec_decode_num_accepted_tokens"] > 50
    assert int(engine.spec_state.length[0]) == 0  # padding rows (5 requests in bucket 8) never lengthen row 0
    assert_kv_conserved(engine)
    used = len(tails)
    rid = engine.add_request(prompts[0], SamplingParams(max_tokens=20, temperature=0.7, seed=3, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    assert len(tails) == used and len(engine.output(rid).token_ids) == 20
    engine.close()


def _unproposed_run(path, prompts, params, search: bool) -> tuple[list, dict, tuple, list[int], int]:
    """The one-query set's steps with the empty proposal built directly, or (`search`) through
    the general path's n-gram search: outputs, spec metrics, device state, replays, searches."""
    engine = _engine(path, NGRAM)
    _eager_verify_graphs(engine, single_query=True)
    spec = engine.spec_state
    if search:
        spec.prepare_unproposed = spec.prepare
    searches = []
    spec.proposer.propose = (lambda real: lambda *a: searches.append(1) or real(*a))(spec.proposer.propose)
    calls = _record_replays(engine)
    rids = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    while engine.has_unfinished():
        engine.step()
    metrics = {k: v for k, v in engine.stats().items() if k.startswith("spec_")}
    state = (spec.history.clone(), spec.length.clone(), engine.future_map.buf.clone())
    outs = [engine.output(r).token_ids for r in rids]
    assert_kv_conserved(engine)
    engine.close()
    return outs, metrics, state, calls, len(searches)


def test_steps_where_no_row_proposes_skip_the_search_and_leave_the_same_state(cycling_model):
    """The one-query verify set builds its empty proposal without the n-gram search: the same
    outputs (plain's), spec metrics, device history, lengths and relayed tokens as when it
    searched and cut every proposal to k_row 0; only the k + 1-query steps search."""
    prompts = _prompts(5, seed=12)
    params = [SamplingParams(max_tokens=20 + 8 * i, temperature=0.7 * (i % 2), seed=i, ignore_eos=True)
              for i in range(5)]
    plain, _ = _generate(cycling_model, prompts, params)
    outs, metrics, state, calls, searches = _unproposed_run(cycling_model, prompts, params, search=False)
    outs_s, metrics_s, state_s, calls_s, searches_s = _unproposed_run(cycling_model, prompts, params, search=True)
    assert outs == outs_s == [o.token_ids for o in plain]
    assert metrics == metrics_s and metrics["spec_decode_num_accepted_tokens"] > 50
    assert all(torch.equal(a, b) for a, b in zip(state, state_s))
    assert calls == calls_s and any(b < 0 for b in calls)
    assert searches == sum(b > 0 for b in calls) and searches_s == len(calls)


def test_requests_whose_text_does_not_repeat_stop_proposing(tiny_text_model, cycling_model):
    """Random text (the tiny random model): verify rows find few proposals and accept
    almost none, so requests pause proposing and most steps are plain decode steps (CUDA
    graphs on a GPU); the outputs are plain's. Repeating text keeps verifying."""
    prompts = [[5 + i, 17, 33, 8] for i in range(3)]
    params = [SamplingParams(max_tokens=120, temperature=0, ignore_eos=True)]
    plain, _ = _generate(tiny_text_model, prompts, params)
    spec, stats = _generate(tiny_text_model, prompts, params, NGRAM)
    if TEST_DEVICE == "cpu":  # a random model's near-ties: on CUDA batched and one-token attention round apart
        assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    assert stats["spec_decode_verify_steps"] < 0.4 * stats["steps"]
    _, cycling = _generate(cycling_model, prompts, params, NGRAM)
    # Until its cycle has repeated once a request finds no proposal and pauses, then catches up.
    assert cycling["spec_decode_num_accepted_tokens"] > 0.6 * 3 * 120
