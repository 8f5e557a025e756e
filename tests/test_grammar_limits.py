"""Grammar work stays off the engine loop (issue 18): a canary stream keeps its pace while deep
schemas, a grammar too slow to compile and the first structured requests (xgrammar not yet
prepared) arrive; oversized specs are refused at submission naming the field; a compilation
past its time limit, or an invalid grammar found in the pool, ends only its request (400)."""
import json
import re
import threading
import time

import httpx
import openai
import pytest

from tandem import SamplingParams
from tandem.config import EngineConfig
from tandem.engine import Engine
from tandem.grammar import compiler
from tandem.grammar.compiler import MAX_SCHEMA_DEPTH, MAX_SPEC_BYTES, json_depth
from test_server import running_server
from tiny_models import TEST_DEVICE

pytest.importorskip("xgrammar")

SLOW_REGEX = "slow-[0-9]{1,3}"  # its compilation is made to take SLOW_S (patched where the pool calls it)
SLOW_S = 5.0


def _engine(path, **kw) -> Engine:
    return Engine(EngineConfig(model=str(path), device=TEST_DEVICE, dtype="float32", **kw))


def _deep_schema(depth: int, name: str = "a") -> dict:
    """An object schema whose JSON text nests exactly `depth` levels."""
    schema: dict = {"type": "string"} if depth % 2 else {"type": "array", "items": {"type": "string"}}
    for _ in range((depth - 1) // 2):  # each object level is two: the schema and its properties
        schema = {"type": "object", "properties": {name: schema}, "required": [name]}
    assert json_depth(json.dumps(schema)) == depth
    return schema


def _nested_dict(depth: int) -> dict:
    schema: dict = {}
    for _ in range(depth):  # built bottom-up: deeper than json can encode
        schema = {"items": schema}
    return schema


@pytest.fixture
def slow_compiles(monkeypatch):
    """SLOW_REGEX's compilation sleeps in the pool thread, as a costly grammar would (cut
    short when the test ends, so no thread outlives it)."""
    real, done = compiler._xgr_compile, threading.Event()

    def compile_(xgr_compiler, kind: str, spec: str):
        if spec == SLOW_REGEX:
            done.wait(SLOW_S)
        return real(xgr_compiler, kind, spec)

    monkeypatch.setattr(compiler, "_xgr_compile", compile_)
    yield
    done.set()


@pytest.fixture
def slow_preparation(monkeypatch):
    """xgrammar's import and tokenizer info take 1 s more, as for a large vocabulary."""
    real = compiler._xgr_compiler

    def prepare(*args):
        time.sleep(1.0)
        return real(*args)

    monkeypatch.setattr(compiler, "_xgr_compiler", prepare)


def _run(engine: Engine, submit_at: dict[int, list[tuple[str, SamplingParams]]]) -> tuple[dict, list[float]]:
    """Step until done, submitting `submit_at[step]` before that step; the final outputs and
    the canary's gaps between tokens (each gap includes the submissions made in it)."""
    finals, gaps, last, step = {}, [], None, 0
    while step <= max(submit_at) or engine.has_unfinished():
        for rid, params in submit_at.get(step, []):
            engine.add_request([8, 9, 10], params, request_id=rid)
        for out in engine.step():
            if out.request_id == "canary" and out.new_token_ids:
                now = time.perf_counter()
                if last is not None:
                    gaps.append(now - last)
                last = now
            if out.finished:
                finals[out.request_id] = out
        step += 1
    return finals, gaps


def test_a_canary_keeps_its_pace_while_grammars_compile(tiny_text_model, slow_compiles, slow_preparation):
    """Ten schemas nested to the limit and a grammar that would compile for 5 s arrive, the
    first while xgrammar is still being prepared: the greedy canary's longest gap stays < 0.5 s
    (with the parse and xgrammar's preparation on the engine loop: ~1 s), the slow one ends
    with a 400 at its time limit, the deep ones are served."""
    engine = _engine(tiny_text_model, grammar_compile_timeout=1.0)
    engine.add_request([5, 6, 7], SamplingParams(max_tokens=60, temperature=0, ignore_eos=True),
                       request_id="canary")
    deep = [(f"deep{i}", SamplingParams(max_tokens=6, temperature=0,
                                        json_schema=_deep_schema(MAX_SCHEMA_DEPTH, f"k{i}")))
            for i in range(10)]
    slow = ("slow", SamplingParams(max_tokens=4, regex=SLOW_REGEX))
    finals, gaps = _run(engine, {2: deep[:5] + [slow], 8: deep[5:]})
    assert finals["canary"].finish_reason == "length" and len(engine.output("canary").token_ids) == 60
    assert max(gaps) < 0.5, f"longest gap {max(gaps):.3f} s"
    assert finals["slow"].finish_reason == "error" and finals["slow"].error_status == 400
    assert "took too long to compile" in finals["slow"].error
    assert {finals[rid].finish_reason for rid, _ in deep} == {"length"}


def test_oversized_specs_are_refused_at_submission_naming_the_field(tiny_text_model):
    engine = _engine(tiny_text_model)
    cases = [
        (dict(json_schema=_deep_schema(MAX_SCHEMA_DEPTH + 1)), f"json_schema nests {MAX_SCHEMA_DEPTH + 1} levels"),
        (dict(json_schema=_deep_schema(601)), "json_schema nests 601 levels deep; the limit is"),
        # Python 3.11's json.loads gives up (RecursionError) before the depth scan runs; 3.12's parses it.
        (dict(json_schema='{"items": ' * 3000 + "{}" + "}" * 3000), "json_schema nests"),
        (dict(json_schema=_nested_dict(3000)), "json_schema nests"),
        (dict(regex="a" * (MAX_SPEC_BYTES + 1)), f"regex is {MAX_SPEC_BYTES + 1} bytes; the limit is"),
        (dict(grammar='root ::= "' + "é" * MAX_SPEC_BYTES + '"'), "grammar is 2097163 bytes; the limit is"),
        (dict(choice=["x" * MAX_SPEC_BYTES]), "choice is"),
    ]
    for params, words in cases:
        t0 = time.perf_counter()
        with pytest.raises(ValueError, match=re.escape(words)):
            engine.add_request([5, 6], SamplingParams(max_tokens=4, **params))
        assert time.perf_counter() - t0 < 0.25  # a scan, not a parse (601 levels parse in seconds)
    assert not engine.has_unfinished()
    engine.add_request([5, 6], SamplingParams(max_tokens=2, json_schema=_deep_schema(MAX_SCHEMA_DEPTH)))


def test_json_depth_ignores_brackets_in_strings():
    assert json_depth(json.dumps({"a": "[[[{{{", "b": ["\\\"[", {"c": []}]})) == 4
    assert json_depth("{}") == 1 and json_depth('"x"') == 0 and json_depth("[[[]]]") == 3


def _neighbours() -> list[tuple[str, SamplingParams]]:
    return [("plain", SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)),
            ("choice", SamplingParams(max_tokens=10, temperature=0, choice=["yes", "no"]))]


def test_a_compilation_past_its_time_limit_ends_only_its_request(tiny_text_model, slow_compiles):
    engine = _engine(tiny_text_model, grammar_compile_timeout=0.5)
    t0 = time.perf_counter()
    finals, _ = _run(engine, {0: [("slow", SamplingParams(max_tokens=4, regex=SLOW_REGEX))] + _neighbours()})
    slow = finals["slow"]
    assert (slow.finish_reason, slow.error_status, slow.error_code) == ("error", 400, "grammar_compile_timeout")
    assert "regex grammar took too long to compile: not done after 0.5 s" in slow.error
    assert time.perf_counter() - t0 < SLOW_S  # it did not wait for the compilation
    assert engine.output("plain").finish_reason == "length" and len(engine.output("plain").token_ids) == 10
    assert engine.output("choice").finish_reason == "stop" and engine.output("choice").text in ("yes", "no")


@pytest.mark.parametrize("field,value,words", [
    ("json_schema", {"type": "objectx"}, "json_schema is not a valid JSON schema"),
    ("regex", "a(", "regex is not a valid regular expression"),
    ("grammar", "root ::= undefined_rule", "grammar is not a valid EBNF grammar"),
])
def test_an_invalid_grammar_found_in_the_pool_ends_only_its_request(tiny_text_model, field, value, words):
    engine = _engine(tiny_text_model)
    finals, _ = _run(engine, {0: [("bad", SamplingParams(max_tokens=4, **{field: value}))] + _neighbours()})
    bad = finals["bad"]
    assert (bad.finish_reason, bad.error_status, bad.error_code) == ("error", 400, "invalid_grammar")
    assert bad.error.startswith(words) and ".cc:" not in bad.error and "/project" not in bad.error
    assert engine.output("plain").finish_reason == "length" and len(engine.output("plain").token_ids) == 10
    assert engine.output("choice").text in ("yes", "no")
    # The same spec again: its failure is cached (deterministic), the same clear error.
    finals, _ = _run(engine, {0: [("again", SamplingParams(max_tokens=4, **{field: value}))]})
    assert finals["again"].error == bad.error


def test_a_failed_preparation_is_a_500_for_constrained_requests_only(tiny_text_model, monkeypatch):
    def broken(*_):
        raise RuntimeError("this tokenizer is not supported")

    monkeypatch.setattr(compiler, "_xgr_compiler", broken)
    engine = _engine(tiny_text_model)
    finals, _ = _run(engine, {0: [("regex", SamplingParams(max_tokens=4, regex="[ab]+"))] + _neighbours()[:1]})
    assert (finals["regex"].finish_reason, finals["regex"].error_status) == ("error", 500)
    assert "structured output is unavailable" in finals["regex"].error
    assert "not supported" in finals["regex"].error
    assert engine.output("plain").finish_reason == "length"


# ---- through the server ----
def _wide(prefix: str) -> dict:
    """1,200 optional properties: parsed in ~20 ms, compiled in ~1 s on CI's machine (grows about
    cubically). Each request gets its own prefix: a compilation that timed out still finishes
    and is cached, and a second request sharing it could be served instead of refused."""
    return {"type": "object", "properties": {f"{prefix}{i}": {"type": "integer"} for i in range(1200)}}


@pytest.fixture(scope="module")
def client(tiny_text_model, tmp_path_factory):
    """A server whose grammars must compile within 0.25 s (a wide schema takes ~1 s)."""
    log = tmp_path_factory.mktemp("grammar_limits") / "server.log"
    with running_server(tiny_text_model, log, "--grammar-compile-timeout", "0.25") as (url, proc):
        yield openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
    assert proc.returncode == 0, log.read_text()


def test_server_grammar_failures_after_submission_are_400s(client):
    """A grammar that fails in the engine's pool: a 400 JSON error unstreamed, an error event
    streamed; an oversized one is refused before the engine sees it, naming response_format."""
    def wide(prefix: str) -> dict:
        return {"type": "json_schema", "json_schema": {"name": "wide", "schema": _wide(prefix)}}

    with pytest.raises(openai.BadRequestError, match="took too long to compile") as err:
        client.chat.completions.create(model="llama", messages=[{"role": "user", "content": "hi"}],
                                       max_tokens=4, response_format=wide("a"))
    assert err.value.code == "grammar_compile_timeout"
    stream = client.chat.completions.create(model="llama", messages=[{"role": "user", "content": "hi"}],
                                            max_tokens=4, response_format=wide("b"), stream=True)
    with pytest.raises(openai.APIError, match="took too long to compile"):
        for _ in stream:
            pass
    deep = {"type": "json_schema", "json_schema": {"name": "deep", "schema": _deep_schema(4 * MAX_SCHEMA_DEPTH)}}
    with pytest.raises(openai.BadRequestError, match="response_format nests") as err:
        client.chat.completions.create(model="llama", messages=[{"role": "user", "content": "hi"}],
                                       max_tokens=4, response_format=deep)
    assert err.value.param == "response_format"
    base = str(client.base_url).removesuffix("/v1/")
    assert httpx.get(base + "/health").status_code == 200
    out = client.completions.create(model="llama", prompt="Hello", max_tokens=3, extra_body={"regex": "[ab]{3}"})
    assert re.fullmatch("[ab]{3}", out.choices[0].text)


def test_xgrammar_is_prepared_by_the_first_grammar_not_by_the_engine(tiny_text_model, monkeypatch):
    """The preparation's vocabulary scan holds the GIL: begun beside graph capture it stretched
    start-up (20.7 s against 17.0 s on the H200), begun after warm-up it slowed the first
    seconds of serving (GPU busy 0.97 -> 0.84). It starts with the first constrained request,
    exactly once, and that request is served."""
    import tandem.engine as engine_module

    events: list[str] = []
    real_warm_up, real_prepare = engine_module.warm_up, compiler._xgr_compiler

    def warm_up(engine):
        events.append("warm-up")
        return real_warm_up(engine)

    def prepare(*args):
        events.append("prepare")
        return real_prepare(*args)

    monkeypatch.setattr(engine_module, "warm_up", warm_up)
    monkeypatch.setattr(compiler, "_xgr_compiler", prepare)
    engine = _engine(tiny_text_model, warm_up="on")
    _run(engine, {0: _neighbours()[:1]})
    assert events == ["warm-up"]  # built, warmed and serving unconstrained requests: not yet
    _run(engine, {0: [("regex", SamplingParams(max_tokens=4, regex="[ab]+")),
                      ("regex2", SamplingParams(max_tokens=4, regex="[cd]+"))]})
    assert re.fullmatch("[ab]+", engine.output("regex").text)
    assert re.fullmatch("[cd]+", engine.output("regex2").text)
    assert events == ["warm-up", "prepare"]
