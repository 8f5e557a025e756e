"""Response bodies and stream chunks in OpenAI's shapes, built from engine deltas."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from tandem.server import protocol as P
from tandem.server.reasoning import ReasoningSplitter
from tandem.text import TokenNames

_MIN_LOGPROB = -9999.0  # JSON has no -inf


@dataclass
class Choice:
    """A choice's accumulated result (non-streaming)."""

    text: list[str] = field(default_factory=list)
    num_tokens: int = 0
    logprobs: list[P.Logprob] = field(default_factory=list)
    finish_reason: str | None = None
    cached_tokens: int = 0
    reasoning: ReasoningSplitter | None = None  # the reply split into reasoning and content

    def add(self, d: P.Delta) -> None:
        self.text.append(d.text)
        if self.reasoning is not None:
            self.reasoning.feed(d.text, d.token_ids, d.finished)
        self.num_tokens += len(d.token_ids)
        if d.logprobs:
            self.logprobs.extend(d.logprobs)
        if d.finished:
            self.finish_reason, self.cached_tokens = d.finish_reason, d.cached_tokens


def best_choices(choices: list[Choice], samples: int, n: int) -> list[Choice]:
    """Per prompt (`samples` consecutive choices), the n with the highest cumulative logprob."""
    if samples == n:
        return choices
    best = []
    for start in range(0, len(choices), samples):
        group = choices[start:start + samples]
        best += sorted(group, key=lambda c: sum(lp.logprob for lp in c.logprobs), reverse=True)[:n]
    return best


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0,
          reasoning_tokens: int | None = None) -> dict:
    """OpenAI's usage object; `completion_tokens_details` where a reasoning parser runs."""
    out = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
           "total_tokens": prompt_tokens + completion_tokens,
           "prompt_tokens_details": {"cached_tokens": cached_tokens}}
    if reasoning_tokens is not None:
        out["completion_tokens_details"] = {"reasoning_tokens": reasoning_tokens}
    return out


def chat_message(c: Choice) -> dict:
    """A choice's assistant message: its text as content, or, where a reasoning parser runs,
    its content (None if empty, as vLLM's) and its reasoning as `reasoning_content` and
    `reasoning` (vLLM's names, the older and the current one)."""
    if c.reasoning is None:
        return {"role": "assistant", "content": "".join(c.text)}
    return with_reasoning({"role": "assistant", "content": c.reasoning.content or None}, c.reasoning.reasoning)


def with_reasoning(message: dict, reasoning: str) -> dict:
    """A message or stream delta with its reasoning text under both of vLLM's names."""
    message["reasoning_content"] = message["reasoning"] = reasoning or None
    return message


def _lp(x: float) -> float:
    return max(x, _MIN_LOGPROB)


def completion_logprobs(lps: list[P.Logprob], names: TokenNames, offset: int = 0) -> dict:
    tokens = [names(lp.token_id) for lp in lps]
    offsets, at = [], offset
    for t in tokens:
        offsets.append(at)
        at += len(t)
    return {"tokens": tokens, "token_logprobs": [_lp(lp.logprob) for lp in lps],
            "top_logprobs": [{names(t): _lp(v) for t, v in lp.top} for lp in lps],
            "text_offset": offsets}


def chat_logprobs(lps: list[P.Logprob], names: TokenNames) -> dict:
    def entry(token_id: int, logprob: float) -> dict:
        name = names(token_id)
        return {"token": name, "logprob": _lp(logprob), "bytes": list(name.encode())}
    return {"content": [{**entry(lp.token_id, lp.logprob),
                         "top_logprobs": [entry(t, v) for t, v in lp.top]} for lp in lps]}


@dataclass
class Envelope:
    """The fields every response and chunk of one request share."""

    id: str
    model: str
    created: int = field(default_factory=lambda: int(time.time()))

    def completion(self, choices: list[Choice], names: TokenNames, with_logprobs: bool,
                   prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
        return {"id": self.id, "object": "text_completion", "created": self.created, "model": self.model,
                "choices": [{"index": i, "text": "".join(c.text), "finish_reason": c.finish_reason,
                             "logprobs": completion_logprobs(c.logprobs, names) if with_logprobs else None}
                            for i, c in enumerate(choices)],
                "usage": usage(prompt_tokens, completion_tokens, cached_tokens)}

    def chat(self, choices: list[Choice], names: TokenNames, with_logprobs: bool,
             prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0,
             reasoning_tokens: int | None = None) -> dict:
        return {"id": self.id, "object": "chat.completion", "created": self.created, "model": self.model,
                "choices": [{"index": i, "message": chat_message(c), "finish_reason": c.finish_reason,
                             "logprobs": chat_logprobs(c.logprobs, names) if with_logprobs else None}
                            for i, c in enumerate(choices)],
                "usage": usage(prompt_tokens, completion_tokens, cached_tokens, reasoning_tokens)}

    def completion_chunk(self, index: int, d: P.Delta, names: TokenNames, offset: int) -> dict:
        lps = completion_logprobs(d.logprobs, names, offset) if d.logprobs is not None else None
        return {"id": self.id, "object": "text_completion", "created": self.created, "model": self.model,
                "choices": [{"index": index, "text": d.text, "logprobs": lps,
                             "finish_reason": d.finish_reason if d.finished else None}]}

    def chat_chunk(self, index: int, delta: dict, finish_reason: str | None = None,
                   logprobs: dict | None = None) -> dict:
        return {"id": self.id, "object": "chat.completion.chunk", "created": self.created,
                "model": self.model,
                "choices": [{"index": index, "delta": delta, "logprobs": logprobs,
                             "finish_reason": finish_reason}]}

    def usage_chunk(self, kind: str, prompt_tokens: int, completion_tokens: int,
                    cached_tokens: int = 0, reasoning_tokens: int | None = None) -> dict:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model,
                "choices": [], "usage": usage(prompt_tokens, completion_tokens, cached_tokens, reasoning_tokens)}
