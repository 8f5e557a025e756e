"""Structured output: constrained outputs parse and validate, unconstrained neighbours keep
their tokens, overlap on == off, preemption and chunked prefill keep matchers consistent,
and the mask reaches every sampling method."""
import json
import random
import re
import threading

import jsonschema
import pytest
import torch

from tandem import LLM, SamplingParams
from tandem.config import EngineConfig, Experiments
from tandem.engine import Engine
from tandem.sampling import Sampler, SamplingInputs
from tiny_models import TEST_DEVICE

xgr = pytest.importorskip("xgrammar")

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "member"],
          "properties": {"name": {"type": "string", "maxLength": 10},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "member": {"type": "boolean"}}}
ORDER = {"type": "object", "additionalProperties": False, "required": ["id", "size", "extras", "note"],
         "properties": {"id": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{3}$"},
                        "size": {"enum": ["small", "medium", "large"]},
                        "extras": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
                                   "maxItems": 3},
                        "note": {"anyOf": [{"type": "null"}, {"type": "string", "maxLength": 6}]}}}
REGEX = r"[a-z]{2,5}-[0-9]{1,3}"
CHOICES = ["positive", "negative", "neutral", "it's \"complicated\""]
EBNF = 'root ::= "(" num ("," num){0,3} ")"\nnum ::= [0-9] | [1-9] [0-9]'
EBNF_RE = r"\((?:[0-9]|[1-9][0-9])(?:,(?:[0-9]|[1-9][0-9])){0,3}\)"


def _engine(path, **kw) -> Engine:
    return Engine(EngineConfig(model=str(path), device=TEST_DEVICE, dtype="float32", **kw))


def _constrained(kind: int, seed: int, temperature: float = 0.9, **kw) -> SamplingParams:
    spec = [dict(json_schema=PERSON), dict(json_schema=json.dumps(ORDER)), dict(regex=REGEX),
            dict(choice=CHOICES), dict(grammar=EBNF)][kind % 5]
    return SamplingParams(max_tokens=80, temperature=temperature, seed=seed, **spec, **kw)


def _check(kind: int, text: str) -> None:
    if kind % 5 in (0, 1):
        jsonschema.validate(json.loads(text), [PERSON, ORDER][kind % 5])
    elif kind % 5 == 2:
        assert re.fullmatch(REGEX, text), text
    elif kind % 5 == 3:
        assert text in CHOICES
    else:
        assert re.fullmatch(EBNF_RE, text), text


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 1000) for _ in range(rng.randint(2, 40))] for _ in range(n)]


def _compile_first(llm: LLM, params: list[SamplingParams]) -> None:
    """Compile every spec before the run, so all requests enter at the first step: the same
    batches in every run (compilation time would otherwise decide who joins which step)."""
    specs = {p.constraint: p for p in params if p.constraint is not None}
    llm.generate([[5, 6]] * len(specs), [p.clone(max_tokens=1) for p in specs.values()], use_tqdm=False)


def test_sampled_constrained_outputs_parse_and_validate(tiny_text_model):
    """60 sampled requests (temperature 0.8-1.2, top-p/top-k/min-p/penalties mixed in) over
    json_schema (dict and string), regex, choice and EBNF: each completes and validates."""
    llm = LLM(str(tiny_text_model), device=TEST_DEVICE, dtype="float32")
    extras = [{}, dict(top_p=0.9), dict(top_k=50), dict(min_p=0.05), dict(repetition_penalty=1.3)]
    params = [_constrained(i, seed=i, temperature=0.8 + 0.1 * (i % 5), **extras[(i // 5) % 5])
              for i in range(60)]
    outs = llm.generate(_prompts(60), params, use_tqdm=False)
    for i, out in enumerate(outs):
        assert out.finish_reason == "stop", (i, out.text)
        _check(i, out.text)


def test_grammar_finishes_with_stop_even_when_eos_is_ignored(tiny_text_model):
    llm = LLM(str(tiny_text_model), device=TEST_DEVICE, dtype="float32")
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=50, temperature=0, choice=["yes", "no"],
                                                   ignore_eos=True), use_tqdm=False)[0]
    assert out.text in ("yes", "no") and out.finish_reason == "stop"


def test_unconstrained_tokens_unchanged_by_constrained_neighbours(tiny_text_model):
    prompts = _prompts(24, seed=1)
    plain = [SamplingParams(max_tokens=20, temperature=t, seed=i, ignore_eos=True, top_p=0.9)
             for i, t in enumerate([0.0, 0.8] * 6)]
    llm = LLM(str(tiny_text_model), device=TEST_DEVICE, dtype="float32")
    alone = llm.generate(prompts[:12], plain, use_tqdm=False)
    mixed = llm.generate(prompts, plain + [_constrained(i, seed=i) for i in range(12)], use_tqdm=False)
    assert [o.token_ids for o in mixed[:12]] == [o.token_ids for o in alone]
    for i, out in enumerate(mixed[12:]):
        _check(i, out.text)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_overlap_on_equals_off_for_constrained_requests(tiny_text_model, temperature):
    prompts = _prompts(20, seed=2)
    params = [_constrained(i, seed=100 + i, temperature=temperature) for i in range(20)]
    params += [SamplingParams(max_tokens=12, temperature=temperature, seed=7, ignore_eos=True)] * 4
    runs = []
    for overlap, mask_overlap, beside in ((True, True, True), (False, True, True), (True, False, True),
                                          (True, True, False)):
        llm = LLM(str(tiny_text_model), device=TEST_DEVICE, dtype="float32", disable_overlap=not overlap,
                  experiments=Experiments(grammar_overlap=mask_overlap, grammar_fill_beside_text=beside))
        _compile_first(llm, params)
        runs.append([(o.token_ids, o.finish_reason) for o in
                     llm.generate(prompts + _prompts(4, seed=3), params, use_tqdm=False)])
    assert runs[0] == runs[1] == runs[2] == runs[3]


def test_masks_are_filled_before_the_previous_steps_text(tiny_text_model):
    """Step N+1's masks need step N's tokens, not their text: with overlap on, N+1's mask fill
    starts before N's text is made (the fill thread fills while the text is made). Stop strings
    that end constrained requests in that text leave every output as with overlap off, with
    masks first and with the fill joined before the text."""
    prompts = _prompts(12, seed=5)
    stops = [dict(stop=['"', ","]), dict(stop=["-"]), dict(stop=["e"]), {}]
    params = [_constrained(i, seed=300 + i, temperature=0.8, **stops[i % 4]) for i in range(12)]
    runs, events, fill_threads = [], [], set()
    for overlap, mask_overlap, beside in ((True, True, True), (False, True, True), (True, False, True),
                                          (True, True, False)):
        llm = LLM(str(tiny_text_model), device=TEST_DEVICE, dtype="float32", disable_overlap=not overlap,
                  experiments=Experiments(grammar_overlap=mask_overlap, grammar_fill_beside_text=beside))
        _compile_first(llm, params)
        engine = llm.engine
        if overlap and mask_overlap and beside:
            start_masks, token_output = engine.grammar.start_masks, engine._token_output

            def logged_masks(batch):
                events.append(("masks", batch.step))
                return start_masks(batch)

            def logged_text(req, *args):  # made while the step after it is in flight
                events.append(("text", engine.pending.batch.step if engine.pending else None))
                return token_output(req, *args)

            engine.grammar.start_masks, engine._token_output = logged_masks, logged_text
            batch_matcher = engine.grammar._grammar_batch_matcher()

            class ThreadLogged:  # where xgrammar's batch fill runs
                def batch_fill_next_token_bitmask(self, *args):
                    fill_threads.add(threading.current_thread().name)
                    return batch_matcher.batch_fill_next_token_bitmask(*args)

            engine.grammar._batch_matcher = ThreadLogged()
        runs.append([(o.token_ids, o.finish_reason, o.text, o.outputs[0].stop_reason) for o in
                     llm.generate(prompts, params, use_tqdm=False)])
    assert runs[0] == runs[1] == runs[2] == runs[3]
    assert sum(isinstance(stop, str) for *_, stop in runs[0]) >= 3  # stop strings ended constrained requests
    masked_at = {step: i for i, (kind, step) in enumerate(events) if kind == "masks"}
    texts_in_flight = [(i, step) for i, (kind, step) in enumerate(events) if kind == "text" and step in masked_at]
    assert texts_in_flight, "no step's text was made while a masked step was in flight"
    assert all(masked_at[step] < i for i, step in texts_in_flight)
    assert fill_threads and all(name.startswith("tandem-mask-fill") for name in fill_threads)


def test_preemption_and_chunked_prefill_keep_matchers_consistent(tiny_text_model):
    """A tight KV pool preempts constrained requests mid-output; they resume with the matcher
    at their kept tokens, so outputs equal a run without memory pressure and still validate."""
    rng = random.Random(4)
    prompts = [[rng.randrange(3, 1000) for _ in range(rng.randint(20, 60))] for _ in range(16)]
    params = [_constrained(i, seed=200 + i) for i in range(16)]
    roomy = LLM(str(tiny_text_model), device=TEST_DEVICE, dtype="float32")
    _compile_first(roomy, params)
    want = [o.token_ids for o in roomy.generate(prompts, params, use_tqdm=False)]
    tight = LLM(str(tiny_text_model), device=TEST_DEVICE, dtype="float32", max_total_tokens=200,
                chunked_prefill_size=8, max_prefill_tokens=16, enable_mixed_batch=True)
    _compile_first(tight, params)
    outs = tight.generate(prompts, params, use_tqdm=False)
    assert tight.engine.scheduler.num_preemptions > 0
    assert [o.token_ids for o in outs] == want
    for i, out in enumerate(outs):
        _check(i, out.text)


@pytest.mark.parametrize("field,value,words", [
    ("json_schema", "{not json", "json_schema is not valid JSON"),
    ("json_schema", [1, 2], "json_schema must be a JSON object"),
    ("choice", [], "choice must be a non-empty list"),
])
def test_bad_specs_raise_at_submission(tiny_text_model, field, value, words):
    """Shape errors (cheap to see) raise at once; a spec's parse is the pool's (test_grammar_limits)."""
    engine = _engine(tiny_text_model)
    with pytest.raises(ValueError, match=re.escape(words)):
        engine.add_request([5, 6], SamplingParams(**{field: value}))
    assert not engine.has_unfinished()


def test_at_most_one_constraint():
    with pytest.raises(ValueError, match="at most one of json_schema, regex, grammar, choice"):
        SamplingParams(regex="a+", choice=["a"])


def test_a_schema_compiles_once(tiny_text_model):
    engine = _engine(tiny_text_model)
    for i in range(3):
        engine.add_request([5, 6], SamplingParams(json_schema=PERSON, max_tokens=4), request_id=f"r{i}")
    futures = {id(c.future) for c in engine.grammar.compiling}
    assert len(futures) == 1
    engine.abort("r0")
    while engine.has_unfinished():
        engine.step()
    assert engine.output("r0").finish_reason == "abort"


def test_mask_applies_before_every_sampling_method():
    """A bitmask allowing {3, 7, 40}: greedy, sampled (top-k/top-p/min-p), penalised rows all
    pick allowed tokens; logprobs are those of the constrained distribution."""
    V, B = 70, 5
    torch.manual_seed(0)
    logits = torch.randn(B, V) * 3
    allowed = [3, 7, 40]
    bitmask = xgr.allocate_token_bitmask(B, V)
    bitmask.zero_()
    for t in allowed:
        bitmask[:, t // 32] |= torch.tensor(1 << (t % 32), dtype=torch.int64).to(torch.int32)
    ref = logits.clone()
    xgr.apply_token_bitmask_inplace(ref, bitmask)
    sampler = Sampler(V, 8, "cpu")
    assert torch.equal(sampler.apply_bitmask(logits, bitmask), ref)
    params = [SamplingParams(temperature=0, logprobs=2), SamplingParams(temperature=1.0, top_k=2, logprobs=0),
              SamplingParams(temperature=1.0, top_p=0.5), SamplingParams(temperature=1.0, min_p=0.3),
              SamplingParams(temperature=0, repetition_penalty=2.0, presence_penalty=1.0)]
    for slot, p in enumerate(params):
        sampler.start_request(slot, [3, 7], p)
    inputs = SamplingInputs.build(params, list(range(B)), [0] * B, list(range(B)))
    for _ in range(3):
        out = sampler.sample(logits, inputs, bitmask)
        assert set(out.token_ids.tolist()) <= set(allowed)
    constrained = torch.log_softmax(ref, dim=-1)
    assert torch.allclose(out.logprobs, constrained.gather(1, out.token_ids[:, None]).squeeze(1))
    assert set(out.top_ids.flatten().tolist()) <= set(allowed)


class _Forbid:
    """A MaskProducer that is not a grammar: some tokens are never allowed (like bad words)."""

    def __init__(self, vocab: int, banned: set[int]):
        self.row = torch.full(((vocab + 31) // 32,), -1, dtype=torch.int32)
        for t in banned:
            self.row[t // 32] &= ~(1 << (t % 32)) if t % 32 != 31 else 0x7FFFFFFF
        self.accepted: list[int] = []

    def fill_next_mask(self, bitmask: torch.Tensor, row: int) -> None:
        bitmask[row] = self.row

    def accept(self, token: int) -> bool:
        self.accepted.append(token)
        return True

    def is_terminated(self) -> bool:
        return False


def test_any_mask_producer_plugs_into_the_mask_path(tiny_text_model):
    """The per-request interface (fill_next_mask / accept / is_terminated) the grammar uses is
    open to other rules (given through `GrammarManager.give_mask`): a producer that bans the
    tokens greedy decoding picked."""
    engine = _engine(tiny_text_model)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    engine.add_request([5, 6, 7], params, request_id="free")
    while engine.has_unfinished():
        engine.step()
    free = engine.output("free").token_ids
    engine.add_request([5, 6, 7], params, request_id="banned")
    producer = _Forbid(engine.model_config.vocab_size, set(free))
    engine.grammar.give_mask(engine.requests["banned"], producer)
    while engine.has_unfinished():
        engine.step()
    out = engine.output("banned").token_ids
    assert len(out) == 12 and not set(out) & set(free)
    assert producer.accepted == out


class _RowsUnread:
    """A batch whose rows must not be read."""

    @property
    def sample_rows(self):
        raise AssertionError("the step's rows were scanned for masks")

    @property
    def sampled(self):
        raise AssertionError("the step's rows were scanned for masks")


def test_steps_look_for_masks_only_while_a_masked_request_lives(tiny_text_model):
    """`constrains` scans a step's rows only while some request given a mask is unfinished:
    the mask-producer request's steps are masked; once it finished, a step's rows are not read."""
    engine = _engine(tiny_text_model)
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    engine.add_request([5, 6, 7], params, request_id="masked")
    engine.grammar.give_mask(engine.requests["masked"], _Forbid(engine.model_config.vocab_size, {3}))
    with pytest.raises(AssertionError, match="scanned"):
        engine.grammar.constrains(_RowsUnread())
    while engine.has_unfinished():
        engine.step()
    assert engine.grammar.masked_steps > 0
    engine.add_request([8, 9], params, request_id="plain")
    while engine.has_unfinished():
        engine.step()
    assert engine.grammar.constrains(_RowsUnread()) is False


YES_NO = dict(regex="(yes|no)", min_tokens=8)


def _run_alone(engine: Engine, prompt, params: SamplingParams) -> tuple[list[int], str]:
    rid = engine.add_request(prompt, params)
    while engine.has_unfinished():
        engine.step()
    out = engine.output(rid)
    engine.release(rid)
    return out.token_ids, out.finish_reason


@pytest.mark.parametrize("overlap", [True, False])
def test_constraints_that_leave_no_token_end_only_that_request(tiny_text_model, overlap):
    """A grammar that allows only EOS while min_tokens bans it: that request ends with
    finish reason 'error' (status 400) once its mask empties; its neighbours, constrained or
    not, get exactly the tokens they get alone, and the engine serves on."""
    engine = _engine(tiny_text_model, disable_overlap=not overlap)
    neighbours = [([5, 6, 7, 8], SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)),
                  ([9, 10, 11], _constrained(2, seed=3, temperature=0)),
                  ([12, 13], SamplingParams(max_tokens=12, temperature=0.8, seed=5, ignore_eos=True))]
    alone = [_run_alone(engine, p, s) for p, s in neighbours]
    doomed = [engine.add_request([20 + i, 21], SamplingParams(max_tokens=30, temperature=t, seed=i, **YES_NO))
              for i, t in enumerate([0.0, 1.0, 0.7])]
    rids = [engine.add_request(p, s) for p, s in neighbours]
    finals = {}
    while engine.has_unfinished():
        finals.update({o.request_id: o for o in engine.step() if o.finished})
    for rid in doomed:
        assert finals[rid].finish_reason == "error" and finals[rid].error_status == 400
        assert "no token satisfies" in finals[rid].error
        out = engine.output(rid)
        assert out.finish_reason == "error" and re.fullmatch("yes|no", out.text), out.text
    assert [(engine.output(r).token_ids, engine.output(r).finish_reason) for r in rids] == alone
    for rid in doomed + rids:
        engine.release(rid)
    assert [_run_alone(engine, p, s) for p, s in neighbours] == alone  # it serves on
    assert engine.stats()["running"] == 0 and engine.req_slots.num_free == engine.req_slots.count


def test_single_token_bad_words_that_ban_the_grammars_only_tokens(tiny_text_model, builtin_tokenizer):
    """bad_words banning every token a choice can start with: an error finish, not a crash."""
    first = {builtin_tokenizer.decode([t]) for t in range(len(builtin_tokenizer))
             if builtin_tokenizer.decode([t]) and "yes".startswith(builtin_tokenizer.decode([t]))}
    engine = _engine(tiny_text_model)
    tokens, reason = _run_alone(engine, [5, 6], SamplingParams(max_tokens=8, temperature=0, choice=["yes"],
                                                               bad_words=sorted(first)))
    assert (tokens, reason) == ([], "error")


def test_a_choice_shorter_than_min_tokens_is_refused_at_submission(tiny_text_model):
    engine = _engine(tiny_text_model)
    with pytest.raises(ValueError, match="no token satisfies the request's constraints"):
        engine.add_request([5, 6], SamplingParams(choice=["yes", "no"], min_tokens=4))
    # Reachable: a 9-byte choice can take 9 tokens; so can ignore_eos (no EOS ban).
    engine.add_request([5, 6], SamplingParams(choice=["certainly"], min_tokens=4))
    engine.add_request([5, 6], SamplingParams(choice=["no"], min_tokens=4, ignore_eos=True))
