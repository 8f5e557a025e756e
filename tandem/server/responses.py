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
    prompt_logprobs: list[P.Logprob | None] | None = None  # from the first delta, when asked

    def add(self, d: P.Delta) -> None:
        if d.prompt_logprobs is not None:
            self.prompt_logprobs = d.prompt_logprobs
        self.text.append(d.text)
        if self.reasoning is not None:
            self.reasoning.feed(d.text, d.token_ids, d.finished)
        self.num_tokens += len(d.token_ids)
        if d.logprobs:
            self.logprobs.extend(d.logprobs)
        if d.finished:
            self.finish_reason, self.cached_tokens = d.finish_reason, d.cached_tokens


def share_prompt_logprobs(choices: list[Choice], samples: int) -> None:
    """A prompt's first sequence computed its prompt logprobs (SamplingParams.samples): every
    choice of the prompt answers them."""
    for start in range(0, len(choices), samples):
        for c in choices[start + 1:start + samples]:
            c.prompt_logprobs = choices[start].prompt_logprobs


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


def completion_logprobs(lps: list[P.Logprob], names: TokenNames, offset: int = 0,
                        prompt: "EchoedPrompt | None" = None) -> dict:
    """OpenAI's completions logprobs; with `prompt` (echo), the prompt's tokens come first as
    vLLM answers them: the first with null logprobs, each other with its actual token and the
    top ones, and text offsets running on through the generated tokens."""
    rows = [(lp.token_id, _lp(lp.logprob), {names(t): _lp(v) for t, v in lp.top}) for lp in lps]
    if prompt is not None:
        rows = prompt.rows(names) + rows
    offsets, at = [], offset
    for token_id, _, _ in rows:
        offsets.append(at)
        at += len(names(token_id))
    return {"tokens": [names(t) for t, _, _ in rows], "token_logprobs": [lp for _, lp, _ in rows],
            "top_logprobs": [top for _, _, top in rows], "text_offset": offsets}


@dataclass
class EchoedPrompt:
    """A prompt's tokens and their logprobs (None for the first), as echo answers them."""

    token_ids: list[int]
    logprobs: list[P.Logprob | None]

    def rows(self, names: TokenNames) -> list[tuple[int, float | None, dict | None]]:
        out = []
        for token_id, lp in zip(self.token_ids, self.logprobs):
            if lp is None:
                out.append((token_id, None, None))
                continue
            top = {names(lp.token_id): _lp(lp.logprob)}  # the actual token first, as vLLM's
            top.update((names(t), _lp(v)) for t, v in lp.top if names(t) not in top)
            out.append((token_id, _lp(lp.logprob), top))
        return out


def prompt_logprobs_json(lps: list[P.Logprob | None] | None, names: TokenNames) -> list | None:
    """vLLM's `prompt_logprobs` field: per prompt token null (the first) or token id ->
    {logprob, rank, decoded_token}, the actual token first, then the top ones by rank."""
    if lps is None:
        return None
    out: list[dict | None] = []
    for lp in lps:
        if lp is None:
            out.append(None)
            continue
        entry = {str(lp.token_id): {"logprob": _lp(lp.logprob), "rank": lp.rank, "decoded_token": names(lp.token_id)}}
        for i, (t, v) in enumerate(lp.top):
            entry.setdefault(str(t), {"logprob": _lp(v), "rank": i + 1, "decoded_token": names(t)})
        out.append(entry)
    return out


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
                   prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0,
                   echoed: list[EchoedPrompt] | None = None, with_prompt_logprobs: bool = False) -> dict:
        """`echoed`: per choice, its prompt, whose tokens lead its logprobs (echo)."""
        out = []
        for i, c in enumerate(choices):
            lps = completion_logprobs(c.logprobs, names, prompt=echoed[i] if echoed else None) if with_logprobs else None
            item = {"index": i, "text": "".join(c.text), "finish_reason": c.finish_reason, "logprobs": lps}
            if with_prompt_logprobs:
                item["prompt_logprobs"] = prompt_logprobs_json(c.prompt_logprobs, names)
            out.append(item)
        return {"id": self.id, "object": "text_completion", "created": self.created, "model": self.model,
                "choices": out, "usage": usage(prompt_tokens, completion_tokens, cached_tokens)}

    def chat(self, choices: list[Choice], names: TokenNames, with_logprobs: bool,
             prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0,
             reasoning_tokens: int | None = None, with_prompt_logprobs: bool = False) -> dict:
        out = {"id": self.id, "object": "chat.completion", "created": self.created, "model": self.model,
               "choices": [{"index": i, "message": chat_message(c), "finish_reason": c.finish_reason,
                            "logprobs": chat_logprobs(c.logprobs, names) if with_logprobs else None}
                           for i, c in enumerate(choices)],
               "usage": usage(prompt_tokens, completion_tokens, cached_tokens, reasoning_tokens)}
        if with_prompt_logprobs:  # vLLM's extension: one conversation, so on the response
            out["prompt_logprobs"] = prompt_logprobs_json(choices[0].prompt_logprobs, names)
        return out

    def completion_chunk(self, index: int, d: P.Delta, names: TokenNames, offset: int,
                         echoed: EchoedPrompt | None = None) -> dict:
        lps = completion_logprobs(d.logprobs, names, offset, echoed) if d.logprobs is not None else None
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
