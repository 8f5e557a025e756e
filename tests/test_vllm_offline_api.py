"""vLLM's offline shapes (issue 24, item 5): dict prompts and lists of them, logprobs as
`list[dict[int, Logprob]]`, `LLM.chat` with tools / chat_template_kwargs /
continue_final_message, `get_tokenizer()`, and vLLM's constructor names mapped onto
EngineConfig (`tandem.options.llm_config`) or refused with the reason."""
import dataclasses

import pytest

from tandem import LLM, SamplingParams
from tandem.config import EngineConfig
from tandem.options import VLLM_NAMES, VLLM_WITHOUT_COUNTERPART, llm_config
from tandem.outputs import Logprob
from tiny_models import TEST_DEVICE


@pytest.fixture(scope="module")
def llm(tiny_text_model):
    return LLM(str(tiny_text_model), device=TEST_DEVICE, dtype="float32", max_model_len=256)


def _greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, **kw)


# ---- constructor names ----

def test_vllm_names_become_engine_config_fields():
    cfg = llm_config("m", dict(max_num_seqs=7, enforce_eager=True, enable_chunked_prefill=False,
                               load_format="dummy", trust_remote_code=False, tokenizer="t", dtype="float32"))
    assert (cfg.max_running_requests, cfg.cuda_graph, cfg.chunked_prefill_size, cfg.dummy_weights) == \
        (7, "off", None, True)
    assert cfg.dtype == "float32" and cfg.model == "m" and cfg.tokenizer == "t"  # tandem's own field
    # Their defaults (and vLLM's for options tandem lacks) change nothing.
    defaults = {name: default for name, (default, _) in VLLM_WITHOUT_COUNTERPART.items()}
    assert llm_config(None, dict(enforce_eager=False, enable_chunked_prefill=True, load_format="auto",
                                 runner="generate", **defaults)) == EngineConfig()


def test_the_name_tables_point_at_real_fields():
    fields = {f.name for f in dataclasses.fields(EngineConfig)}
    assert not (VLLM_NAMES.keys() | VLLM_WITHOUT_COUNTERPART.keys()) & fields  # tandem's own names win
    assert not VLLM_NAMES.keys() & VLLM_WITHOUT_COUNTERPART.keys()
    set_fields = {k for name in ("max_num_seqs", "enforce_eager", "enable_chunked_prefill")
                  for k in VLLM_NAMES[name](False if name != "max_num_seqs" else 3, None)}
    assert set_fields <= fields and set_fields == {"max_running_requests", "chunked_prefill_size"}


@pytest.mark.parametrize("given,error,message", [
    (dict(trust_remote_code=True), ValueError, "runs no code from model repositories"),
    (dict(max_num_batched_tokens=2048), ValueError, "nearest option is max_prefill_tokens"),
    (dict(swap_space=8), ValueError, r"swap_space=8\): tandem keeps no KV swap space"),
    (dict(load_format="pt"), ValueError, "load_format may be 'auto' or 'dummy'"),
    (dict(task="embed"), ValueError, "generative models only"),
    (dict(max_num_seqs=4, max_running_requests=8), TypeError, "set the same option"),
    (dict(max_num_seq=4), TypeError, "unknown option 'max_num_seq'; did you mean 'max_num_seqs'"),
])
def test_vllm_names_without_the_meaning_are_refused_before_loading(tmp_path, given, error, message):
    with pytest.raises(error, match=message):
        LLM(str(tmp_path / "no-such-model"), **given)  # refused, not FileNotFoundError: nothing loaded


def test_llm_takes_vllm_names(tiny_text_model):
    with LLM(str(tiny_text_model), device=TEST_DEVICE, max_num_seqs=3, enforce_eager=True,
             tokenizer=str(tiny_text_model), trust_remote_code=False) as llm:
        assert (llm.engine.cfg.max_running_requests, llm.engine.cfg.cuda_graph) == (3, "off")
        outs = llm.generate([[5, 6, 7 + i] for i in range(5)], _greedy(2), use_tqdm=False)
        assert [len(o.token_ids) for o in outs] == [2] * 5  # 5 requests through 3 running slots


# ---- prompts ----

def test_dict_prompts_are_their_text_or_ids(llm):
    tok = llm.get_tokenizer()
    assert tok is llm.engine.tokenizer and tok.decode(tok.encode("Hello")) == "Hello"
    text = llm.generate("Hello", _greedy(3), use_tqdm=False)[0]
    as_dict = llm.generate({"prompt": "Hello"}, _greedy(3), use_tqdm=False)[0]
    assert as_dict.prompt == "Hello" and as_dict.prompt_token_ids == tok.encode("Hello")  # not "prompt"
    assert as_dict.token_ids == text.token_ids
    ids = llm.generate({"prompt_token_ids": [5, 6, 7]}, _greedy(3), use_tqdm=False)[0]
    assert ids.prompt_token_ids == [5, 6, 7] and ids.token_ids == llm.generate([[5, 6, 7]], _greedy(3),
                                                                                 use_tqdm=False)[0].token_ids


def test_a_list_mixes_prompt_shapes_in_order(llm):
    outs = llm.generate([{"prompt_token_ids": [9, 10]}, "Hi", {"prompt": "Hey"}, [11, 12],
                         {"prompt": "shown", "prompt_token_ids": [13, 14]}], _greedy(2), use_tqdm=False)
    assert [o.prompt_token_ids[-2:] for o in outs if o.prompt is None] == [[9, 10], [11, 12]]
    assert [o.prompt for o in outs] == [None, "Hi", "Hey", None, "shown"]
    assert outs[4].prompt_token_ids == [13, 14]  # vLLM's order: the ids win over the text


@pytest.mark.parametrize("prompt,message", [
    ({"prompt": "look", "multi_modal_data": {"image": object()}}, "'multi_modal_data': this model accepts text only"),
    ({"prompt_embeds": [[0.0]]}, "not embeddings"),
    ({"text": "Hello"}, r"unknown prompt keys \['text'\]"),
    ({}, "needs 'prompt'"),
    ({"prompt_token_ids": "5 6"}, "must be a list of ints"),
])
def test_dict_prompts_that_cannot_run_are_refused(llm, prompt, message):
    with pytest.raises((ValueError, TypeError), match=message):
        llm.generate([prompt], _greedy(1), use_tqdm=False)


# ---- logprobs ----

def test_logprobs_are_vllms_dicts(llm):
    out = llm.generate([[5, 6, 7]], _greedy(4, logprobs=3), use_tqdm=False)[0].outputs[0]
    tok = llm.get_tokenizer()
    assert len(out.logprobs) == 4
    for chosen, position in zip(out.token_ids, out.logprobs):
        assert isinstance(position, dict) and next(iter(position)) == chosen  # the sampled token first
        assert [lp.rank for lp in position.values()] == [1, 2, 3]  # greedy: it is the likeliest
        values = [lp.logprob for lp in position.values()]
        assert values == sorted(values, reverse=True) and all(v <= 0 for v in values)
        assert all(isinstance(lp, Logprob) and lp.decoded_token == tok.decode([t]) for t, lp in position.items())
    assert out.cumulative_logprob == pytest.approx(sum(p[t].logprob for t, p in zip(out.token_ids, out.logprobs)))


def test_a_sampled_token_outside_the_top_comes_first_unranked(llm):
    """Random weights over a 49k vocabulary: a sample at temperature 1 is almost never top-2."""
    sp = SamplingParams(max_tokens=12, temperature=1.0, seed=3, logprobs=2, ignore_eos=True)
    out = llm.generate([[5, 6, 7]], sp, use_tqdm=False)[0].outputs[0]
    outside = [p for t, p in zip(out.token_ids, out.logprobs) if p[t].rank is None]
    assert outside, "every sample was among the top 2"
    for position in outside:
        assert len(position) == 3 and [lp.rank for lp in position.values()] == [None, 1, 2]
    zero = llm.generate([[5, 6, 7]], sp.clone(logprobs=0), use_tqdm=False)[0].outputs[0]
    assert [list(p) for p in zero.logprobs] == [[t] for t in zero.token_ids]  # the sampled token alone


# ---- chat ----

_TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "weather in a city",
                                            "parameters": {"type": "object", "properties": {}}}}]
_TEMPLATE = ("{% for t in tools or [] %}[tool {{ t.function.name }}]{% endfor %}"
             "{% for m in messages %}<{{ m.role }}>{{ m.content }}</{{ m.role }}>{% endfor %}"
             "{% if add_generation_prompt %}<assistant>{% endif %}{{ style | default('') }}")


def _chat_prompt(llm, messages, **kw) -> str:
    out = llm.chat(messages, _greedy(1), use_tqdm=False, **kw)[0]
    return llm.get_tokenizer().decode(out.prompt_token_ids)


def test_chat_passes_tools_and_template_kwargs_to_the_template(llm):
    user = [{"role": "user", "content": "Weather?"}]
    text = _chat_prompt(llm, user, chat_template=_TEMPLATE, tools=_TOOLS, chat_template_kwargs={"style": "terse"})
    assert text == "[tool get_weather]<user>Weather?</user><assistant>terse"
    assert _chat_prompt(llm, user, chat_template=_TEMPLATE, add_generation_prompt=False) == "<user>Weather?</user>"
    parts = [{"role": "user", "content": [{"type": "text", "text": "Weather"}, {"type": "text", "text": "?"}]}]
    assert _chat_prompt(llm, parts, chat_template=_TEMPLATE) == "<user>Weather?</user><assistant>"


def test_continue_final_message_extends_the_last_reply(llm):
    """The model's own template: the prompt ends inside the assistant's message, not after it."""
    messages = [{"role": "user", "content": "Count to three."}, {"role": "assistant", "content": "One, two,"}]
    continued = _chat_prompt(llm, messages, add_generation_prompt=False, continue_final_message=True)
    assert continued.endswith("One, two,")
    closed = _chat_prompt(llm, messages, add_generation_prompt=False)
    assert closed.startswith(continued) and len(closed) > len(continued)


@pytest.mark.parametrize("kw,message", [
    (dict(continue_final_message=True), "needs add_generation_prompt set to false"),
    (dict(chat_template_kwargs={"tools": []}), r"may not set \['tools'\]"),
])
def test_chat_option_conflicts_are_refused(llm, kw, message):
    with pytest.raises(ValueError, match=message):
        llm.chat([{"role": "user", "content": "hi"}], _greedy(1), use_tqdm=False, **kw)


def test_chat_refuses_non_text_content(llm):
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
    with pytest.raises(ValueError, match="accepts text only"):
        llm.chat(image, _greedy(1), use_tqdm=False)


def test_a_tokenizer_directory_replaces_the_checkpoints(tiny_text_model, tmp_path, builtin_tokenizer):
    """`tokenizer=DIR` (the engine option, vLLM's name too): a model directory without a
    tokenizer reads text through it; a directory without tokenizer files is refused."""
    import shutil
    bare = tmp_path / "bare"
    shutil.copytree(tiny_text_model, bare, ignore=shutil.ignore_patterns("tokenizer*", "special_tokens*", "vocab*",
                                                                          "merges*", "chat_template*"))
    words = tmp_path / "tok"
    builtin_tokenizer.save_pretrained(words)
    with LLM(str(bare), tokenizer=str(words), dtype="float32", device="cpu") as llm:
        out = llm.generate("Hello there", _greedy(4), use_tqdm=False)[0]
        assert out.prompt_token_ids == builtin_tokenizer.encode("Hello there") and len(out.token_ids) == 4
    with pytest.raises(FileNotFoundError, match="not a directory with tokenizer files"):
        LLM(str(bare), tokenizer=str(tmp_path / "nothing"), dtype="float32", device="cpu")
