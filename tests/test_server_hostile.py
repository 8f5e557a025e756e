"""Hostile and careless clients (issue 18): every bad input is a 4xx naming its field, and no
request stalls the other streams (a canary stream beside each case, its longest wait between
tokens bounded). One server on the tiny model with the default 16 MiB body limit."""
import json
import threading
import time

import httpx
import pytest

from test_server import CONTEXT, running_server

MESSAGES = [{"role": "user", "content": "hi"}]


def _tool(name: str, parameters: dict) -> dict:
    return {"type": "function", "function": {"name": name, "parameters": parameters}}


@pytest.fixture(scope="module")
def served(tiny_text_model, tmp_path_factory):
    log = tmp_path_factory.mktemp("server_hostile") / "server.log"
    with running_server(tiny_text_model, log, "--max-running-requests", "16") as (url, proc):
        yield url, log
    assert proc.returncode == 0, log.read_text()


@pytest.fixture(scope="module")
def server(served):
    return served[0]


def _post(url: str, body, timeout: float = 60) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(url, content=content, headers={"content-type": "application/json"}, timeout=timeout)


FORMER_500S = [
    # (path, body, param, words the message must contain): each answered 500 with a traceback
    ("/v1/completions", {"prompt": "hi", "bad_words": ["a\ud800"]}, "bad_words", ["surrogate"]),
    ("/tokenize", {"prompt": "a\ud800"}, "prompt", ["surrogate"]),
    ("/v1/chat/completions", {"messages": MESSAGES, "tools": [_tool("f\ud800", {"type": "object"})],
                              "tool_choice": {"type": "function", "function": {"name": "f\ud800"}}},
     "tools", ["surrogate"]),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi", "name": "a\udc00"}]},
     "messages", ["surrogate"]),
]


@pytest.mark.parametrize("path,body,param,words", FORMER_500S, ids=[f"{i}-{c[2]}" for i, c in enumerate(FORMER_500S)])
def test_former_500s_are_400s_naming_the_field(server, path, body, param, words):
    r = _post(server + path, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and all(w in err["message"] for w in words), err


def test_a_streamed_bad_tool_name_is_a_400_not_a_cut_connection(server):
    body = {**FORMER_500S[2][1], "stream": True}
    r = _post(server + "/v1/chat/completions", body)
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools", r.text


def test_response_format_on_completions_constrains_the_output(server):
    pytest.importorskip("xgrammar")
    r = _post(server + "/v1/completions", {"prompt": "hi", "max_tokens": 40, "temperature": 0,
                                           "response_format": {"type": "json_object"}})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"].startswith("{")
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}
    r = _post(server + "/v1/completions", {"prompt": "hi", "response_format": bad})
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_format", r.text


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "f"}}])
def test_tool_schema_errors_name_tools_without_native_paths(server, choice):
    pytest.importorskip("xgrammar")
    for parameters in ({"type": "nonsense"}, {"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}):
        r = _post(server + "/v1/chat/completions", {"messages": MESSAGES, "tools": [_tool("f", parameters)],
                                                    "tool_choice": choice})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == "tools" and "response_format" not in err["message"], err
        assert ".cc:" not in err["message"] and "/project/" not in err["message"], err


@pytest.mark.parametrize("raw,at", [(b'{"prompt": "\xff\xfe"}', 12), (b'\xff{"prompt": "hi"}', 0)])
def test_invalid_utf8_says_so(server, raw, at):
    r = _post(server + "/v1/completions", raw)
    assert r.status_code == 400, r.text
    assert "not valid UTF-8" in r.json()["error"]["message"] and f"byte {at}" in r.json()["error"]["message"]


def test_repeated_bad_requests_log_no_traceback(served):
    url, log = served
    for _ in range(20):
        for path, body, _, _ in FORMER_500S:
            assert _post(url + path, body).status_code == 400
    assert "Traceback" not in log.read_text()
