"""Tool calls cut by max_tokens: every complete call is returned (finish_reason "length"), the
unfinished rest is dropped, never raw JSON in content; tool_choice "required" streams each call
as soon as it is complete. The random built-in model keeps calling (a runaway list), so its
replies are cut mid-list."""
import json

import jsonschema
import pytest

from tandem.server.openai_schemas import Tool
from tandem.server.structured import ToolCalls, ToolMode, complete_array_items
from test_server import cleanly_exiting_server, openai_client

pytest.importorskip("xgrammar")

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
          "properties": {"name": {"enum": ["Alice", "Bob"]}, "age": {"type": "integer", "minimum": 0, "maximum": 99}}}
FINAL = {"type": "function", "function": {"name": "final_result", "parameters": PERSON}}
ASK = [{"role": "user", "content": "Alice is 31 years old."}]
CALLS = [{"name": "final_result", "arguments": {"name": "Alice", "age": 31}},
         {"name": "final_result", "arguments": {"name": "Bob", "age": 7}},
         {"name": "final_result", "arguments": {"name": "Alice", "age": 2}}]
ARRAY = json.dumps(CALLS)


def _mode(kind: str = "required", parallel: bool = True, tools=(FINAL,), family=None) -> ToolMode:
    return ToolMode(kind, [Tool.model_validate(t) for t in tools], parallel, family)


def _ends() -> list[int]:
    """Where each call of ARRAY ends in the text."""
    ends, at = [], 0
    for call in CALLS:
        at = ARRAY.index(json.dumps(call), at) + len(json.dumps(call))
        ends.append(at)
    return ends


def test_complete_items_of_every_cut_array():
    ends = _ends()
    for cut in range(len(ARRAY) + 1):
        items, _ = complete_array_items(ARRAY[:cut])
        assert items == [c for c, end in zip(CALLS, ends) if end <= cut], cut


def test_a_reply_cut_mid_list_keeps_its_complete_calls():
    cut = ARRAY[:_ends()[1] + 12]  # two calls and the start of a third
    message, reason = ToolCalls(_mode()).message(cut, "length")
    assert reason == "length" and message["content"] is None
    assert [json.loads(c["function"]["arguments"]) for c in message["tool_calls"]] == \
        [c["arguments"] for c in CALLS[:2]]
    message, reason = ToolCalls(_mode()).message(ARRAY[:_ends()[0] - 3], "length")  # no call complete
    assert reason == "length" and message == {"role": "assistant", "content": None}
    message, reason = ToolCalls(_mode()).message(ARRAY, "stop")
    assert reason == "tool_calls" and len(message["tool_calls"]) == 3


def test_required_calls_stream_as_each_completes():
    calls, sent_at = ToolCalls(_mode()), []
    cut = ARRAY[:-5]  # the third call unfinished
    for at, char in enumerate(cut):
        deltas, reason = calls.stream(char, at == len(cut) - 1, "length" if at == len(cut) - 1 else None)
        sent_at += [(at + 1, d["tool_calls"][0]) for d in deltas]
    assert reason == "length"
    assert [at for at, _ in sent_at] == _ends()[:2]  # each call in the delta that completed it
    assert [(c["index"], c["function"]["name"], json.loads(c["function"]["arguments"])) for _, c in sent_at] == \
        [(i, c["name"], c["arguments"]) for i, c in enumerate(CALLS[:2])]
    assert all(c["id"] and c["type"] == "function" for _, c in sent_at)


def test_auto_calls_cut_at_the_limit():
    mode = _mode("auto", family="hermes")
    text = ('Checking.<tool_call>\n{"name": "final_result", "arguments": {"name": "Bob", "age": 7}}\n</tool_call>'
            '<tool_call>\n{"name": "final_res')
    message, reason = ToolCalls(mode).message(text, "length")
    assert reason == "length" and message["content"] == "Checking."
    assert [c["function"]["name"] for c in message["tool_calls"]] == ["final_result"]


@pytest.mark.parametrize("parallel,two_ok", [(True, True), (False, False)])
def test_the_required_grammar_may_end_the_array_after_any_call(parallel, two_ok):
    """parallel_tool_calls unset (True): one call or more; false: exactly one."""
    import xgrammar as xgr
    from xgrammar.testing import _is_grammar_accept_string as accepts
    grammar = str(xgr.Grammar.from_json_schema(json.dumps(_mode(parallel=parallel).schema()), any_whitespace=False))
    assert accepts(grammar, json.dumps(CALLS[:1]))
    assert accepts(grammar, json.dumps(CALLS[:2])) == two_ok
    assert not accepts(grammar, "[]")


# ---- through the server (the random model) ----
@pytest.fixture(scope="module")
def client(tiny_text_model, tmp_path_factory):
    log = tmp_path_factory.mktemp("server_tool_length") / "server.log"
    with cleanly_exiting_server(tiny_text_model, log, "--max-model-len", "256") as (url, _):
        yield openai_client(url)


def _ask(client, **kw):
    return client.chat.completions.create(model="llama", messages=ASK, tools=[FINAL], tool_choice="required",
                                          temperature=0, **kw)


def test_calls_complete_at_the_length_limit_are_returned(client):
    """Greedy, the model calls again and again: at max_tokens the complete calls are the
    answer (finish_reason length), streamed or not, and no JSON is left in content."""
    done = _ask(client, max_tokens=60).choices[0]
    assert done.finish_reason == "length" and done.message.content is None
    assert done.message.tool_calls
    for call in done.message.tool_calls:
        assert call.function.name == "final_result"
        jsonschema.validate(json.loads(call.function.arguments), PERSON)
    chunks = [c for chunk in _ask(client, max_tokens=60, stream=True) for c in chunk.choices]
    streamed = [t.function for c in chunks for t in c.delta.tool_calls or ()]
    assert [(f.name, f.arguments) for f in streamed] == \
        [(c.function.name, c.function.arguments) for c in done.message.tool_calls]
    assert chunks[-1].finish_reason == "length" and not any(c.delta.content for c in chunks)


def test_no_complete_call_leaves_no_raw_json(client):
    """The issue's case: a string argument the random model never closes. Before, the cut
    array came back as content; now the message is empty."""
    person = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
              "required": ["name", "age"]}
    tool = {"type": "function", "function": {"name": "final_result", "parameters": person}}
    done = client.chat.completions.create(model="llama", messages=ASK, tools=[tool], tool_choice="required",
                                          temperature=0, max_tokens=40).choices[0]
    assert done.finish_reason == "length"
    assert done.message.content is None and not done.message.tool_calls
