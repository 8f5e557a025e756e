"""--reasoning-parser: the splitter on its own, the grammar that lets reasoning come first, and
a server on a scripted model that "thinks".

The scripted model is a bigram model: its next token depends on the last one only, and the
tokens of each script follow one another. A stand-in for Qwen3's template opens `<think>` in
the prompt (as DeepSeek-R1's does) or, with enable_thinking false, closes it too; so the
model replies `Hmm</think>yes` when thinking and `Sure` when not (`</think>` is three tokens
of the built-in tokenizer, each its own delta: a tag straddling deltas).
"""
import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import transformers

from tandem.server.reasoning import PARSERS, reasoning_parser, thinking_requested
from test_server import cleanly_exiting_server, openai_client

R1, QWEN3 = PARSERS["deepseek_r1"], PARSERS["qwen3"]
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n"
            "{% if enable_thinking is defined and enable_thinking is false %}\n</think>\n\n{% endif %}{% endif %}")
ASK = [{"role": "user", "content": "Is it?"}]
THINKING, ANSWER, PLAIN = "Hmm", "yes", "Sure"
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}


# ---- the splitter ----
@pytest.mark.parametrize("parser,text,reasoning,content", [
    (R1, "Hmm</think>yes", "Hmm", "yes"),  # the template opened <think>
    (R1, "<think>Hmm</think>yes", "Hmm", "yes"),
    (R1, "Hmm, still thinking", "Hmm, still thinking", ""),  # cut before </think>: all reasoning
    (R1, "a</think>b</think>c", "a", "b</think>c"),  # after the first end tag, all is content
    (QWEN3, "<think>Hmm</think>yes", "Hmm", "yes"),
    (QWEN3, "\n<think>Hmm</think>yes", "Hmm", "yes"),
    (QWEN3, "yes", "", "yes"),  # no <think>: no reasoning (enable_thinking false)
    (QWEN3, "Hmm</think>yes", "", "Hmm</think>yes"),
    (QWEN3, "<think>Hmm", "Hmm", ""),
    (QWEN3, "<thi", "", "<thi"),  # a tag's start, then the end: text after all
    (R1, "Hmm</thi", "Hmm</thi", ""),
])
def test_split_whole_replies(parser, text, reasoning, content):
    split = parser.split(text)
    assert (split.reasoning, split.content) == (reasoning, content)


def _pieces(text: str, cuts: tuple[int, ...]) -> list[str]:
    bounds = [0, *cuts, len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:])]


@pytest.mark.parametrize("parser", [R1, QWEN3], ids=["deepseek_r1", "qwen3"])
@pytest.mark.parametrize("text", ["<think>ab</think>cd", " <think>a<b</think></think>", "x</think>y"])
def test_streamed_splits_equal_the_whole_one_wherever_the_deltas_are_cut(parser, text):
    """Every cut into up to three deltas (tags split across them included): the deltas join to
    the whole reply's split, and no delta shows a tag that was consumed."""
    whole = parser.split(text)
    n = len(text)
    for cuts in [(i, j) for i in range(n + 1) for j in range(i, n + 1)]:
        splitter = parser.splitter()
        pieces = _pieces(text, cuts)
        parts = [splitter.feed(p, [0], finished=k == len(pieces) - 1) for k, p in enumerate(pieces)]
        assert "".join(p.reasoning for p in parts) == whole.reasoning, cuts
        assert "".join(p.content for p in parts) == whole.content, cuts
        assert (splitter.reasoning, splitter.content) == (whole.reasoning, whole.content)


def test_a_held_tag_start_comes_out_with_the_next_delta():
    splitter = R1.splitter()
    assert splitter.feed("Hmm</th", [1]).reasoning == "Hmm"  # "</th" may be the end tag: held
    assert splitter.feed("ought", [1]).reasoning == "</thought"  # it was not


def test_reasoning_tokens_count_through_the_closing_token():
    splitter = R1.splitter()
    for text in ["H", "mm", "</", "think", ">", "yes", ""]:
        splitter.feed(text, [7])
    assert splitter.reasoning_tokens == 5  # H, mm and the tag's three tokens
    exact = replace(R1, end_token_id=99).splitter()  # </think> one token of the vocabulary
    exact.feed("Hmm</think>yes", [5, 6, 99, 8, 9])  # several tokens in one delta
    assert exact.reasoning_tokens == 3
    qwen = QWEN3.splitter()
    qwen.feed("yes", [3, 4])
    assert qwen.reasoning_tokens == 0 and not qwen.has_reasoning
    unfinished = R1.splitter()
    unfinished.feed("Hmm", [1, 2, 3])
    assert unfinished.reasoning_tokens == 3


def test_thinking_off_means_no_reasoning():
    assert not thinking_requested({"enable_thinking": False}) and not thinking_requested({"thinking": False})
    assert thinking_requested(None) and thinking_requested({"enable_thinking": True})
    split = R1.split("Hmm</think>yes", thinking=False)
    assert (split.reasoning, split.content) == ("", "Hmm</think>yes")


def test_unknown_parser_names_the_known_ones():
    with pytest.raises(ValueError, match="deepseek_r1, qwen3"):
        reasoning_parser("r2")
    from tandem.server.cli import build_parser
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--reasoning-parser", "r2"])
    assert build_parser().parse_args(["--reasoning-parser", "qwen3"]).reasoning_parser == "qwen3"


# ---- the grammar ----
@pytest.mark.parametrize("parser,text,ok", [
    (R1, 'Hmm</think>{"ok": true}', True),
    (R1, '<think>Hmm</think>{"ok": true}', True),
    (R1, '</think>{"ok": true}', True),
    (R1, '{"ok": true}', False),  # deepseek_r1: the reply is inside its reasoning first
    (R1, 'a</think>b</think>{"ok": true}', False),  # the reasoning cannot contain the end tag
    (R1, 'Hmm</think>yes', False),  # after </think>, the constraint holds
    (QWEN3, '{"ok": true}', True),  # qwen3: reasoning only with <think>
    (QWEN3, '<think>Hmm</think>{"ok": true}', True),
    (QWEN3, 'Hmm</think>{"ok": true}', False),
])
def test_the_constraint_starts_after_the_reasoning(parser, text, ok):
    pytest.importorskip("xgrammar")
    from xgrammar.testing import _is_grammar_accept_string as accepts
    schema = json.dumps({"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]})
    assert accepts(parser.constrain("json_schema", schema), text) == ok
    assert accepts(parser.constrain("regex", "(yes|no)"), "Hmm</think>no") == (parser is R1)
    assert accepts(parser.constrain("grammar", 'root ::= "a"+'), "<think>x</think>aa")


# ---- through the server ----
def make_scripted_model(root: Path, tokenizer, replies: dict[int, str], hidden_size: int = 128) -> Path:
    """A one-layer Llama that answers a prompt ending in token t with replies[t] (greedy),
    then EOS: a bigram model (its layers add nothing), the scripts' tokens given orthogonal
    embeddings, every other token following a random one."""
    vocab = len(tokenizer)
    cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=hidden_size, intermediate_size=64,
                                   num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                                   max_position_embeddings=512, bos_token_id=1, eos_token_id=2,
                                   tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).to(torch.float32).eval()
    successor: dict[int, int] = {}
    for start, reply in replies.items():
        chain = [start, *tokenizer.encode(reply, add_special_tokens=False), cfg.eos_token_id]
        for a, b in zip(chain, chain[1:]):
            assert successor.setdefault(a, b) == b, f"token {a} would need two successors"
    scripted = sorted(set(successor) | set(successor.values()))
    others = torch.tensor(sorted(set(range(vocab)) - set(scripted)))
    with torch.no_grad():
        embed = torch.randn(vocab, hidden_size)
        basis, _ = torch.linalg.qr(torch.randn(hidden_size, len(scripted)))
        embed[scripted] = basis.T * hidden_size ** 0.5
        head = torch.zeros(vocab, hidden_size)
        head[others[torch.randperm(len(others))]] = embed[others]
        for a, b in successor.items():
            head[b] += embed[a]
        model.model.embed_tokens.weight.copy_(embed)
        model.lm_head.weight.copy_(head / hidden_size ** 0.5)
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
    path = root / "scripted"
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def thinking_model(builtin_tokenizer, tmp_path_factory):
    root = tmp_path_factory.mktemp("thinking")
    builtin_tokenizer.save_pretrained(root / "tokenizer")
    tokenizer = transformers.AutoTokenizer.from_pretrained(root / "tokenizer")
    tokenizer.chat_template = TEMPLATE

    def last_token(**kwargs) -> int:
        return tokenizer.apply_chat_template(ASK, add_generation_prompt=True, tokenize=True, return_dict=False,
                                             **kwargs)[-1]
    return make_scripted_model(root, tokenizer, {last_token(): THINKING + "</think>" + ANSWER,
                                                 last_token(enable_thinking=False): PLAIN})


@pytest.fixture(scope="module")
def client(thinking_model, tmp_path_factory):
    log = tmp_path_factory.mktemp("server_reasoning") / "server.log"
    with cleanly_exiting_server(thinking_model, log, "--reasoning-parser", "deepseek_r1") as (url, _):
        yield openai_client(url)


def _chat(client, **kw):
    return client.chat.completions.create(model="scripted", messages=ASK, **{"max_tokens": 16, "temperature": 0, **kw})


def test_reasoning_content_and_its_tokens(client):
    done = _chat(client)
    message = done.choices[0].message
    assert (message.reasoning_content, message.content) == (THINKING, ANSWER)
    assert message.model_extra["reasoning"] == THINKING  # vLLM's current name too
    assert done.choices[0].finish_reason == "stop"
    assert done.usage.completion_tokens_details.reasoning_tokens == 5  # H, mm, </, think, >
    assert done.usage.completion_tokens == 7  # and yes, EOS


def test_streamed_reasoning_then_content_tags_never_shown(client):
    deltas, usage = [], None
    for chunk in _chat(client, stream=True, stream_options={"include_usage": True}):
        usage = chunk.usage or usage
        deltas += [c.delta.model_dump(exclude_none=True) for c in chunk.choices]
    reasoning = "".join(d.get("reasoning_content", "") for d in deltas)
    content = "".join(d.get("content") or "" for d in deltas)
    assert (reasoning, content) == (THINKING, ANSWER)
    assert all(d.get("reasoning") == d["reasoning_content"] for d in deltas if "reasoning_content" in d)
    assert not any("<" in d.get("content", "") + d.get("reasoning_content", "") for d in deltas)
    first_content = next(i for i, d in enumerate(deltas) if d.get("content"))
    assert all("reasoning_content" not in d for d in deltas[first_content:])
    assert usage.completion_tokens_details.reasoning_tokens == 5


def test_enable_thinking_false_reaches_the_template(client):
    done = _chat(client, extra_body=NO_THINKING)
    message = done.choices[0].message
    assert (message.reasoning_content, message.content) == (None, PLAIN)
    assert done.usage.completion_tokens_details.reasoning_tokens == 0


@pytest.mark.parametrize("extra,check", [
    ({"structured_outputs": {"regex": "(no|maybe)"}}, lambda t: t in ("no", "maybe")),
    ({"guided_choice": ["yes", "no"]}, lambda t: t in ("yes", "no")),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "ok", "schema": {
        "type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}}}},
     lambda t: isinstance(json.loads(t)["ok"], bool)),
])
def test_a_constraint_applies_after_the_reasoning(client, extra, check):
    """Without the reasoning part in the grammar, the constraint would hold from the first
    token and the model could not think."""
    done = _chat(client, max_tokens=32, extra_body=extra)
    message = done.choices[0].message
    assert message.reasoning_content == THINKING and check(message.content), message
    assert done.choices[0].finish_reason == "stop"


def test_a_constraint_with_thinking_off_holds_from_the_start(client):
    done = _chat(client, extra_body={**NO_THINKING, "structured_outputs": {"regex": "(no|maybe)"}})
    assert done.choices[0].message.content in ("no", "maybe")
    assert done.choices[0].message.reasoning_content is None


def test_tool_calls_after_the_reasoning(client):
    tool = {"type": "function", "function": {"name": "answer", "parameters": {
        "type": "object", "additionalProperties": False, "required": ["ok"], "properties": {"ok": {"type": "boolean"}}}}}
    for stream in (False, True):
        kw = dict(tools=[tool], tool_choice="required", parallel_tool_calls=False, max_tokens=40)
        if not stream:
            message = _chat(client, **kw).choices[0].message
            reasoning, calls = message.reasoning_content, [c.function for c in message.tool_calls]
        else:
            chunks = [c for chunk in _chat(client, stream=True, **kw) for c in chunk.choices]
            reasoning = "".join((c.delta.model_extra or {}).get("reasoning_content") or "" for c in chunks)
            calls = [t.function for c in chunks for t in c.delta.tool_calls or ()]
            assert chunks[-1].finish_reason == "tool_calls"
        assert reasoning == THINKING
        assert [c.name for c in calls] == ["answer"] and isinstance(json.loads(calls[0].arguments)["ok"], bool)


def test_the_responses_api_answers_with_a_reasoning_item(client):
    """/v1/responses on the same server: the thinking is a `reasoning` item before the message
    (whole and streamed), counted in reasoning_tokens; a JSON text format holds after it."""
    kw = dict(model="scripted", input=ASK, max_output_tokens=16, temperature=0)
    done = client.responses.create(**kw)
    reasoning, message = done.output
    assert reasoning.type == "reasoning" and [c.text for c in reasoning.content] == [THINKING]
    assert message.type == "message" and done.output_text == ANSWER and done.status == "completed"
    assert done.usage.output_tokens_details.reasoning_tokens == 5
    events = list(client.responses.create(stream=True, **kw))
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == THINKING
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == ANSWER
    assert events[-1].response.usage.output_tokens_details.reasoning_tokens == 5
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    typed = client.responses.create(**{**kw, "max_output_tokens": 32},
                                    text={"format": {"type": "json_schema", "name": "ok", "schema": schema}})
    assert typed.output[0].content[0].text == THINKING and isinstance(json.loads(typed.output_text)["ok"], bool)
