"""The request surface code written for OpenAI or vLLM touches first, against a live server:
every standard field accepted, vLLM's extensions honoured, vLLM's extra endpoints, and
errors the big client libraries classify. The third-party clients themselves are in
test_clients.py."""
import copy
import time

import httpx
import openai
import pytest

from test_server import CONTEXT, GREEDY, PROMPT, running_server


@pytest.fixture(scope="module")
def served(tiny_text_model, tmp_path_factory):
    log = tmp_path_factory.mktemp("surface") / "server.log"
    with running_server(tiny_text_model, log, "--max-running-requests", "16") as (url, proc):
        yield url, log
    assert proc.returncode == 0, log.read_text()


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served[0] + "/v1", api_key="none", max_retries=0)


def _log_lines(log, words: str) -> list[str]:
    return [line for line in log.read_text().splitlines() if words in line]


def test_every_standard_field_is_accepted_and_ignored_ones_logged_once(served, client):
    url, log = served
    extra = dict(store=True, metadata={"team": "a"}, service_tier="auto", reasoning_effort="low",
                 parallel_tool_calls=False, user="u-1", prompt_cache_key="k", safety_identifier="s",
                 verbosity="low", stream_options=None, frequency_penalty=0.0, presence_penalty=0.0,
                 logit_bias={}, modalities=["text"], n=1, seed=3, top_p=1.0)
    messages = [{"role": "developer", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "Hello"}, {"type": "text", "text": " there"}]}]
    for _ in range(2):
        r = client.chat.completions.create(model="llama", messages=messages, max_completion_tokens=3,
                                           temperature=0, **extra,
                                           extra_body={"not_a_field": 1, "top_k": 5, "ignore_eos": True})
        assert r.choices[0].finish_reason == "length"
    r = client.completions.create(model="llama", prompt=PROMPT, max_tokens=2, user="u-1", suffix=None,
                                  extra_body={"not_a_field": 2, "spaces_between_special_tokens": True})
    assert r.usage.completion_tokens == 2
    time.sleep(0.5)  # the log is written by the server process
    assert len(_log_lines(log, "ignoring request field 'store'")) == 1
    assert len(_log_lines(log, "ignoring request field 'reasoning_effort'")) == 1
    assert len(_log_lines(log, "ignoring unknown request field 'not_a_field'")) == 1
    assert not _log_lines(log, "'top_k'") and not _log_lines(log, "'user'")


def test_text_content_parts_are_joined(client, builtin_tokenizer):
    parts = [{"type": "text", "text": "Tell me "}, {"type": "text", "text": "a story."}]
    joined = [{"role": "user", "content": "Tell me a story."}]
    a = client.chat.completions.create(model="llama", messages=[{"role": "user", "content": parts}],
                                       max_tokens=6, **GREEDY)
    b = client.chat.completions.create(model="llama", messages=joined, max_tokens=6, **GREEDY)
    assert a.choices[0].message.content == b.choices[0].message.content
    assert a.usage.prompt_tokens == b.usage.prompt_tokens


def test_logit_bias_min_tokens_and_stop_inclusion(client):
    forced = client.completions.create(model="llama", prompt=PROMPT, max_tokens=4, logit_bias={"1000": 100},
                                       logprobs=0, **GREEDY)
    assert forced.choices[0].logprobs.tokens == [forced.choices[0].logprobs.tokens[0]] * 4
    # Token 1000 as a stop id ends at once; min_tokens holds it off for 3 tokens.
    body = dict(logit_bias={"1000": 100}, stop_token_ids=[1000])
    short = client.completions.create(model="llama", prompt=PROMPT, max_tokens=8, temperature=0, extra_body=body)
    held = client.completions.create(model="llama", prompt=PROMPT, max_tokens=8, temperature=0,
                                     extra_body={**body, "min_tokens": 3})
    assert (short.usage.completion_tokens, held.usage.completion_tokens) == (1, 4)
    assert held.choices[0].finish_reason == "stop"
    text = client.completions.create(model="llama", prompt=PROMPT, max_tokens=16, **GREEDY).choices[0].text
    stop = text[4:7]
    kept = client.completions.create(model="llama", prompt=PROMPT, max_tokens=16, stop=[stop], temperature=0,
                                     extra_body={"ignore_eos": True, "include_stop_str_in_output": True})
    assert kept.choices[0].text == text[:text.index(stop) + len(stop)]


def test_echo_and_best_of(client, builtin_tokenizer):
    plain = client.completions.create(model="llama", prompt=PROMPT, max_tokens=5, **GREEDY).choices[0].text
    echoed = client.completions.create(model="llama", prompt=PROMPT, max_tokens=5, echo=True, **GREEDY)
    assert echoed.choices[0].text == PROMPT + plain
    ids = builtin_tokenizer.encode(PROMPT)
    streamed = client.completions.create(model="llama", prompt=ids, max_tokens=5, echo=True, stream=True, **GREEDY)
    assert "".join(c.choices[0].text for c in streamed) == builtin_tokenizer.decode(ids) + plain
    kw = dict(model="llama", prompt=PROMPT, max_tokens=6, temperature=1.0, seed=11)
    every = client.completions.create(n=4, logprobs=0, **kw).choices
    best = client.completions.create(n=2, best_of=4, **kw)
    ranked = sorted(every, key=lambda c: sum(c.logprobs.token_logprobs), reverse=True)[:2]
    assert [c.text for c in best.choices] == [c.text for c in ranked]
    assert [c.index for c in best.choices] == [0, 1] and best.choices[0].logprobs is None
    assert best.usage.completion_tokens == sum(len(c.logprobs.tokens) for c in every)


def test_continuous_usage_in_every_chunk(client):
    chunks = list(client.completions.create(model="llama", prompt=PROMPT, max_tokens=4, stream=True,
                                            stream_options={"include_usage": True, "continuous_usage_stats": True},
                                            **GREEDY))
    counts = [c.usage.completion_tokens for c in chunks if c.choices]
    assert counts == sorted(counts) and counts[-1] == 4 and chunks[-1].usage.completion_tokens == 4


def test_models_version_tokenize_detokenize(served, client, builtin_tokenizer):
    url, _ = served
    assert client.models.retrieve("llama").id == "llama"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-9")
    assert httpx.get(url + "/version").json()["version"]
    r = httpx.post(url + "/tokenize", json={"prompt": PROMPT, "return_token_strs": True}).json()
    ids = builtin_tokenizer.encode(PROMPT)
    assert (r["tokens"], r["count"], r["max_model_len"]) == (ids, len(ids), CONTEXT)
    assert r["token_strs"] == builtin_tokenizer.convert_ids_to_tokens(ids)
    messages = [{"role": "user", "content": "hi"}]
    r = httpx.post(url + "/tokenize", json={"messages": messages}).json()
    assert r["tokens"] == builtin_tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                                 tokenize=True, return_dict=False)
    assert r["token_strs"] is None
    assert httpx.post(url + "/detokenize", json={"tokens": ids}).json() == {"prompt": PROMPT}
    assert httpx.post(url + "/tokenize", json={}).status_code == 400
    assert httpx.post(url + "/detokenize", json={"tokens": [-1]}).json()["error"]["param"] == "tokens"


def test_context_window_error_has_vllms_wording(client):
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model="llama", prompt=PROMPT, max_tokens=1000)
    body = err.value.body
    assert body["code"] == "context_length_exceeded" and body["param"] == "max_tokens"
    assert body["message"].startswith(f"This model's maximum context length is {CONTEXT} tokens. "
                                      "However, you requested")


def test_chat_template_kwargs_reach_the_template(builtin_tokenizer):
    from tandem.server.inputs import render_chat
    from tandem.server.openai_schemas import ChatMessage

    tok = copy.deepcopy(builtin_tokenizer)
    tok.chat_template = ("{% if shout %}LOUD {% endif %}{% for m in messages %}{{ m['content'] }}{% endfor %}"
                         "{% if add_generation_prompt %} >{% endif %}")
    msgs = [ChatMessage(role="user", content="hi")]
    assert tok.decode(render_chat(tok, msgs, True, False, {"shout": True})) == "LOUD hi >"
    assert tok.decode(render_chat(tok, msgs, False, False, None)) == "hi"
