"""The soak's fuzzed request plan: well-formed requests of every shape, and bad inputs.

Well-formed requests mix both endpoints, streamed and not, n > 1, prompt lists, token-id
prompts, stop strings, penalties, logprobs, structured output (regex, EBNF, JSON schema) and
random max_tokens; prompts are built from a
few shared documents cut at random points, so the prefix cache sees hits, partial matches
and splits. Some clients leave: a stream is dropped after a few chunks (disconnect), a
non-streamed request is cancelled after a random delay (abort). Bad inputs must be refused
with a 4xx; each has a name so the report can count refusals per kind.
"""
from __future__ import annotations

import json
import random
from dataclasses import dataclass

_WORDS = ("time river light stone house voice paper green music field window story number garden "
          "market winter bridge letter school forest cloud table summer mountain the a of and to in "
          "is was he she it they you we question answer because never always maybe quickly slowly "
          "über café naïve 東京 😀 ----- ... ,").split()
STOPS = ("e", "the", ".", ",", " a", "\n", "ing", "x y", "😀", "Ġ", "s", " ")


@dataclass
class Case:
    index: int
    kind: str  # "good", or the name of a bad input
    path: str  # "completions" or "chat/completions"; a bad input may name another route
    body: bytes  # what is sent, as is
    stream: bool = False
    leave: str = "complete"  # complete | disconnect (after `after` chunks) | abort (after `after` s)
    after: float = 0.0
    greedy: bool = False
    method: str = "POST"

    @property
    def key(self) -> str:
        """The request without its transport options: equal keys must give equal greedy text."""
        body = json.loads(self.body)
        for k in ("stream", "stream_options"):
            body.pop(k, None)
        return self.path + " " + json.dumps(body, sort_keys=True)

    @property
    def choices(self) -> int:
        """Choices a well-formed request answers with: prompts x n."""
        body = json.loads(self.body)
        return _prompt_count(body) * body.get("n", 1)


class Planner:
    def __init__(self, seed: int, model: str, vocab_size: int, max_model_len: int, max_request_bytes: int):
        self.rng = random.Random(seed)
        self.model, self.vocab, self.max_model_len = model, vocab_size, max_model_len
        self.max_request_bytes = max_request_bytes
        self.docs = [self._words(self.rng.randint(8, 48)) for _ in range(12)]
        self.id_docs = [[self.rng.randrange(3, vocab_size) for _ in range(64)] for _ in range(6)]
        self.systems = [self._words(self.rng.randint(4, 24)) for _ in range(5)]

    def plan(self, n: int, bad_fraction: float, sampled_fraction: float = 0.25) -> list[Case]:
        return [self.bad(i) if self.rng.random() < bad_fraction else self.good(i, sampled_fraction)
                for i in range(n)]

    # -- well-formed ----------------------------------------------------------------------

    def good(self, i: int, sampled_fraction: float) -> Case:
        r = self.rng
        chat = r.random() < 0.4
        body: dict = {"messages": self._messages()} if chat else {"prompt": self._prompt()}
        if r.random() < 0.5:
            body["model"] = self.model
        greedy = r.random() >= sampled_fraction
        max_key = "max_completion_tokens" if chat and r.random() < 0.5 else "max_tokens"
        body[max_key] = r.randint(1, 32)
        if greedy:
            body["temperature"] = 0 if r.random() < 0.5 else 0.0
        else:
            body["temperature"] = round(r.uniform(0.3, 1.5), 2)
            if r.random() < 0.5:
                body["seed"] = r.randrange(2**31)
            if r.random() < 0.1:
                body["top_p"] = round(r.uniform(0.5, 1.0), 2)
            if r.random() < 0.3:
                body["top_k"] = r.randint(1, 50)
        if r.random() < 0.2:
            body["n"] = r.randint(2, 3 if _prompt_count(body) == 1 else 2)
        if r.random() < 0.3:
            body["stop"] = r.choice(STOPS) if r.random() < 0.3 else r.sample(STOPS, r.randint(1, 4))
        if r.random() < 0.3:
            body["ignore_eos"] = True
        if r.random() < 0.05:
            body["presence_penalty"], body["frequency_penalty"] = round(r.uniform(-1, 1), 2), round(r.uniform(-1, 1), 2)
        if r.random() < 0.05:
            if chat:
                body["logprobs"], body["top_logprobs"] = True, r.randint(0, 3)
            else:
                body["logprobs"] = r.randint(0, 3)
        if r.random() < 0.1:
            body.update(self._constraint(chat))
        stream = r.random() < 0.5
        if stream:
            body["stream"] = True
            if r.random() < 0.5:
                body["stream_options"] = {"include_usage": True}
        leave, after = "complete", 0.0
        if stream and r.random() < 0.12:
            leave, after = "disconnect", r.randint(0, 6)
        elif not stream and r.random() < 0.06:
            leave, after = "abort", r.uniform(0.0, 0.4)
        return Case(i, "good", "chat/completions" if chat else "completions", _dump(body), stream, leave,
                    after, greedy)

    def _constraint(self, chat: bool) -> dict:
        """Structured output: a regex or an EBNF grammar (extra fields, both endpoints), or a
        JSON schema through response_format (chat). Greedy answers are compared like any."""
        kind = self.rng.choice(("regex", "ebnf", "json") if chat else ("regex", "ebnf"))
        if kind == "regex":
            return {"regex": self.rng.choice(_REGEXES)}
        if kind == "ebnf":
            return {"ebnf": self.rng.choice(_EBNFS)}
        return {"response_format": {"type": "json_schema", "json_schema": {"name": "item", "schema": _SCHEMA}}}

    def _words(self, n: int) -> str:
        return " ".join(self.rng.choice(_WORDS) for _ in range(n))

    def _text(self) -> str:
        """A shared document cut at a random word, plus a short private tail."""
        words = self.rng.choice(self.docs).split(" ")
        head = " ".join(words[:self.rng.randint(1, len(words))])
        return head + (" " + self._words(self.rng.randint(1, 12)) if self.rng.random() < 0.7 else "")

    def _prompt(self) -> str | list:
        x = self.rng.random()
        if x < 0.7:
            return self._text()
        if x < 0.85:
            ids = self.rng.choice(self.id_docs)
            return ids[:self.rng.randint(1, len(ids))] + [self.rng.randrange(3, self.vocab)
                                                           for _ in range(self.rng.randint(0, 8))]
        return [self._text() for _ in range(self.rng.randint(2, 3))]

    def _messages(self) -> list[dict]:
        msgs = [{"role": "system", "content": self.rng.choice(self.systems)}] if self.rng.random() < 0.6 else []
        for _ in range(self.rng.choice((0, 0, 1, 2))):  # earlier turns
            msgs += [{"role": "user", "content": self._text()}, {"role": "assistant", "content": self._words(6)}]
        return msgs + [{"role": "user", "content": self._text()}]

    # -- bad inputs (each must get a 4xx) -----------------------------------------------------

    def bad(self, i: int) -> Case:
        name = self.rng.choice(sorted(BAD))
        path, body, method = BAD[name](self)
        return Case(i, name, path, body if isinstance(body, bytes) else _dump(body), method=method)


def _prompt_count(body: dict) -> int:
    prompt = body.get("prompt")
    return len(prompt) if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)) else 1


def _dump(body) -> bytes:
    return json.dumps(body).encode()  # ensure_ascii: a lone surrogate travels as a \\ud800 escape


_REGEXES = ("[a-z ]{1,20}", "(yes|no|maybe)", "[0-9]{2,4}-[a-z]{1,3}")
_EBNFS = ('root ::= "(" [0-9]+ ("," [0-9]+)* ")"', 'root ::= ("ab" | "c")+')
_SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "count"],
           "properties": {"name": {"type": "string", "maxLength": 8}, "count": {"type": "integer"}}}

_C, _H = "completions", "chat/completions"
_HI = [{"role": "user", "content": "hi"}]
BAD = {
    "malformed_json": lambda p: (_C, b'{"prompt": "hi",', "POST"),
    "json_array": lambda p: (_C, b"[1, 2]", "POST"),
    "invalid_utf8": lambda p: (_C, b'{"prompt": "\xff\xfe hi"}', "POST"),
    "empty_body": lambda p: (_H, b"", "POST"),
    "temperature_string": lambda p: (_C, {"prompt": "hi", "temperature": "hot"}, "POST"),
    "max_tokens_string": lambda p: (_C, {"prompt": "hi", "max_tokens": "8"}, "POST"),
    "max_tokens_float": lambda p: (_C, {"prompt": "hi", "max_tokens": 8.5}, "POST"),
    "n_bool": lambda p: (_C, {"prompt": "hi", "n": True}, "POST"),
    "prompt_number": lambda p: (_C, {"prompt": 5}, "POST"),
    "prompt_missing": lambda p: (_C, {"max_tokens": 5}, "POST"),
    "prompt_empty": lambda p: (_C, {"prompt": ""}, "POST"),
    "messages_string": lambda p: (_H, {"messages": "hi"}, "POST"),
    "messages_empty": lambda p: (_H, {"messages": []}, "POST"),
    "bad_role": lambda p: (_H, {"messages": [{"role": "wizard", "content": "hi"}]}, "POST"),
    "surrogate_prompt": lambda p: (_C, {"prompt": "abc\ud800def"}, "POST"),
    "surrogate_prompt_list": lambda p: (_C, {"prompt": ["ok", "\udfff"]}, "POST"),
    "surrogate_stop": lambda p: (_C, {"prompt": "hi", "stop": ["\udc00"]}, "POST"),
    "surrogate_message": lambda p: (_H, {"messages": [{"role": "user", "content": "a\ud800"}]}, "POST"),
    "stop_list_oversize": lambda p: (_C, {"prompt": "hi", "stop": ["ab"] * 5000}, "POST"),
    "stop_string_oversize": lambda p: (_C, {"prompt": "hi", "stop": ["x" * 2000]}, "POST"),
    "stop_empty_string": lambda p: (_C, {"prompt": "hi", "stop": [""]}, "POST"),
    "unknown_model": lambda p: (_C, {"prompt": "hi", "model": "gpt-9"}, "POST"),
    "unknown_model_chat": lambda p: (_H, {"messages": _HI, "model": "no-such-model"}, "POST"),
    "max_tokens_over_context": lambda p: (_C, {"prompt": "hi", "max_tokens": p.max_model_len + 1}, "POST"),
    "max_tokens_zero": lambda p: (_C, {"prompt": "hi", "max_tokens": 0}, "POST"),
    "prompt_over_context": lambda p: (_C, {"prompt": [5] * (p.max_model_len + 8)}, "POST"),
    "token_id_out_of_range": lambda p: (_C, {"prompt": [5, p.vocab + 10]}, "POST"),
    "token_id_negative": lambda p: (_C, {"prompt": [5, -1]}, "POST"),
    "temperature_negative": lambda p: (_C, {"prompt": "hi", "temperature": -1}, "POST"),
    "top_p_zero": lambda p: (_C, {"prompt": "hi", "top_p": 0}, "POST"),
    "top_k_huge": lambda p: (_C, {"prompt": "hi", "top_k": 2**70}, "POST"),
    "seed_huge": lambda p: (_C, {"prompt": "hi", "seed": 2**70}, "POST"),
    "n_zero": lambda p: (_C, {"prompt": "hi", "n": 0}, "POST"),
    "too_many_choices": lambda p: (_C, {"prompt": ["hi"] * 100, "n": 4}, "POST"),
    "logprobs_too_many": lambda p: (_C, {"prompt": "hi", "logprobs": 50}, "POST"),
    "logit_bias_range": lambda p: (_C, {"prompt": "hi", "logit_bias": {"5": 500}}, "POST"),
    "best_of_streamed": lambda p: (_C, {"prompt": "hi", "best_of": 3, "stream": True}, "POST"),
    "min_tokens_over_max": lambda p: (_C, {"prompt": "hi", "min_tokens": 30, "max_tokens": 5}, "POST"),
    "image_content": lambda p: (_H, {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "x"}}]}]}, "POST"),
    "body_oversize": lambda p: (_C, {"prompt": "x" * (p.max_request_bytes + 16)}, "POST"),
    "unknown_route": lambda p: ("nowhere", {"prompt": "hi"}, "POST"),
    "wrong_method": lambda p: (_C, b"", "GET"),
    # Constraints that leave no token once the grammar is complete: min_tokens bans the end of
    # sequence, the only token left. A 400 for that request; every other stream goes on.
    "no_token_regex_min_tokens": lambda p: (_C, {"prompt": "Answer:", "regex": "(yes|no)", "min_tokens": 8,
                                                 "max_tokens": 16}, "POST"),
    "no_token_ebnf_min_tokens": lambda p: (_C, {"prompt": "hi", "ebnf": 'root ::= "ok"', "min_tokens": 6,
                                                "max_tokens": 16, "temperature": 0.9}, "POST"),
    "no_token_chat_regex": lambda p: (_H, {"messages": _HI, "regex": "[ab]", "min_tokens": 4,
                                           "max_tokens": 16}, "POST"),
    # Hostile and careless clients (issue 18): each once answered 500 or stalled the others.
    "surrogate_bad_words": lambda p: (_C, {"prompt": "hi", "bad_words": ["\ud800"]}, "POST"),
    "surrogate_tool_name": lambda p: (_H, {"messages": _HI, "tools": [_tool("f\ud800")],
                                           "tool_choice": {"type": "function", "function": {"name": "f\ud800"}}},
                                      "POST"),
    "schema_too_deep": lambda p: (_H, {"messages": _HI, "response_format": {
        "type": "json_schema", "json_schema": {"name": "deep", "schema": _nested_schema(400)}}}, "POST"),
    "json_body_too_deep": lambda p: (_C, b'{"prompt": ' + b"[" * 50_000 + b"]" * 50_000 + b"}", "POST"),
    "logit_bias_oversize": lambda p: (_C, {"prompt": "hi", "logit_bias": {str(i): 1 for i in range(p.vocab + 64)}},
                                      "POST"),
    "messages_too_many": lambda p: (_H, {"messages": [{"role": "user", "content": "a"}] * 9000}, "POST"),
}


def _tool(name: str) -> dict:
    return {"type": "function", "function": {"name": name, "parameters": {"type": "object"}}}


def _nested_schema(depth: int) -> dict:
    """An object schema nested `depth` levels (a few hundred once took seconds to compile)."""
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema
