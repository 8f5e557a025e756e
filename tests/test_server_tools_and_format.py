"""/v1/chat/completions with both `response_format` and `tools`, as the Agents SDK's
chat-completions model with an output type and pydantic-ai send them, against a server on
the tiny model whose tokenizer carries a Hermes/Qwen template (a known call format: the
output is JSON in the format or a call). The unknown-template 400 is in test_server_structured."""
import json

import jsonschema
import openai
import pytest

from test_server import cleanly_exiting_server, openai_client

pytest.importorskip("xgrammar")

HERMES = ("{%- if tools %}<|im_start|>system\nTools:{% for t in tools %} {{ t.function.name }}{% endfor %}. "
          "Call one as <tool_call>\n{\"name\": ..., \"arguments\": {...}}\n</tool_call><|im_end|>\n{% endif %}"
          "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
          "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "additionalProperties": False, "required": ["city"],
                                          "properties": {"city": {"enum": ["Paris", "Tokyo", "Lima"]}}}}}
ANSWER = {"type": "object", "additionalProperties": False, "required": ["warm", "degrees"],
          "properties": {"warm": {"type": "boolean"}, "degrees": {"type": "integer", "minimum": -20, "maximum": 40}}}
FORMAT = {"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER, "strict": True}}
ASK = [{"role": "user", "content": "Is it warm in Paris?"}]
ASKED = dict(model="llama", messages=ASK, tools=[WEATHER], response_format=FORMAT, max_tokens=48, temperature=0)


@pytest.fixture(scope="module")
def client(tiny_text_model, builtin_tokenizer, tmp_path_factory):
    folder = tmp_path_factory.mktemp("server_tools_and_format")
    tokenizer = folder / "tokenizer"
    original, builtin_tokenizer.chat_template = builtin_tokenizer.chat_template, HERMES
    try:  # the session's tokenizer: its own template back after saving
        builtin_tokenizer.save_pretrained(tokenizer)
    finally:
        builtin_tokenizer.chat_template = original
    with cleanly_exiting_server(tiny_text_model, folder / "server.log", "--tokenizer", str(tokenizer),
                                "--max-model-len", "256") as (url, _):
        yield openai_client(url)


def _is_call(message) -> bool:
    (call,) = message.tool_calls
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    return True


def _is_answer(message) -> bool:
    assert not message.tool_calls
    jsonschema.validate(json.loads(message.content), ANSWER)
    return True


def test_auto_gives_json_in_the_format_or_a_call(client):
    """A random model picks either way; the grammar allows only these two (never free text),
    and the streamed reply is the same one (greedy)."""
    seen = set()
    for seed in range(4):
        done = client.chat.completions.create(**{**ASKED, "temperature": 1.0, "seed": seed})
        choice = done.choices[0]
        message = choice.message
        if choice.finish_reason == "tool_calls":
            seen.add("call") if _is_call(message) else None
        elif choice.finish_reason == "stop":
            seen.add("json") if _is_answer(message) else None
        else:  # cut at the limit (a random model): still the start of one of the two
            assert (message.content or "").startswith(("{", "<tool_call>")), choice
    assert seen, "no reply finished"
    whole = client.chat.completions.create(**ASKED).choices[0]
    chunks = list(client.chat.completions.create(**ASKED, stream=True))
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    calls = [t for c in chunks if c.choices for t in c.choices[0].delta.tool_calls or ()]
    assert content == (whole.message.content or "")
    assert [t.function.arguments for t in calls] == [t.function.arguments for t in whole.message.tool_calls or ()]
    assert chunks[-1].choices[0].finish_reason == whole.finish_reason


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_a_forced_call_is_the_output_whatever_the_format(client, choice):
    done = client.chat.completions.create(**ASKED, tool_choice=choice).choices[0]
    assert done.finish_reason == "tool_calls" and _is_call(done.message)


def test_tool_choice_none_gives_json_in_the_format(client):
    done = client.chat.completions.create(**ASKED, tool_choice="none").choices[0]
    assert done.finish_reason == "stop" and _is_answer(done.message)


def test_a_bad_format_schema_is_a_400_naming_response_format(client):
    bad = {"type": "json_schema", "json_schema": {"name": "bad", "schema": {"type": "objectx"}}}
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(**{**ASKED, "response_format": bad})
    assert err.value.body["param"] == "response_format" and "objectx" in str(err.value)
