"""Structured output and tool calls through the official `openai` client against a real server."""
import json
import re
from typing import Annotated, Literal

import jsonschema
import httpx
import openai
import pytest
from pydantic import BaseModel, Field

from test_server import cleanly_exiting_server, openai_client

pytest.importorskip("xgrammar")

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
                   "properties": {"city": {"enum": ["Paris", "Tokyo", "Lima"]},
                                  "unit": {"enum": ["C", "F"]}}}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "additionalProperties": False, "required": ["zone"],
                                       "properties": {"zone": {"type": "integer", "minimum": -12, "maximum": 12}}}}}
TOOLS = [WEATHER, TIME]
PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


class Person(BaseModel):
    name: Annotated[str, Field(max_length=8)]
    age: Annotated[int, Field(ge=0, le=99)]
    member: bool
    level: Literal["low", "high"]


@pytest.fixture(scope="module")
def served(tiny_text_model, tmp_path_factory):
    log = tmp_path_factory.mktemp("server_structured") / "server.log"
    with cleanly_exiting_server(tiny_text_model, log, "--max-running-requests", "16",
                                "--max-model-len", "256") as (url, proc):
        yield url, proc


@pytest.fixture(scope="module")
def client(served):
    return openai_client(served[0])


@pytest.fixture(scope="module")
def server_pid(served):
    return served[1].pid


def _check_calls(calls, names=None, single=False):
    assert calls and (len(calls) == 1 or not single)
    for call in calls:
        assert call.type == "function" and call.id
        assert call.function.name in (names or PARAMS)
        jsonschema.validate(json.loads(call.function.arguments), PARAMS[call.function.name])


def test_parse_with_a_pydantic_model(client):
    for seed in range(3):
        done = client.chat.completions.parse(model="llama", messages=ASK, response_format=Person,
                                             max_tokens=80, temperature=0.9, seed=seed)
        choice = done.choices[0]
        assert choice.finish_reason == "stop"
        assert isinstance(choice.message.parsed, Person)


def test_json_object(client):
    """A random model rarely closes a free JSON string, so outputs may be cut by max_tokens:
    each is then an object's opening; any that finished parses as a JSON object."""
    done = client.chat.completions.create(model="llama", messages=ASK, response_format={"type": "json_object"},
                                          max_tokens=24, temperature=0.8, seed=1, n=3)
    assert len(done.choices) == 3
    for c in done.choices:
        assert c.message.content.startswith('{"') or c.message.content == "{}"
        if c.finish_reason == "stop":
            assert isinstance(json.loads(c.message.content), dict)


def test_regex_and_ebnf_extra_fields(client):
    done = client.chat.completions.create(model="llama", messages=ASK, max_tokens=20, temperature=0.9, seed=2,
                                          extra_body={"regex": "(yes|no), [0-9]{2}"})
    assert done.choices[0].finish_reason == "stop"
    assert done.choices[0].message.content[:3] in ("yes", "no,")
    done = client.completions.create(model="llama", prompt="Answer:", max_tokens=20, temperature=0.9, seed=3,
                                     extra_body={"ebnf": 'root ::= "A" | "B" | "C"'})
    assert done.choices[0].text in ("A", "B", "C") and done.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("parallel", [False, True])
def test_tool_choice_required(client, parallel):
    done = client.chat.completions.create(model="llama", messages=ASK, tools=TOOLS, tool_choice="required",
                                          parallel_tool_calls=parallel, max_tokens=120, temperature=0.9,
                                          seed=4)
    choice = done.choices[0]
    assert choice.finish_reason == "tool_calls"
    _check_calls(choice.message.tool_calls, single=not parallel)


def test_tool_choice_named(client):
    done = client.chat.completions.create(
        model="llama", messages=ASK, tools=TOOLS, max_tokens=60, temperature=0.9, seed=5,
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    choice = done.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    _check_calls(choice.message.tool_calls, names={"get_weather"}, single=True)


def test_tool_choice_none_and_auto_answer_with_text(client):
    for choice in ("none", "auto"):
        done = client.chat.completions.create(model="llama", messages=ASK, tools=TOOLS, tool_choice=choice,
                                              max_tokens=8, temperature=0, seed=6)
        assert done.choices[0].message.tool_calls is None  # a random model writes no call
        assert done.choices[0].finish_reason in ("stop", "length")


def _stream_calls(stream):
    calls, reason, content = {}, None, []
    for chunk in stream:
        for c in chunk.choices:
            for tc in c.delta.tool_calls or []:
                entry = calls.setdefault(tc.index, {"id": None, "name": None, "arguments": ""})
                entry["id"] = tc.id or entry["id"]
                if tc.function and tc.function.name:
                    entry["name"] = tc.function.name
                if tc.function and tc.function.arguments:
                    entry["arguments"] += tc.function.arguments
            content.append(c.delta.content or "")
            reason = c.finish_reason or reason
    return [calls[i] for i in sorted(calls)], reason, "".join(content)


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
def test_streamed_tool_calls_equal_the_non_streamed_ones(client, tool_choice):
    kw = dict(messages=ASK, tools=TOOLS, tool_choice=tool_choice, max_tokens=120,
              temperature=0.9, seed=7)
    whole = client.chat.completions.create(model="llama", **kw).choices[0].message.tool_calls
    calls, reason, content = _stream_calls(client.chat.completions.create(model="llama", stream=True, **kw))
    assert reason == "tool_calls" and content == ""
    assert [(c["name"], c["arguments"]) for c in calls] == [(c.function.name, c.function.arguments) for c in whole]
    assert all(c["id"] for c in calls)


def test_streamed_json_schema(client):
    schema = Person.model_json_schema()
    kw = dict(messages=ASK, max_tokens=80, temperature=0.9, seed=8,
              response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": schema,
                                                                      "strict": True}})
    whole = client.chat.completions.create(model="llama", **kw).choices[0].message.content
    _, reason, content = _stream_calls(client.chat.completions.create(model="llama", stream=True, **kw))
    assert reason == "stop" and content == whole
    Person.model_validate_json(content)


@pytest.mark.parametrize("kw,param", [
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "bad", "schema": {"type": "objectx"}}}),
     "objectx"),
    (dict(extra_body={"regex": "a("}), "regex"),
    (dict(extra_body={"ebnf": "root ::= nothing_here"}), "ebnf"),
    (dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}), "tool_choice"),
    (dict(tools=TOOLS, tool_choice="required", extra_body={"regex": "a+"}), "only one of regex, tools"),
    (dict(response_format={"type": "json_object"}, extra_body={"regex": "a+"}), "only one of"),
])
def test_invalid_constraints_are_400(client, kw, param):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="llama", messages=ASK, max_tokens=8, **kw)
    assert param in str(err.value)


def test_format_with_auto_tools_on_an_unknown_template_answers_in_the_format(client):
    """The tiny model's template has no known call format, so no grammar can allow a call next
    to the JSON: the reply is the format's JSON (as without a format such tools are never
    called, and as the Responses route does)."""
    fmt = {"type": "json_schema", "json_schema": {"name": "p", "schema": Person.model_json_schema()}}
    reply = client.chat.completions.create(model="llama", messages=ASK, max_tokens=64, tools=TOOLS,
                                           response_format=fmt, temperature=0)
    message = reply.choices[0].message
    assert not message.tool_calls
    if reply.choices[0].finish_reason == "stop":
        Person.model_validate_json(message.content)
    else:  # cut at the limit: the start of the format's JSON
        assert message.content.lstrip().startswith("{")
    forced = client.chat.completions.create(model="llama", messages=ASK, max_tokens=48, tools=TOOLS,
                                            response_format=fmt, tool_choice="required", temperature=0)
    _check_calls(forced.choices[0].message.tool_calls)  # a forced call is the output whatever the format


CHOICES = ["yes", "no", 'say "maybe"\n']


@pytest.mark.parametrize("extra", [
    {"structured_outputs": {"choice": CHOICES}},
    {"guided_choice": CHOICES},
], ids=["structured_outputs", "guided"])
def test_vllms_choice_fields_constrain_chat_and_completions(client, extra):
    """Code written for vLLM sends its own structured-output fields: the reply is one of the
    choices, verbatim (quotes and a newline included), never free text."""
    seen = set()
    for seed in range(6):
        chat = client.chat.completions.create(model="llama", messages=ASK, max_tokens=12, temperature=1.0,
                                              seed=seed, extra_body=extra)
        text = client.completions.create(model="llama", prompt="Answer:", max_tokens=12, temperature=1.0,
                                         seed=seed, extra_body=extra).choices[0].text
        assert chat.choices[0].message.content in CHOICES and text in CHOICES
        seen |= {chat.choices[0].message.content, text}
    assert len(seen) > 1  # the model picks, the grammar only allows


@pytest.mark.parametrize("extra,check", [
    ({"structured_outputs": {"regex": "[0-9]{3}-[a-c]{2}"}}, lambda t: re.fullmatch("[0-9]{3}-[a-c]{2}", t)),
    ({"guided_regex": "(ab)+c"}, lambda t: re.fullmatch("(ab)+c", t)),
    ({"structured_outputs": {"json": Person.model_json_schema()}}, Person.model_validate_json),
    ({"guided_json": json.dumps(Person.model_json_schema())}, Person.model_validate_json),
    ({"structured_outputs": {"json_object": True}}, None),  # a random model's free object runs to the limit
    ({"guided_grammar": 'root ::= "x" [0-9] "y"', "guided_decoding_backend": "xgrammar"},
     lambda t: re.fullmatch("x[0-9]y", t)),
    ({"structured_outputs": {"grammar": 'root ::= ("a" | "b")+ "."'}}, lambda t: re.fullmatch("[ab]+[.]", t)),
])
def test_vllms_regex_json_and_grammar_fields(client, extra, check):
    out = client.chat.completions.create(model="llama", messages=ASK, max_tokens=48, temperature=0.8, seed=1,
                                         extra_body=extra).choices[0]
    if check is None:  # constrained to a JSON object: it starts as one
        assert out.message.content.lstrip().startswith("{"), out.message.content
    else:
        assert out.finish_reason == "stop" and check(out.message.content), out.message.content


@pytest.mark.parametrize("extra,param", [
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
    ({"guided_regex": "a("}, "guided_regex"),
    ({"structured_outputs": {"json": {"type": "objectx"}}}, "structured_outputs.json"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"structured_outputs": {"grammar": "root ::= nothing_here"}}, "structured_outputs.grammar"),
    ({"structured_outputs": {"regex": "a+", "structural_tag": "{}"}}, "structural_tag"),
    ({"guided_choice": ["a"], "regex": "a+"}, "only one of regex, guided_choice"),
    ({"structured_outputs": {"choice": ["a"], "regex": "a"}}, "structured_outputs.choice, structured_outputs.regex"),
])
def test_bad_or_clashing_vllm_constraints_are_400_naming_the_field(client, extra, param):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="llama", messages=ASK, max_tokens=8, extra_body=extra)
    assert param in str(err.value)


def test_auto_with_a_known_template_constrains_started_calls():
    """tool_choice auto, Qwen/Hermes or Llama 3.1 template: free text is allowed, but a started
    call must be a valid call of one of the tools; the calls parse back from the text."""
    from xgrammar.testing import _is_grammar_accept_string as accepts

    from tandem.server.openai_schemas import Tool
    from tandem.server.structured import ToolCalls, ToolMode

    mode = ToolMode("auto", [Tool.model_validate(t) for t in TOOLS], parallel=True, family="hermes")
    grammar = mode.grammar()
    good = 'Let me check.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Lima", "unit": "C"}}\n</tool_call>'
    assert accepts(grammar, "Just text, no call.")
    assert accepts(grammar, good)
    assert not accepts(grammar, '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome", "unit": "C"}}\n</tool_call>')
    assert not accepts(grammar, '<tool_call>\n{"name": "launch", "arguments": {}}\n</tool_call>')
    message, reason = ToolCalls(mode).message(good, "stop")
    assert reason == "tool_calls" and message["content"] == "Let me check."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message["tool_calls"]] == \
        [("get_weather", {"city": "Lima", "unit": "C"})]
    llama = ToolMode("auto", mode.tools, parallel=True, family="llama3")
    call = '{"name": "get_time", "parameters": {"zone": 3}}'
    assert accepts(llama.grammar(), call) and accepts(llama.grammar(), "No call needed.")
    assert not accepts(llama.grammar(), '{"name": "get_time", "parameters": {"zone": 30}}')
    message, reason = ToolCalls(llama).message(call, "stop")
    assert reason == "tool_calls" and json.loads(message["tool_calls"][0]["function"]["arguments"]) == {"zone": 3}


def test_auto_streams_text_and_holds_back_a_starting_call():
    from tandem.server.openai_schemas import Tool
    from tandem.server.structured import ToolCalls, ToolMode

    calls = ToolCalls(ToolMode("auto", [Tool.model_validate(t) for t in TOOLS], parallel=True, family="hermes"))
    pieces = ["Sure", ", checking.", "<tool", '_call>\n{"name": "get_time", ', '"arguments": {"zone": 1}}\n</tool_call>']
    sent = [calls.stream(p, False, None)[0] for p in pieces]
    assert sent[:3] == [[{"content": "Sure"}], [{"content": ", checking."}], []]
    assert sent[3:] == [[], []]
    deltas, reason = calls.stream("", True, "stop")
    assert reason == "tool_calls"
    assert [d["tool_calls"][0]["function"] for d in deltas] == [{"name": "get_time", "arguments": '{"zone": 1}'}]


HOSTILE = [  # constraints that leave no token once the grammar is complete (min_tokens bans EOS)
    dict(regex="(yes|no)", min_tokens=8),
    dict(regex="[ab]", min_tokens=3, stop_token_ids=[7]),
    dict(ebnf='root ::= "ok"', min_tokens=6),
]


def _engine_pids(server_pid: int) -> set[int]:
    import psutil
    return {p.pid for p in psutil.Process(server_pid).children(recursive=True)}


def test_constraints_that_leave_no_token_never_hurt_other_streams(client, server_pid):
    """Each hostile request gets a 400 (or an error event when streamed) while canary streams
    run beside it: they finish with every token, the engine process is the same, /health 200."""
    import threading
    pids = _engine_pids(server_pid)
    canaries: list = []

    def canary() -> None:
        stream = client.completions.create(model="llama", prompt="Once upon a time", max_tokens=120,
                                           temperature=0, stream=True, extra_body={"ignore_eos": True})
        canaries.append([c.choices[0].finish_reason for c in stream if c.choices][-1])

    threads = [threading.Thread(target=canary) for _ in range(3)]
    for t in threads:
        t.start()
    for body in HOSTILE:
        with pytest.raises(openai.BadRequestError, match="no token satisfies"):
            client.completions.create(model="llama", prompt="Answer:", max_tokens=16, extra_body=body)
        with pytest.raises(openai.APIError, match="no token satisfies"):
            for _ in client.completions.create(model="llama", prompt="Answer:", max_tokens=16, stream=True,
                                               extra_body=body):
                pass
    for t in threads:
        t.join(timeout=120)
    assert canaries == ["length"] * 3
    assert _engine_pids(server_pid) == pids
    assert httpx.get(str(client.base_url).removesuffix("/v1/") + "/health").status_code == 200
