"""POST /v1/responses against a live `tandem serve` on the tiny model, through the `openai`
SDK (responses.create / .stream / .parse) and the OpenAI Agents SDK (its Responses model
and its chat-completions model) running a function-tool loop. The model is random: where a
test needs a shape (a call, JSON) a grammar makes it, and greedy sampling makes two runs equal."""
import asyncio
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Literal

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from test_server import async_openai_client, cleanly_exiting_server, openai_client

pytest.importorskip("xgrammar")

GREEDY = dict(temperature=0)
WEATHER = {"type": "function", "name": "get_weather", "description": "Weather in a city",
           "parameters": {"type": "object", "additionalProperties": False, "required": ["city"],
                          "properties": {"city": {"enum": ["Paris", "Tokyo", "Lima"]}}}}
TIME = {"type": "function", "name": "get_time",
        "parameters": {"type": "object", "additionalProperties": False, "required": ["zone"],
                       "properties": {"zone": {"type": "integer", "minimum": -12, "maximum": 12}}}}
TOOLS = [WEATHER, TIME]
ASK = "What is the weather in Paris?"
STORED = 4  # --max-stored-responses: each test uses a stored response right after it is made


class Answer(BaseModel):
    city: Literal["Paris", "Tokyo", "Lima"]
    warm: bool
    degrees: int = Field(ge=-20, le=40)


@pytest.fixture(scope="module")
def served(tiny_text_model, tmp_path_factory):
    log = tmp_path_factory.mktemp("server_responses") / "server.log"
    with cleanly_exiting_server(tiny_text_model, log, "--max-running-requests", "8", "--max-model-len", "256",
                                "--max-stored-responses", str(STORED)) as (url, _):
        yield url


@pytest.fixture(scope="module")
def client(served):
    return openai_client(served)


def _text(response) -> str:
    (item,) = response.output
    assert item.type == "message" and item.role == "assistant"
    (part,) = item.content
    assert part.type == "output_text"
    return part.text


def test_text_input_forms_match_the_chat_endpoint(client):
    """A string, a message list with instructions, and text content parts all render as the
    chat endpoint renders the same conversation: same prompt tokens, same greedy text."""
    chat = client.chat.completions.create(model="llama", messages=[{"role": "system", "content": "Be brief."},
                                                                   {"role": "user", "content": ASK}],
                                          max_tokens=6, extra_body={"ignore_eos": True}, **GREEDY)
    forms = [dict(input=ASK, instructions="Be brief."),
             dict(input=[{"role": "developer", "content": "Be brief."}, {"role": "user", "content": ASK}]),
             dict(input=[{"type": "message", "role": "user", "content": [{"type": "input_text", "text": ASK[:8]},
                                                                          {"type": "input_text", "text": ASK[8:]}]}],
                  instructions="Be brief.")]
    for form in forms:
        r = client.responses.create(model="llama", max_output_tokens=6, extra_body={"ignore_eos": True}, **GREEDY,
                                    **form)
        assert _text(r) == chat.choices[0].message.content and r.output_text == _text(r)
        assert (r.usage.input_tokens, r.usage.output_tokens) == (chat.usage.prompt_tokens, 6)
        assert r.usage.total_tokens == r.usage.input_tokens + 6
        assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
        assert r.output[0].status == "incomplete" and r.id.startswith("resp_") and r.object == "response"


def test_stream_event_sequence_adds_up_to_the_whole_response(client):
    kw = dict(model="llama", input=ASK, max_output_tokens=8, extra_body={"ignore_eos": True}, **GREEDY)
    whole = client.responses.create(**kw)
    events = list(client.responses.create(stream=True, **kw))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == _text(whole) == events[-4].text
    final = events[-1].response
    assert final.status == "incomplete" and _text(final) == deltas and final.usage.output_tokens == 8
    assert final.id == events[0].response.id and events[0].response.status == "in_progress"


def test_parse_and_stream_with_a_json_schema_text_format(client):
    parsed = client.responses.parse(model="llama", input=ASK, text_format=Answer, max_output_tokens=60,
                                    temperature=0.9, extra_body={"seed": 1})
    assert parsed.status == "completed" and isinstance(parsed.output_parsed, Answer)
    with client.responses.stream(model="llama", input=ASK, text_format=Answer, max_output_tokens=60,
                                 temperature=0.9, extra_body={"seed": 1}) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_response()
    assert kinds[-1] == "response.completed"
    assert final.output_parsed == parsed.output_parsed and final.output_text == parsed.output_text
    assert final.text.format.type == "json_schema"



def test_a_request_the_engine_fails_is_a_400_or_a_failed_stream(client):
    """A format whose grammar is complete at once, with min_tokens banning the end: no token
    satisfies it. Whole, that is the engine's 400; streamed (headers sent), response.failed."""
    kw = dict(model="llama", input=ASK, max_output_tokens=16, extra_body={"min_tokens": 8},
              text={"format": {"type": "json_schema", "name": "yes", "schema": {"enum": ["yes"]}}})
    with pytest.raises(openai.BadRequestError, match="no token satisfies"):
        client.responses.create(**kw)
    events = list(client.responses.create(stream=True, **kw))
    assert [e.type for e in events[:2]] == ["response.created", "response.in_progress"]
    last = events[-1]
    assert last.type == "response.failed" and last.response.status == "failed"
    assert "no token satisfies" in last.response.error.message and last.sequence_number == len(events) - 1
    after = client.responses.create(model="llama", input="Hi", max_output_tokens=2, extra_body={"ignore_eos": True})
    assert after.usage.output_tokens == 2  # still serving

def _check_call(item, names=("get_weather", "get_time")):
    assert item.type == "function_call" and item.call_id and item.status == "completed"
    assert item.name in names
    schema = {t["name"]: t["parameters"] for t in TOOLS}[item.name]
    jsonschema.validate(json.loads(item.arguments), schema)


def test_function_calls_required_named_and_streamed(client):
    required = client.responses.create(model="llama", input=ASK, tools=TOOLS, tool_choice="required",
                                       max_output_tokens=60, temperature=0.9, extra_body={"seed": 3})
    assert required.status == "completed" and len(required.output) >= 1
    for item in required.output:
        _check_call(item)
    named = dict(model="llama", input=ASK, tools=TOOLS, tool_choice={"type": "function", "name": "get_time"},
                 max_output_tokens=40, temperature=0.9, extra_body={"seed": 4})
    whole = client.responses.create(**named)
    (call,) = whole.output
    _check_call(call, ("get_time",))
    with client.responses.stream(**named) as stream:
        events = list(stream)
        final = stream.get_final_response()
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    (done,) = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert args == done.arguments == call.arguments == final.output[0].arguments
    assert final.output[0].name == "get_time" and events[-1].type == "response.completed"


def test_tool_loop_through_previous_response_id_equals_the_explicit_input(client):
    """Turn 2 sends only the call's output and previous_response_id: the model sees what it
    would see were the whole conversation sent again (same prompt tokens, same greedy text)."""
    first = client.responses.create(model="llama", input=ASK, tools=TOOLS,
                                    tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=40,
                                    **GREEDY)
    (call,) = first.output
    answer = {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 21 C"}
    kw = dict(model="llama", tools=TOOLS, max_output_tokens=5, extra_body={"ignore_eos": True}, **GREEDY)
    chained = client.responses.create(input=[answer], previous_response_id=first.id, **kw)
    explicit = client.responses.create(input=[{"role": "user", "content": ASK}, call.model_dump(), answer],
                                       store=False, **kw)
    assert chained.previous_response_id == first.id
    assert chained.usage.input_tokens == explicit.usage.input_tokens > first.usage.input_tokens + 5
    assert chained.output_text == explicit.output_text and chained.output_text
    # A third turn chains on the second: the conversation grows again.
    third = client.responses.create(input="Thanks!", previous_response_id=chained.id, **kw)
    assert third.usage.input_tokens > chained.usage.input_tokens + 5


def test_store_retrieve_delete_and_store_false(client):
    kept = client.responses.create(model="llama", input="Hi", max_output_tokens=3, **GREEDY)
    got = client.responses.retrieve(kept.id)
    assert got.id == kept.id and got.output_text == kept.output_text and got.store is True
    unstored = client.responses.create(model="llama", input="Hi", max_output_tokens=3, store=False, **GREEDY)
    assert unstored.store is False
    for missing in (unstored.id, "resp_nope"):
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(missing)
        with pytest.raises(openai.NotFoundError) as err:
            client.responses.create(model="llama", input="Hi", previous_response_id=missing, max_output_tokens=3)
        assert err.value.body["code"] == "previous_response_not_found"
        assert err.value.body["param"] == "previous_response_id"
    client.responses.delete(kept.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(kept.id)
    made = [client.responses.create(model="llama", input="Hi", max_output_tokens=1).id for _ in range(STORED + 1)]
    with pytest.raises(openai.NotFoundError):  # past --max-stored-responses the oldest goes
        client.responses.retrieve(made[0])
    assert [client.responses.retrieve(i).id for i in made[1:]] == made[1:]


@pytest.mark.parametrize("body,param,words", [
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}]},
     "input[0].content[0].type", "'input_image'"),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]},
     "input[0].content[0].type", "'input_file'"),
    ({"input": ASK, "tools": [{"type": "web_search"}]}, "tools[0].type", "'web_search'"),
    ({"input": ASK, "tools": [WEATHER, {"type": "file_search", "vector_store_ids": ["v"]}]}, "tools[1].type",
     "'file_search'"),
    ({"input": [{"type": "web_search_call", "id": "w"}]}, "input[0].type", "'web_search_call'"),
    ({"input": ASK, "tool_choice": {"type": "web_search_preview"}}, "tool_choice", "'web_search_preview'"),
    ({"input": ASK, "tools": TOOLS, "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice", "'nope'"),
    ({"input": ASK, "text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema", "schema"),
    ({"input": ASK, "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "objectx"}}}},
     "text.format", "objectx"),
    ({"input": ASK, "background": True}, "background", "background"),
    ({"input": ASK, "temperature": -1.0}, "temperature", "temperature"),
    ({"input": ASK, "max_output_tokens": 0}, "max_output_tokens", "max_output_tokens"),
    ({"input": ASK * 100, "max_output_tokens": 8}, "input", "maximum context length"),
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input[0].call_id", "call_id"),
    ({"input": [{"role": "robot", "content": "x"}]}, "input[0].role", "robot"),
    ({"input": []}, "input", "empty"),
])
def test_unsupported_or_bad_requests_are_400_naming_the_field(served, body, param, words):
    r = httpx.post(served + "/v1/responses", json={"model": "llama", **body}, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and words in err["message"] and err["type"] == "invalid_request_error"



@pytest.mark.slow
def test_schemathesis_fuzzing_finds_no_server_error(served, tmp_path):
    """Random bodies for POST /v1/responses and random ids for GET/DELETE: never a 5xx."""
    st = Path(sys.executable).with_name("st")
    cmd = [str(st), "run", f"{served}/openapi.json", "--include-path-regex", "^/v1/responses", "--phases", "fuzzing",
           "--checks", "not_a_server_error", "--max-examples", "15", "--seed", "1", "--no-color",
           "--generation-database", "none", "--request-timeout", "60", "--workers", "1"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-5000:] + r.stderr[-2000:]
    assert re.search(r"[1-9]\d* generated, \d+ passed", r.stdout), r.stdout[-2000:]

def test_store_is_bounded_by_count_and_bytes():
    from tandem.server.responses_store import ResponseStore

    store = ResponseStore(max_responses=3, max_bytes=10_000)
    for i in range(5):
        store.put({"id": f"r{i}"}, [{"role": "user", "content": "x"}])
    assert [store.get(f"r{i}") is not None for i in range(5)] == [False, False, True, True, True]
    store.put({"id": "big"}, [{"role": "user", "content": "y" * 6000}])
    store.put({"id": "big2"}, [{"role": "user", "content": "z" * 6000}])
    assert store.get("big") is None and store.get("big2") is not None and store.bytes <= 10_000
    store.put({"id": "huge"}, [{"role": "user", "content": "w" * 20_000}])  # over the bound alone: not kept
    assert store.get("huge") is None and store.get("big2") is not None
    assert ResponseStore(max_responses=0).put({"id": "a"}, []) is None and len(ResponseStore(max_responses=0)) == 0


def test_a_json_format_with_auto_tools_allows_json_or_a_call():
    """auto + a JSON text format on a template with a known call format: the output is JSON
    in the format or the tools' calls, never free text (an agent with an output type still
    calls its tools)."""
    from xgrammar.testing import _is_grammar_accept_string as accepts

    from tandem.server.openai_schemas import Tool
    from tandem.server.structured import FormatOrCalls

    tools = [Tool.model_validate({"type": "function", "function": {k: v for k, v in t.items() if k != "type"}})
             for t in TOOLS]
    grammar = FormatOrCalls("auto", tools, True, "hermes", Answer.model_json_schema()).grammar()
    assert accepts(grammar, '{"city": "Lima", "warm": true, "degrees": 3}')
    assert accepts(grammar, '<tool_call>\n{"name": "get_time", "arguments": {"zone": 2}}\n</tool_call>')
    assert not accepts(grammar, "Just text.")
    assert not accepts(grammar, '{"city": "Rome", "warm": true, "degrees": 3}')


# ---- the OpenAI Agents SDK: a function-tool loop against the server ----

def _weather_agent(model, output_type=None):
    """An agent that must call get_weather first (tool_choice required; the SDK resets it to
    auto after the call) and then answers: with `output_type`, in its JSON schema (which the
    grammar makes complete, so the Responses status is "completed", as the SDK requires)."""
    agents = pytest.importorskip("agents")
    calls = []

    @agents.function_tool
    def get_weather(city: Literal["Paris", "Tokyo", "Lima"]) -> str:
        """Weather in a city."""
        calls.append(city)
        return f"Sunny in {city}, 21 C"

    settings = agents.ModelSettings(tool_choice="required", parallel_tool_calls=False, temperature=0,
                                    max_tokens=48)
    agent = agents.Agent(name="weather", instructions="Answer questions about the weather.", tools=[get_weather],
                         model=model, model_settings=settings, output_type=output_type)
    return agent, calls


def _run_config(served, use_responses: bool):
    agents = pytest.importorskip("agents")
    client = async_openai_client(served)
    return agents.RunConfig(model_provider=agents.OpenAIProvider(openai_client=client, use_responses=use_responses),
                            tracing_disabled=True)


def _tool_items(result):
    return [item.type for item in result.new_items]


@pytest.mark.slow
def test_agents_sdk_responses_model_runs_a_tool_loop(served):
    """The Agents SDK's default model (the Responses API): a call, its output sent back, a
    typed final answer; run whole, streamed, and chained by previous_response_id."""
    agents = pytest.importorskip("agents")
    agent, calls = _weather_agent("llama", Answer)
    config = _run_config(served, use_responses=True)

    async def runs():
        whole = await agents.Runner.run(agent, ASK, run_config=config)
        streamed = agents.Runner.run_streamed(agent, ASK, run_config=config)
        kinds = [e.data.type async for e in streamed.stream_events() if e.type == "raw_response_event"]
        chained = await agents.Runner.run(agent, ASK, run_config=config, auto_previous_response_id=True)
        return whole, streamed, kinds, chained

    whole, streamed, kinds, chained = asyncio.run(runs())
    for result in (whole, streamed, chained):
        assert isinstance(result.final_output, Answer)
        assert _tool_items(result) == ["tool_call_item", "tool_call_output_item", "message_output_item"]
    assert len(calls) == 3 and set(calls) <= {"Paris", "Tokyo", "Lima"}
    assert streamed.final_output == whole.final_output  # greedy: the same answer
    assert kinds.count("response.created") == 2 and kinds.count("response.completed") == 2
    assert "response.function_call_arguments.delta" in kinds and "response.output_text.delta" in kinds
    assert chained.final_output == whole.final_output
    assert chained.raw_responses[1].usage.input_tokens == whole.raw_responses[1].usage.input_tokens


@pytest.mark.slow
def test_agents_sdk_chat_completions_model_runs_a_tool_loop(served):
    agents = pytest.importorskip("agents")
    agent, calls = _weather_agent("llama")
    result = asyncio.run(agents.Runner.run(agent, ASK, run_config=_run_config(served, use_responses=False)))
    assert _tool_items(result) == ["tool_call_item", "tool_call_output_item", "message_output_item"]
    assert len(calls) == 1 and isinstance(result.final_output, str) and result.final_output


def test_too_many_input_items_are_refused_before_parsing():
    from tandem.server.body_shape import MAX_MESSAGES, check_body_shape
    from tandem.server.errors import APIError

    item = {"role": "user", "content": "hi"}
    check_body_shape(json.dumps({"input": [item] * MAX_MESSAGES, "user": "x" * 70_000}).encode(), 256, 1000)
    check_body_shape(json.dumps({"input": "x" * 100_000}).encode(), 256, 1000)  # a string: not items
    with pytest.raises(APIError) as err:
        check_body_shape(json.dumps({"input": [item] * (MAX_MESSAGES + 1)}).encode(), 256, 1000)
    assert err.value.param == "input" and f"{MAX_MESSAGES + 1} items" in err.value.message


def _fed(pieces, calls=None, parser="deepseek_r1", reason="stop"):
    """ResponseOutput fed a reply piece by piece (one token each), by default with DeepSeek-R1's
    reasoning parser."""
    from tandem.server import protocol as P
    from tandem.server.reasoning import PARSERS
    from tandem.server.responses_output import ResponseOutput

    out = ResponseOutput(10, calls, PARSERS[parser].splitter() if parser else None)
    events = []
    for k, text in enumerate(pieces):
        last = k == len(pieces) - 1
        events += out.feed(P.Delta("r", [7], text, last, reason if last else None, None))
    closing, status, _ = out.close()
    return out, [e["type"] for e in events + closing], status


def test_reasoning_comes_first_as_a_reasoning_item():
    """With --reasoning-parser, the reply's thinking is a `reasoning` item before the message
    (streamed as reasoning_text events), counted in reasoning_tokens, and a later turn's
    template sees it as the assistant message's reasoning_content."""
    from tandem.server.responses_input import input_messages
    from tandem.server.responses_output import as_chat_messages

    out, kinds, status = _fed(["Hm", "m</", "think>", "ye", "s"])
    reasoning, message = out.items.items
    assert reasoning["type"] == "reasoning" and reasoning["content"] == [{"type": "reasoning_text", "text": "Hmm"}]
    assert message["content"][0]["text"] == "yes" and status == "completed"
    assert kinds == ["response.output_item.added", "response.reasoning_text.delta", "response.reasoning_text.delta",
                     "response.reasoning_text.done", "response.output_item.done", "response.output_item.added",
                     "response.content_part.added", "response.output_text.delta", "response.output_text.delta",
                     "response.output_text.done", "response.content_part.done", "response.output_item.done"]
    assert out.usage()["output_tokens_details"]["reasoning_tokens"] == 3 and out.usage()["output_tokens"] == 5
    assert as_chat_messages(out.items.items) == [{"role": "assistant", "content": "yes", "reasoning_content": "Hmm"}]
    sent_back = [{"role": "user", "content": "Is it?"}, {"type": "reasoning", "summary": [],
                                                          "content": [{"type": "reasoning_text", "text": "Hmm"}]},
                 {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "yes"}]}]
    assert input_messages(sent_back)[1] == {"role": "assistant", "content": "yes", "reasoning_content": "Hmm"}


def test_a_reply_that_only_thinks_still_has_a_message_and_a_call_follows_reasoning():
    from tandem.server.openai_schemas import Tool
    from tandem.server.structured import ToolCalls, ToolMode

    out, _, _ = _fed(["Hmm, still"])
    assert [i["type"] for i in out.items.items] == ["reasoning", "message"]
    assert out.items.items[1]["content"][0]["text"] == ""
    tool = Tool.model_validate({"type": "function", "function": {"name": "get_time", "parameters": TIME["parameters"]}})
    out, kinds, _ = _fed(["Hmm</think>", '{"zone"', ": 1}"], ToolCalls(ToolMode("named", [tool], False)))
    reasoning, call = out.items.items
    assert reasoning["content"][0]["text"] == "Hmm" and call["type"] == "function_call"
    assert (call["name"], call["arguments"], call["status"]) == ("get_time", '{"zone": 1}', "completed")
    assert kinds.count("response.function_call_arguments.delta") == 2



def test_calls_cut_by_the_limit_keep_their_complete_status():
    """required, cut by max_output_tokens after one whole call: the response is incomplete, the
    whole call is not; a named call cut mid-arguments is incomplete itself."""
    from tandem.server.openai_schemas import Tool
    from tandem.server.structured import ToolCalls, ToolMode

    tool = Tool.model_validate({"type": "function", "function": {"name": "get_time", "parameters": TIME["parameters"]}})
    out, _, status = _fed(['[{"name": "get_time", "arguments": {"zone": 1}}', ', {"na'],
                          ToolCalls(ToolMode("required", [tool], True)), parser=None, reason="length")
    (call,) = [i for i in out.items.items if i["type"] == "function_call"]
    assert status == "incomplete" and call["status"] == "completed" and json.loads(call["arguments"]) == {"zone": 1}
    out, _, status = _fed(['{"zone"', ": "], ToolCalls(ToolMode("named", [tool], False)), parser=None,
                          reason="length")
    (call,) = out.items.items
    assert (status, call["status"], call["arguments"]) == ("incomplete", "incomplete", '{"zone": ')
