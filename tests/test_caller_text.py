"""`Engine.add_request(..., detokenize=False)`: the caller makes a request's text from the ids
each output names (`StepOutput.text_ids`), and gets exactly the text the engine would have made;
a request with stop strings keeps the engine's text (they end it in the step that completes them)."""
import random

import pytest

from tandem.config import EngineConfig, Experiments
from tandem.engine import Engine
from tandem.text import RequestText, token_pieces
from tiny_models import TEST_DEVICE, make_tiny_model
from workload import random_specs


def _engine(path, spec: bool) -> Engine:
    speculative = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2} if spec else None
    engine = Engine(EngineConfig(model=str(path), device=TEST_DEVICE, dtype="float32", max_total_tokens=900,
                                 chunked_prefill_size=32, max_prefill_tokens=64, speculative_config=speculative,
                                 experiments=Experiments(spec_verify_min_match=1)))
    return engine


def _specs(engine: Engine, seed: int) -> list:
    """Random prompts with stop ids (EOS among them), stop strings on a few, the stop id's text
    kept on some, special tokens shown on some, aborts."""
    tok = engine.tokenizer
    rng = random.Random(seed)
    words = [w for w in ("the", " of", "ing", "a", " and", "e") if tok.encode(w)]
    specs = random_specs(60, 2000, seed=seed, stop_pool=words, stop_id_pool=[2, 5, 7, 11, 13])
    for s in specs:
        s.params = s.params.clone(include_stop_str_in_output=rng.random() < 0.3,
                                  skip_special_tokens=rng.random() < 0.7)
    return specs


def _run(engine: Engine, specs: list, detokenize: bool) -> tuple[dict, dict]:
    """Each request's streamed text, made by the engine or (detokenize=False) by this caller
    from `text_ids`; and whether each request's outputs carried `text_ids`."""
    pieces = token_pieces(engine.tokenizer)
    texts, caller, named = {}, {}, {}
    pending, seen = list(specs), {}
    while pending or engine.has_unfinished():
        for s in pending[:8]:
            engine.add_request(s.prompt, s.params, request_id=s.rid, detokenize=detokenize)
            texts[s.rid], seen[s.rid] = "", 0
            caller[s.rid] = RequestText(engine.tokenizer, s.prompt, None, s.params.skip_special_tokens,
                                        s.params.include_stop_str_in_output, pieces)
        pending = pending[8:]
        for out in engine.step():
            named.setdefault(out.request_id, set()).add(out.text_ids is not None)
            if out.text_ids is None:
                texts[out.request_id] += out.new_text
            else:
                assert out.new_text == ""
                text = caller[out.request_id]
                if out.text_ids:
                    texts[out.request_id] += text.append(out.text_ids).text
                if out.finished and out.finish_reason != "error":
                    texts[out.request_id] += text.finish()
            seen[out.request_id] += len(out.new_token_ids)
            spec = next(s for s in specs if s.rid == out.request_id)
            if not out.finished and spec.abort_after is not None and seen[out.request_id] >= spec.abort_after:
                engine.abort(out.request_id)
    for s in specs:
        if not detokenize and s.params.stop is None:
            assert engine.output(s.rid).text == ""  # the caller's to make
        engine.release(s.rid)
    return texts, named


@pytest.mark.parametrize("spec", [False, True], ids=["plain", "ngram"])
def test_the_callers_text_is_the_engines(tiny_text_model, spec):
    engine = _engine(tiny_text_model, spec)
    engine.eos_token_ids = {2}  # a stop id the random model does emit
    specs = _specs(engine, seed=3 + spec)
    engine_texts, _ = _run(engine, specs, detokenize=True)
    caller_texts, named = _run(engine, specs, detokenize=False)
    assert caller_texts == engine_texts
    assert sum(bool(t) for t in caller_texts.values()) > len(specs) // 2  # text was made
    for s in specs:  # stop strings keep the engine's text; every other request names its ids
        assert named[s.rid] == {s.params.stop is None}, s.rid
    stops = [s for s in specs if s.params.stop_token_ids]
    assert stops and any(s.params.include_stop_str_in_output for s in stops)


def test_a_model_without_tokenizer_names_no_ids(tmp_path):
    """No tokenizer, no text either way: outputs name no ids."""
    path = make_tiny_model(tmp_path, "llama", vocab_size=300)
    engine = Engine(EngineConfig(model=str(path), device=TEST_DEVICE, dtype="float32"))
    assert engine.tokenizer is None
    from tandem.sampling import SamplingParams
    engine.add_request([5, 6, 7], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True), detokenize=False)
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    assert outs and all(o.text_ids is None and o.new_text == "" for o in outs)


def test_a_text_cut_inside_a_character_is_finished_by_the_caller(tiny_text_model):
    """A request that ends on the first byte of a character: the engine's text releases the
    held byte at its finish; the caller's, finished on the finished output, gets the same."""
    from tandem.sampling import SamplingParams
    engine = _engine(tiny_text_model, spec=False)
    first_byte = engine.tokenizer.encode("🙂", add_special_tokens=False)[0]
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True, logit_bias={first_byte: 100.0})
    texts = {}
    for detokenize in (True, False):
        rid = engine.add_request([5, 6, 7], params, detokenize=detokenize)
        caller, text = RequestText(engine.tokenizer, [5, 6, 7], pieces=token_pieces(engine.tokenizer)), ""
        while engine.has_unfinished():
            for out in engine.step():
                assert out.new_token_ids == [first_byte]
                text += out.new_text if out.text_ids is None else caller.append(out.text_ids).text
                if out.text_ids is not None and out.finished:
                    text += caller.finish()
        engine.release(rid)
        texts[detokenize] = text
    assert texts[False] == texts[True] != ""


@pytest.mark.parametrize("spec", [False, True], ids=["plain", "self-draft"])
def test_llm_generate_makes_each_text_at_the_end_the_engines_text(tiny_text_model, spec, monkeypatch):
    """`LLM.generate` leaves the text of requests without stop strings to itself and makes it
    once they ended (texts_at_end): the same texts, n > 1 and stop ids among them, as when the
    engine streams them step by step."""
    from tandem import LLM
    import tandem.entrypoints.llm as llm_module
    # The model drafting for itself: greedy drafts are all accepted, outputs carry runs of ids.
    speculative = {"model": str(tiny_text_model), "num_speculative_tokens": 3} if spec else None
    llm = LLM(str(tiny_text_model), device=TEST_DEVICE, dtype="float32", max_total_tokens=900,
              speculative_config=speculative)
    llm.engine.eos_token_ids = {2}  # a stop id the random model does emit
    specs = _specs(llm.engine, seed=11 + spec)[:20]
    params = [s.params.clone(n=2) if i % 5 == 0 else s.params for i, s in enumerate(specs)]
    made = []
    real = llm_module.texts_at_end
    monkeypatch.setattr(llm_module, "texts_at_end", lambda *a: made.extend(a[1]) or real(*a))
    at_end = llm.generate([s.prompt for s in specs], params, use_tqdm=False)
    assert len(made) == sum(p.num_samples for p in params if not p.stop)  # every request without stop strings
    assert any(len(ids) > 1 for r in made for ids in r.named.chunks()) == spec  # verify steps name runs of ids
    llm._texts_at_end = False  # the engine makes every text, step by step
    # The same schedule (a warm prefix cache changes which steps verify, hence sampled draws).
    llm.reset_prefix_cache()
    streamed = llm.generate([s.prompt for s in specs], params, use_tqdm=False)
    assert [[o.token_ids for o in r.outputs] for r in at_end] == [[o.token_ids for o in r.outputs] for r in streamed]
    assert [[o.text for o in r.outputs] for r in at_end] == [[o.text for o in r.outputs] for r in streamed]
    assert sum(bool(o.text) for r in at_end for o in r.outputs) > len(specs) // 2
    llm.close()
