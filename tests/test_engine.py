"""Engine behaviour: batch invariance, preemption, page conservation, overlap equivalence."""
import os
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tandem import LLM, SamplingParams
from tandem.engine import Engine
from tandem.config import EngineConfig, Experiments
from tiny_models import TEST_DEVICE
from workload import assert_kv_conserved, random_specs, run_workload


def _engine(path, **kw) -> Engine:
    return Engine(EngineConfig(model=str(path), device=TEST_DEVICE, dtype="float32", **kw))


def _greedy(n):
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)


def test_batch_invariance(tiny_text_model):
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 1000) for _ in range(rng.randint(1, 60))] for _ in range(32)]
    llm = LLM(str(tiny_text_model), device=TEST_DEVICE, dtype="float32")
    together = llm.generate(prompts, _greedy(16), use_tqdm=False)
    for i in (0, 7, 31):
        alone = llm.generate([prompts[i]], _greedy(16), use_tqdm=False)[0]
        assert alone.token_ids == together[i].token_ids


def test_preemption_gives_same_greedy_outputs(tiny_text_model):
    rng = random.Random(1)
    prompts = [[rng.randrange(3, 1000) for _ in range(rng.randint(20, 60))] for _ in range(16)]
    roomy = LLM(str(tiny_text_model), device=TEST_DEVICE, dtype="float32").generate(prompts, _greedy(40), use_tqdm=False)
    tight_llm = LLM(str(tiny_text_model), device=TEST_DEVICE, dtype="float32", max_total_tokens=200)
    tight = tight_llm.generate(prompts, _greedy(40), use_tqdm=False)
    assert [o.token_ids for o in tight] == [o.token_ids for o in roomy]
    assert sum(o.num_preemptions for o in tight) > 0
    assert_kv_conserved(tight_llm.engine)


def test_preemption_keeps_penalty_history(tiny_text_model):
    """A preempted request re-enters with its prompt and earlier outputs in its penalty state,
    so penalised greedy decoding gives the same tokens as without preemption."""
    rng = random.Random(4)
    prompts = [[rng.randrange(3, 1000) for _ in range(rng.randint(20, 60))] for _ in range(12)]
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, repetition_penalty=1.3,
                            presence_penalty=0.5, frequency_penalty=0.3)
    roomy = LLM(str(tiny_text_model), device=TEST_DEVICE, dtype="float32").generate(
        prompts, params, use_tqdm=False)
    tight = LLM(str(tiny_text_model), device=TEST_DEVICE, dtype="float32", max_total_tokens=200).generate(
        prompts, params, use_tqdm=False)
    assert sum(o.num_preemptions for o in tight) > 0
    assert [o.token_ids for o in tight] == [o.token_ids for o in roomy]


def test_readmitted_request_restores_prompt_and_output_history(tiny_text_model):
    engine = _engine(tiny_text_model)
    params = SamplingParams(repetition_penalty=1.2)
    engine.runner.start_request(3, [5, 6, 7, 8], params, outputs=[9, 9, 10])
    mask = engine.sampler._prompt_mask[3]
    counts = engine.sampler._output_counts[3]
    assert mask.nonzero().flatten().tolist() == [5, 6, 7, 8]
    assert {t: int(counts[t]) for t in counts.nonzero().flatten().tolist()} == {9: 2, 10: 1}


def test_steps_without_penalties_count_no_outputs(tiny_text_model):
    """Once a request with penalties allocated the counts, a step whose rows use none adds no
    count (four launches a step less): no request reads a slot's counts but one with penalties,
    and that one resets its slot at admission. A step with one such row counts its tokens."""
    llm = LLM(str(tiny_text_model), device=TEST_DEVICE, dtype="float32")
    penalised = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, presence_penalty=0.5)
    llm.generate([[5, 6, 7]], penalised, use_tqdm=False)
    counts = llm.engine.sampler._output_counts
    counts.zero_()
    llm.generate([[5, 6, 7], [8, 9]], [_greedy(6), SamplingParams(max_tokens=6, temperature=1.0, seed=3)],
                 use_tqdm=False)
    assert int(counts.sum()) == 0
    llm.generate([[5, 6, 7], [8, 9]], [_greedy(6), penalised], use_tqdm=False)
    assert int(counts.sum()) == 6 + 6  # every row of a step with penalties is counted, each in its slot


def test_plain_greedy_batches_build_no_sampling_inputs(tiny_text_model, monkeypatch):
    """A step whose rows are all plain greedy (no penalties, bias, logprobs) builds no sampling
    inputs and gives the tokens the built inputs give; one row with logprobs, a bias or
    min_tokens makes the step build them."""
    from tandem.request import Request
    from tandem.sampling.inputs import SamplingInputs
    built, build = [], SamplingInputs.from_rows
    monkeypatch.setattr(SamplingInputs, "from_rows", staticmethod(lambda *a, **k: built.append(1) or build(*a, **k)))
    prompts = [[5 + i, 6, 7, 8] * (2 + i) for i in range(6)]
    llm = LLM(str(tiny_text_model), device=TEST_DEVICE, dtype="float32")
    built.clear()  # the CUDA warm-up runs sampled and penalised requests: they build inputs
    plain = [o.token_ids for o in llm.generate(prompts, _greedy(12), use_tqdm=False)]
    assert not built
    for extra in (dict(logprobs=0), dict(logit_bias={7: 1.0}), dict(min_tokens=3, ignore_eos=False)):
        other = SamplingParams(**{"max_tokens": 12, "temperature": 0, "ignore_eos": True, **extra})  # EOS banned
        llm.generate(prompts[:2], [_greedy(12), other], use_tqdm=False)
        assert built, extra
        built.clear()
    monkeypatch.setattr(Request, "plain_greedy", property(lambda self: False))  # every step builds them
    assert [o.token_ids for o in llm.generate(prompts, _greedy(12), use_tqdm=False)] == plain
    assert built


@pytest.mark.parametrize("overlap", [True, False])
def test_pages_come_back_after_mixed_workload_with_aborts(tiny_text_model, overlap):
    engine = _engine(tiny_text_model, max_total_tokens=600, chunked_prefill_size=16,
                     disable_overlap=not overlap)
    specs = random_specs(60, 1000, seed=3)
    results = run_workload(engine, specs)
    assert_kv_conserved(engine)
    assert any(r[1] == "abort" for r in results.values())
    assert engine.scheduler.num_preemptions > 0


def test_overlap_on_and_off_are_token_identical(tiny_text_model, builtin_tokenizer):
    """The invariant of the overlap loop: >= 200 requests, greedy and seeded sampling, stop
    strings, stop ids, EOS, aborts, preemption and chunked prefill, same tokens either way."""
    probe = LLM(str(tiny_text_model), device=TEST_DEVICE, dtype="float32").generate(
        [[5, 6, 7], [900, 11], [42]], _greedy(12), use_tqdm=False)
    generated = [t for o in probe for t in o.token_ids]
    stop_pool = [builtin_tokenizer.decode(generated[i:i + 2]) for i in range(0, len(generated) - 1, 3)]
    stop_pool = [s for s in stop_pool if s]
    specs = random_specs(220, 1000, seed=7, stop_pool=stop_pool, stop_id_pool=generated[:10])
    runs = {}
    for overlap in (True, False):
        engine = _engine(tiny_text_model, max_total_tokens=900, chunked_prefill_size=32,
                         max_prefill_tokens=64, disable_overlap=not overlap)  # FutureMap checked: conftest
        engine.eos_token_ids = {generated[3]}  # make EOS actually happen in a random model
        runs[overlap] = run_workload(engine, specs)
        assert_kv_conserved(engine)
        assert engine.scheduler.num_preemptions > 0
    assert runs[True] == runs[False]
    reasons = {r[1] for r in runs[True].values()}
    assert {"stop", "length", "abort"} <= reasons


def test_mixed_batches_match_separate_batches(tiny_text_model):
    specs = random_specs(40, 1000, seed=11)
    runs = [run_workload(_engine(tiny_text_model, chunked_prefill_size=8, max_prefill_tokens=24,
                                 enable_mixed_batch=mixed), specs) for mixed in (False, True)]
    assert runs[0] == runs[1]


def test_consecutive_prefill_switch_keeps_outputs(tiny_text_model):
    specs = random_specs(30, 1000, seed=5)
    runs = [run_workload(_engine(tiny_text_model, max_prefill_tokens=32,
                                 experiments=Experiments(process_before_consecutive_prefill=flag)), specs)
            for flag in (False, True)]
    assert runs[0] == runs[1]


BROKEN_STASH = """
import os, sys
os.environ["TANDEM_DEBUG_FUTURE_MAP"] = "1"
from tandem.config import EngineConfig
from tandem.engine import Engine
from tandem.sampling import SamplingParams
engine = Engine(EngineConfig(model=sys.argv[1], device=sys.argv[2], dtype="float32"))
engine.future_map.stash = lambda slots, ids: None  # test double: forgets to write
engine.add_request([5, 6, 7], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
while engine.has_unfinished():
    engine.step()
"""


def test_broken_stash_is_caught_by_debug_future_map(tiny_text_model):
    # A subprocess: on CUDA the device-side assert poisons the whole process.
    proc = subprocess.run([sys.executable, "-c", BROKEN_STASH, str(tiny_text_model), TEST_DEVICE],
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(  # the repo first, then the rest
                              [str(Path(__file__).parents[1]), *filter(None, [os.environ.get("PYTHONPATH")])])})
    assert proc.returncode != 0
    assert "FutureMap: read of a slot with no stashed token" in proc.stderr, proc.stderr[-2000:]


def test_seeded_sampling_is_reproducible_across_batches(tiny_text_model):
    llm = LLM(str(tiny_text_model), device=TEST_DEVICE, dtype="float32")
    params = SamplingParams(max_tokens=16, temperature=1.0, seed=1234, ignore_eos=True)
    alone = llm.generate([[5, 6, 7]], params, use_tqdm=False)[0].token_ids
    rng = random.Random(2)
    others = [[rng.randrange(3, 1000) for _ in range(rng.randint(1, 30))] for _ in range(9)]
    batch = llm.generate(others[:4] + [[5, 6, 7]] + others[4:], [SamplingParams(
        max_tokens=16, temperature=1.0, ignore_eos=True)] * 4 + [params] + [SamplingParams(
            max_tokens=16, temperature=0.7, ignore_eos=True)] * 5, use_tqdm=False)
    assert batch[4].token_ids == alone
    other_seed = llm.generate([[5, 6, 7]], params.clone(seed=99), use_tqdm=False)[0].token_ids
    assert other_seed != alone


def test_finish_reasons_and_stop_handling(tiny_text_model, builtin_tokenizer):
    llm = LLM(str(tiny_text_model), device=TEST_DEVICE, dtype="float32")
    ref = llm.generate([[5, 6, 7]], _greedy(20), use_tqdm=False)[0]
    assert ref.finish_reason == "length" and len(ref.token_ids) == 20
    stop_id = ref.token_ids[5]
    first = ref.token_ids.index(stop_id)
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=20, temperature=0, stop_token_ids=[stop_id]),
                       use_tqdm=False)[0]
    assert out.finish_reason == "stop" and out.token_ids == ref.token_ids[:first + 1]
    assert out.stop_reason == stop_id
    stop = ref.text[len(ref.text) // 2:len(ref.text) // 2 + 3]
    if stop.strip():
        out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=20, temperature=0, stop=[stop]),
                           use_tqdm=False)[0]
        assert out.finish_reason == "stop" and out.text == ref.text[:ref.text.index(stop)]


def test_logprobs_are_returned(tiny_text_model):
    llm = LLM(str(tiny_text_model), device=TEST_DEVICE, dtype="float32")
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, temperature=0, logprobs=3,
                                                    ignore_eos=True), use_tqdm=False)[0]
    assert len(out.logprobs) == 4
    for tok, position in zip(out.token_ids, out.logprobs):  # vLLM's dict[int, Logprob] per token
        assert len(position) == 3 and next(iter(position)) == tok  # greedy: chosen token is the best
        assert position[tok].rank == 1 and position[tok].logprob <= 0
        assert [lp.rank for lp in position.values()] == [1, 2, 3]


def test_bad_inputs_give_clear_errors(tiny_text_model, tmp_path):
    llm = LLM(str(tiny_text_model), device=TEST_DEVICE, dtype="float32")
    with pytest.raises(ValueError, match="empty"):
        llm.generate([[]], use_tqdm=False)
    with pytest.raises(ValueError, match=r"token ids must be in \[0, "):
        llm.generate([[10**9]], use_tqdm=False)
    with pytest.raises(ValueError, match="maximum context length is 512 tokens"):
        llm.generate([[5] * 600], use_tqdm=False)
    with pytest.raises(ValueError, match="2 sampling params for 1 prompts"):
        llm.generate(["hi"], [SamplingParams(), SamplingParams()], use_tqdm=False)
    with pytest.raises(TypeError, match="unknown option"):
        LLM(str(tiny_text_model), device=TEST_DEVICE, not_an_option=1)
    with pytest.raises(FileNotFoundError, match=str(tmp_path / "nope")):
        LLM(str(tmp_path / "nope"))
    with pytest.raises(ValueError, match="dtype must be one of"):
        LLM(str(tiny_text_model), dtype="float8")
    with pytest.raises(ValueError, match="device must be one of"):
        LLM(str(tiny_text_model), device="tpu")
    for bad in (1.9, "12", True, None):  # token ids are never coerced
        with pytest.raises(ValueError, match="token ids must be ints"):
            llm.generate([[5, bad]], use_tqdm=False)
    with pytest.raises(TypeError, match="must be a SamplingParams"):
        llm.generate("x", {"max_tokens": 4}, use_tqdm=False)
    with pytest.raises(TypeError, match="must be SamplingParams"):
        llm.generate(["x"], [{"max_tokens": 4}], use_tqdm=False)
    with pytest.raises(TypeError, match="must be a SamplingParams"):
        llm.engine.add_request("x", {"max_tokens": 4})
    with pytest.raises(ValueError, match="prompt contains a lone surrogate"):
        llm.generate("abc\ud800def", use_tqdm=False)
    with pytest.raises(ValueError, match="stop contains a lone surrogate"):
        SamplingParams(stop=["\udc00"])
    # The engine is still usable after the errors.
    assert llm.generate([[5, 6]], _greedy(2), use_tqdm=False)[0].finish_reason == "length"
    assert llm.generate([[np.int64(5), 6]], _greedy(2), use_tqdm=False)[0].prompt_token_ids == [5, 6]
    assert_kv_conserved(llm.engine)


def test_mixed_steps_bound_the_prefill_share_while_requests_decode(tiny_text_model):
    """Decode first: with requests decoding, a mixed step carries at most one prefill chunk."""
    engine = _engine(tiny_text_model, enable_mixed_batch=True, chunked_prefill_size=24,
                     max_prefill_tokens=200, timeline=True)
    greedy = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    for i in range(4):
        engine.add_request(list(range(10 + i, 60 + i)), greedy)
    for _ in range(6):
        engine.step()
    engine.add_request(list(range(300, 480)), greedy)  # a long prompt arrives mid-decode
    while engine.has_unfinished():
        engine.step()
    mixed = [r for r in engine.timeline.records if not r.is_decode and r.num_sampled >= 4]
    assert mixed and all(r.num_tokens <= 24 for r in mixed)
    assert max(r.num_tokens for r in engine.timeline.records) > 24  # alone, prefill takes more


@pytest.mark.parametrize("overlap", [True, False])
def test_cancel_of_one_of_two_leaves_the_other_running(tiny_text_model, overlap):
    engine = _engine(tiny_text_model, disable_overlap=not overlap)
    alone = LLM(str(tiny_text_model), device=TEST_DEVICE, dtype="float32").generate(
        [[7, 8, 9]], _greedy(20), use_tqdm=False)[0].token_ids
    keep = engine.add_request([7, 8, 9], _greedy(20))
    drop = engine.add_request([10, 11], _greedy(20))
    streamed = []
    for _ in range(5):
        streamed += [t for o in engine.step() if o.request_id == keep for t in o.new_token_ids]
    engine.cancel([drop])
    assert drop not in engine.requests
    assert not engine.requests[keep].finished  # cancel did not run the other one to completion
    # Nothing launched can still read the cancelled request's KV: its slots are already released.
    assert engine.req_slots.num_free == engine.req_slots.count - 1
    while engine.has_unfinished():
        outs = engine.step()
        assert all(o.request_id != drop for o in outs)
        streamed += [t for o in outs if o.request_id == keep for t in o.new_token_ids]
    assert streamed == engine.output(keep).token_ids == alone  # no output of the other was lost
    engine.release(keep)
    assert_kv_conserved(engine)
