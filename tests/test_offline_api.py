"""The offline API at vLLM's shape: n / best_of, min_tokens, logit_bias, bad_words, stop text,
RequestOutput.outputs, and one context-window error shared with the server."""
import math

import pytest

from tandem import LLM, CompletionOutput, SamplingParams
from tiny_models import TEST_DEVICE
from workload import assert_kv_conserved


@pytest.fixture(scope="module")
def llm(tiny_text_model):
    return LLM(str(tiny_text_model), device=TEST_DEVICE, dtype="float32", max_model_len=64)


def _greedy(n, **kw):
    return SamplingParams(max_tokens=n, temperature=0, **kw)


def test_outputs_shape_and_shortcuts(llm):
    out = llm.generate([[5, 6, 7]], _greedy(4, ignore_eos=True, logprobs=0), use_tqdm=False)[0]
    seq = out.outputs[0]
    assert isinstance(seq, CompletionOutput) and seq.index == 0 and len(out.outputs) == 1
    assert (out.text, out.token_ids, out.finish_reason, out.logprobs) == (
        seq.text, seq.token_ids, seq.finish_reason, seq.logprobs)
    assert seq.cumulative_logprob == pytest.approx(sum(lps[t].logprob for t, lps in zip(seq.token_ids, seq.logprobs)))
    assert out.prompt_logprobs is None and out.finished


def test_n_seeded_samples_differ_and_reproduce(llm):
    sp = SamplingParams(n=4, max_tokens=8, temperature=1.0, seed=7, ignore_eos=True)
    a = llm.generate(["Once upon a time"], sp, use_tqdm=False)[0]
    b = llm.generate(["Once upon a time"], sp, use_tqdm=False)[0]
    assert [o.index for o in a.outputs] == [0, 1, 2, 3]
    assert [o.token_ids for o in a.outputs] == [o.token_ids for o in b.outputs]
    assert len({tuple(o.token_ids) for o in a.outputs}) > 1
    # Sequence 0 is the same sample as n=1 with the same seed.
    one = llm.generate(["Once upon a time"], sp.clone(n=1), use_tqdm=False)[0]
    assert one.token_ids == a.outputs[0].token_ids
    assert_kv_conserved(llm.engine)


def test_n_samples_prefill_their_prompt_once(llm, tiny_text_model):
    """n sequences are n engine requests of one prompt; the scheduler holds back the copies
    while the first prefills, so the prefix cache serves them the prompt's KV."""
    prompt = list(range(100, 148))  # 48 tokens
    sp = SamplingParams(n=4, max_tokens=4, temperature=1.0, seed=5, ignore_eos=True)
    llm.engine.reset_prefix_cache()
    out = llm.generate([prompt], sp, use_tqdm=False)[0]
    assert out.num_cached_tokens >= 3 * (len(prompt) - 16)  # each copy reuses all but a partial page
    cold = LLM(str(tiny_text_model), device=TEST_DEVICE, dtype="float32", max_model_len=64,
               enable_prefix_caching=False)
    assert [o.token_ids for o in cold.generate([prompt], sp, use_tqdm=False)[0].outputs] == \
        [o.token_ids for o in out.outputs]


def test_best_of_returns_the_most_likely(llm):
    sp = SamplingParams(n=2, best_of=5, max_tokens=6, temperature=1.0, seed=3, ignore_eos=True)
    out = llm.generate([[9, 10, 11]], sp, use_tqdm=False)[0]
    every = llm.generate([[9, 10, 11]], sp.clone(n=5, best_of=None, logprobs=0), use_tqdm=False)[0]
    best = sorted(every.outputs, key=lambda o: o.cumulative_logprob, reverse=True)[:2]
    assert [o.token_ids for o in out.outputs] == [o.token_ids for o in best]
    assert [o.index for o in out.outputs] == [0, 1] and out.outputs[0].logprobs is None


def test_logit_bias_and_bad_words(llm, builtin_tokenizer):
    base = llm.generate([[5, 6, 7]], _greedy(6, ignore_eos=True), use_tqdm=False)[0].token_ids
    forced = llm.generate([[5, 6, 7]], _greedy(6, ignore_eos=True, logit_bias={"123": 100}),
                          use_tqdm=False)[0].token_ids
    assert forced == [123] * 6
    banned = llm.generate([[5, 6, 7]], _greedy(6, ignore_eos=True, logit_bias={base[0]: -100}),
                          use_tqdm=False)[0].token_ids
    assert banned[0] != base[0] and base[0] not in banned
    word = builtin_tokenizer.decode([base[0]]).strip()
    ok = all(len(builtin_tokenizer.encode(p + word, add_special_tokens=False)) == 1 for p in ("", " "))
    if ok:
        out = llm.generate([[5, 6, 7]], _greedy(6, ignore_eos=True, bad_words=[word]), use_tqdm=False)[0]
        assert base[0] not in out.token_ids
    # A bad word of several tokens: its last token is banned after the others (the mask path).
    from tandem.sampling.bias import bad_word_ids
    word = builtin_tokenizer.decode(base[1:3]).strip()
    single, multi = bad_word_ids([word], builtin_tokenizer)
    out = llm.generate([[5, 6, 7]], _greedy(6, ignore_eos=True, bad_words=[word]), use_tqdm=False)[0]
    seq = [5, 6, 7] + out.token_ids
    assert multi and out.token_ids != base
    assert not any(seq[i:i + len(w)] == w for w in multi for i in range(len(seq)))
    assert not set(single) & set(out.token_ids)
    with pytest.raises(ValueError, match=r"logit_bias token ids must be in \[0, "):
        llm.generate([[5]], _greedy(2, logit_bias={10**7: 1.0}), use_tqdm=False)
    with pytest.raises(ValueError, match="logit_bias values"):
        SamplingParams(logit_bias={1: 101})


def test_min_tokens_bans_stop_ids_until_reached(llm):
    # A strong bias makes token 77 the model's choice; as a stop id it would end at once.
    sp = _greedy(8, logit_bias={77: 100}, stop_token_ids=[77])
    assert llm.generate([[5, 6]], sp, use_tqdm=False)[0].token_ids == [77]
    out = llm.generate([[5, 6]], sp.clone(min_tokens=3), use_tqdm=False)[0]
    assert len(out.token_ids) == 4 and 77 not in out.token_ids[:3] and out.token_ids[3] == 77
    assert out.finish_reason == "stop" and out.stop_reason == 77


def test_bias_and_min_tokens_same_with_overlap_on_and_off(llm, tiny_text_model):
    plain = LLM(str(tiny_text_model), device=TEST_DEVICE, dtype="float32", max_model_len=64,
                disable_overlap=True)
    params = [SamplingParams(max_tokens=10, temperature=1.0, seed=s, logit_bias={77: 5.0, 78: -100},
                             min_tokens=4, stop_token_ids=[77, 79]) for s in range(6)]
    prompts = [[5, 6, 7 + i] for i in range(6)]
    on = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert on == [o.token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    assert all(len(ids) >= 4 and 78 not in ids for ids in on)


def test_stop_string_inclusion_and_special_tokens(llm, builtin_tokenizer):
    base = llm.generate(["Hello"], _greedy(12, ignore_eos=True), use_tqdm=False)[0]
    stop = base.text[3:6]
    cut = llm.generate(["Hello"], _greedy(12, ignore_eos=True, stop=[stop]), use_tqdm=False)[0]
    kept = llm.generate(["Hello"], _greedy(12, ignore_eos=True, stop=[stop],
                                            include_stop_str_in_output=True), use_tqdm=False)[0]
    assert kept.text == cut.text + stop and kept.stop_reason == stop
    special = builtin_tokenizer.convert_tokens_to_ids("<|im_end|>")
    sp = _greedy(3, ignore_eos=True, logit_bias={special: 100})
    assert llm.generate(["Hi"], sp, use_tqdm=False)[0].text == ""
    shown = llm.generate(["Hi"], sp.clone(skip_special_tokens=False), use_tqdm=False)[0].text
    assert shown == "<|im_end|>" * 3


def test_context_limit_is_an_error_not_a_silent_cut(llm):
    from tandem.limits import context_error
    with pytest.raises(ValueError, match=r"This model's maximum context length is 64 tokens\. "
                                         r"However, you requested 70 tokens \(60 in the messages, "
                                         r"10 in the completion\)"):
        llm.generate([[5] * 60], _greedy(10), use_tqdm=False)
    with pytest.raises(ValueError) as err:
        llm.generate([[5] * 64], _greedy(None), use_tqdm=False)
    assert str(err.value) == context_error(64, 64, None)
    out = llm.generate([[5] * 60], _greedy(None, ignore_eos=True), use_tqdm=False)[0]
    assert len(out.token_ids) == 4 and out.finish_reason == "length"


def test_sampling_params_validation():
    for kw, field in [({"n": 0}, "n"), ({"n": 2, "best_of": 1}, "best_of"), ({"min_tokens": -1}, "min_tokens"),
                      ({"max_tokens": 2, "min_tokens": 3}, "min_tokens"), ({"logit_bias": {"x": 1}}, "logit_bias"),
                      ({"bad_words": [""]}, "bad_words"), ({"skip_special_tokens": 1}, "skip_special_tokens"),
                      ({"prompt_logprobs": 21}, "prompt_logprobs")]:
        with pytest.raises(ValueError, match=field):
            SamplingParams(**kw)
    assert SamplingParams(logit_bias={"5": 2}).logit_bias == {5: 2.0}
    assert not math.isnan(SamplingParams(n=3, seed=-1).samples()[2].seed)
