"""Prompt logprobs on the server, vLLM's way: /v1/completions echo with logprobs (the prompt's
tokens first, null for the first one), max_tokens 0 scoring, and the prompt_logprobs field on
both endpoints; values against a full-sequence forward of the served model."""
import json

import httpx
import pytest
import torch

from test_server import PROMPT, cleanly_exiting_server
from tiny_models import load_hf

ATOL = 2e-4


@pytest.fixture(scope="module")
def served(tiny_text_model, tmp_path_factory):
    log = tmp_path_factory.mktemp("plp_server") / "server.log"
    with cleanly_exiting_server(tiny_text_model, log, "--max-running-requests", "8") as (url, _):
        yield url


@pytest.fixture(scope="module")
def reference(tiny_text_model):
    hf = load_hf(tiny_text_model)

    def logprobs(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)[:-1]
    return logprobs


def _post(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(url + path, json={"model": "llama", **body}, timeout=120)


def _ids(url: str, **body) -> list[int]:
    return _post(url, "/tokenize", body).json()["tokens"]


def _check_prompt_logprobs_field(entries: list, ids: list[int], ref: torch.Tensor, k: int, names) -> None:
    """vLLM's JSON: null, then per token id (a string key) {logprob, rank, decoded_token}."""
    assert len(entries) == len(ids) and entries[0] is None
    for p, entry in enumerate(entries[1:]):
        row, token = ref[p], ids[p + 1]
        actual = entry[str(token)]
        assert actual["logprob"] == pytest.approx(row[token].item(), abs=ATOL)
        assert actual["rank"] == int((row >= row[token]).sum())
        assert actual["decoded_token"] == names(token)
        top = torch.topk(row, k).indices.tolist()
        assert set(entry) == {str(t) for t in top} | {str(token)}
        assert all(entry[str(t)]["rank"] == i + 1 for i, t in enumerate(top) if t != token)


def test_completions_echo_with_logprobs_answers_the_prompt_first(served, reference, builtin_tokenizer):
    ids = _ids(served, prompt=PROMPT)
    ref = reference(ids)
    body = {"prompt": PROMPT, "max_tokens": 3, "temperature": 0, "echo": True, "logprobs": 2}
    out = _post(served, "/v1/completions", body).json()
    choice = out["choices"][0]
    lps, n = choice["logprobs"], len(ids)
    names = lambda t: builtin_tokenizer.decode([t])  # noqa: E731
    assert lps["tokens"][:n] == [names(t) for t in ids] and len(lps["tokens"]) == n + 3
    assert lps["token_logprobs"][0] is None and lps["top_logprobs"][0] is None
    for p in range(1, n):
        assert lps["token_logprobs"][p] == pytest.approx(ref[p - 1, ids[p]].item(), abs=ATOL)
        top = lps["top_logprobs"][p]
        assert names(ids[p]) in top and len(top) <= 3  # the actual token and the top 2
        assert max(top.values()) == pytest.approx(ref[p - 1].max().item(), abs=ATOL)
    assert all(v is not None for v in lps["token_logprobs"][n:])
    offsets = lps["text_offset"]
    assert offsets[0] == 0 and offsets[1:n] == [sum(len(t) for t in lps["tokens"][:p]) for p in range(1, n)]
    plain = _post(served, "/v1/completions", {**body, "echo": False, "logprobs": None}).json()
    assert choice["text"] == PROMPT + plain["choices"][0]["text"]
    assert "".join(lps["tokens"][n:]) == plain["choices"][0]["text"]
    _check_prompt_logprobs_field(choice["prompt_logprobs"], ids, ref, 2, names)


def test_max_tokens_zero_with_echo_scores_the_prompt(served, reference):
    """lm-evaluation-harness's loglikelihood request: the prompt alone, with its logprobs."""
    ids = _ids(served, prompt=PROMPT)
    ref = reference(ids)
    out = _post(served, "/v1/completions", {"prompt": PROMPT, "max_tokens": 0, "echo": True, "logprobs": 1}).json()
    choice = out["choices"][0]
    assert choice["text"] == PROMPT and choice["finish_reason"] == "length"
    assert len(choice["logprobs"]["tokens"]) == len(ids) and out["usage"]["completion_tokens"] == 0
    got = choice["logprobs"]["token_logprobs"]
    assert got[0] is None
    assert got[1:] == pytest.approx([ref[p, ids[p + 1]].item() for p in range(len(ids) - 1)], abs=ATOL)
    no_echo = _post(served, "/v1/completions", {"prompt": PROMPT, "max_tokens": 0})
    assert no_echo.status_code == 400


def test_streamed_echo_sends_the_prompt_logprobs_first(served):
    body = {"prompt": [PROMPT, PROMPT + " more"], "max_tokens": 3, "temperature": 0, "echo": True, "logprobs": 1,
            "n": 2, "seed": 3}
    whole = _post(served, "/v1/completions", body).json()["choices"]
    chunks = []
    with httpx.stream("POST", served + "/v1/completions", json={"model": "llama", "stream": True, **body},
                      timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                chunks.append(json.loads(line[6:])["choices"][0])
    for index in range(4):
        mine = [c for c in chunks if c["index"] == index]
        assert mine[0]["logprobs"]["token_logprobs"][0] is None  # the echo chunk comes first
        tokens = sum((c["logprobs"]["tokens"] for c in mine if c["logprobs"]), [])
        token_lps = sum((c["logprobs"]["token_logprobs"] for c in mine if c["logprobs"]), [])
        assert "".join(c["text"] for c in mine) == whole[index]["text"]
        assert tokens == whole[index]["logprobs"]["tokens"]
        assert token_lps == pytest.approx(whole[index]["logprobs"]["token_logprobs"], abs=ATOL)
    assert whole[0]["prompt_logprobs"] == whole[1]["prompt_logprobs"]  # n = 2: computed once, both answer it
    zero = []
    with httpx.stream("POST", served + "/v1/completions", json={"model": "llama", "stream": True, **body,
                                                                "max_tokens": 0}, timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                zero.append(json.loads(line[6:])["choices"][0])
    for index in range(4):
        mine = [c for c in zero if c["index"] == index]
        assert "".join(c["text"] for c in mine) == body["prompt"][index // 2]
        assert mine[-1]["finish_reason"] == "length"


def test_chat_prompt_logprobs_field(served, reference, builtin_tokenizer):
    messages = [{"role": "user", "content": "Tell me about the sea."}]
    ids = _ids(served, messages=messages)
    out = _post(served, "/v1/chat/completions", {"messages": messages, "max_tokens": 2, "prompt_logprobs": 3}).json()
    names = lambda t: builtin_tokenizer.decode([t])  # noqa: E731
    _check_prompt_logprobs_field(out["prompt_logprobs"], ids, reference(ids), 3, names)
    plain = _post(served, "/v1/chat/completions", {"messages": messages, "max_tokens": 2}).json()
    assert "prompt_logprobs" not in plain


def test_prompt_logprobs_field_on_completions_and_refusals(served, reference, builtin_tokenizer):
    ids = _ids(served, prompt=PROMPT)
    out = _post(served, "/v1/completions", {"prompt": PROMPT, "max_tokens": 1, "prompt_logprobs": 0}).json()
    choice = out["choices"][0]
    assert choice["logprobs"] is None
    _check_prompt_logprobs_field(choice["prompt_logprobs"], ids, reference(ids), 0,
                                 lambda t: builtin_tokenizer.decode([t]))
    for path, body in (("/v1/completions", {"prompt": PROMPT}), ("/v1/chat/completions",
                                                                 {"messages": [{"role": "user", "content": "hi"}]})):
        r = _post(served, path, {**body, "stream": True, "prompt_logprobs": 1})
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_logprobs"
        r = _post(served, path, {**body, "prompt_logprobs": 21})
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_logprobs"
