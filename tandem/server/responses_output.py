"""Responses output: items (`reasoning`, `message`, `function_call`), the response object,
and the stream events that build them, from the chat view of the model's text.

The chat machinery already splits a reply into reasoning and the rest (`--reasoning-parser`)
and turns the rest into chat deltas: `{"content": ...}`, and (through `ToolCalls`)
`{"tool_calls": [...]}` with a call's header first and, for a named function, its arguments
piece by piece. `OutputItems` turns those into output items and the events that open, grow
and close them; `ResponseOutput` feeds it engine deltas. A streamed response and a whole one
are built by the same code (the whole one ignores the events).
"""
from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from tandem.server import protocol as P
from tandem.server.reasoning import ReasoningSplitter, Split
from tandem.server.structured import ToolCalls

_ASSISTANT = "assistant"


def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def chat_deltas(calls: ToolCalls | None, text: str, finished: bool,
                finish_reason: str | None) -> list[dict]:
    """One engine delta as chat deltas: plain content without tools, else ToolCalls' view."""
    if calls is None:
        return [{"content": text}] if text else []
    deltas, _ = calls.stream(text, finished, finish_reason)
    return deltas


class OutputItems:
    """A response's output items, grown from chat deltas; each method returns the stream
    events (without sequence numbers) that tell a client the same change."""

    def __init__(self) -> None:
        self.items: list[dict] = []
        self._open: dict | None = None  # the item still growing (one at a time, as a model writes them)
        self._text: list[str] = []  # the open message's (or reasoning's) text so far
        self._piecewise = False  # the open call's arguments come piece by piece (so may be cut short)

    def add(self, delta: dict) -> list[dict]:
        events = self._add_text("message", delta["content"]) if delta.get("content") else []
        for call in delta.get("tool_calls", ()):
            if "id" in call:  # a call's header: a new item
                events += self._start_call(call)
            else:  # a named function's arguments, piece by piece
                self._piecewise = True
                events += self._add_arguments(call["function"].get("arguments", ""))
        return events

    def add_reasoning(self, text: str) -> list[dict]:
        return self._add_text("reasoning", text) if text else []

    def close(self, complete: bool) -> list[dict]:
        """Close the open item; an answer with no message or call gets an empty message, as
        OpenAI's has. `complete` is False when the output was cut (max_output_tokens)."""
        events = self._close_open(complete)
        if all(item["type"] == "reasoning" for item in self.items):
            events += self._start("message") + self._close_open(complete)
        return events

    # ---- messages and reasoning: text ----
    def _start(self, kind: str) -> list[dict]:
        if kind == "message":
            item = {"id": _item_id("msg"), "type": "message", "status": "in_progress", "role": _ASSISTANT,
                    "content": []}
        else:
            item = {"id": _item_id("rs"), "type": "reasoning", "status": "in_progress", "summary": [],
                    "content": []}
        events = self._open_item(item)
        if kind == "message":  # reasoning text has no content-part events (the SDK adds none)
            events.append({"type": "response.content_part.added", "item_id": item["id"],
                           "output_index": self._index, "content_index": 0, "part": _text_part("")})
        self._text = []
        return events

    def _add_text(self, kind: str, text: str) -> list[dict]:
        events = [] if self._open is not None and self._open["type"] == kind else \
            self._close_open(True) + self._start(kind)
        self._text.append(text)
        event = "response.output_text.delta" if kind == "message" else "response.reasoning_text.delta"
        events.append({"type": event, "item_id": self._open["id"], "output_index": self._index,
                       "content_index": 0, "delta": text, **({"logprobs": []} if kind == "message" else {})})
        return events

    # ---- function calls ----
    def _start_call(self, call: dict) -> list[dict]:
        fn = call["function"]
        item = {"id": _item_id("fc"), "type": "function_call", "status": "in_progress", "call_id": call["id"],
                "name": fn["name"], "arguments": ""}
        events = self._close_open(True) + self._open_item(item)
        self._piecewise = False
        return events + self._add_arguments(fn.get("arguments") or "")

    def _add_arguments(self, piece: str) -> list[dict]:
        if not piece:
            return []
        self._open["arguments"] += piece
        return [{"type": "response.function_call_arguments.delta", "item_id": self._open["id"],
                 "output_index": self._index, "delta": piece}]

    # ---- either ----
    @property
    def _index(self) -> int:
        return len(self.items) - 1

    def _open_item(self, item: dict) -> list[dict]:
        self.items.append(item)
        self._open = item
        return [{"type": "response.output_item.added", "output_index": self._index, "item": dict(item)}]

    def _close_open(self, complete: bool) -> list[dict]:
        item, self._open = self._open, None
        if item is None:
            return []
        whole_call = item["type"] == "function_call" and not self._piecewise  # ToolCalls sent it complete
        item["status"] = "completed" if complete or whole_call else "incomplete"
        at = {"item_id": item["id"], "output_index": self._index}
        if item["type"] == "function_call":
            events = [{"type": "response.function_call_arguments.done", **at, "name": item["name"],
                       "arguments": item["arguments"]}]
        elif item["type"] == "reasoning":
            text = "".join(self._text)
            item["content"] = [{"type": "reasoning_text", "text": text}]
            events = [{"type": "response.reasoning_text.done", **at, "content_index": 0, "text": text}]
        else:
            text = "".join(self._text)
            item["content"] = [_text_part(text)]
            events = [{"type": "response.output_text.done", **at, "content_index": 0, "text": text, "logprobs": []},
                      {"type": "response.content_part.done", **at, "content_index": 0, "part": _text_part(text)}]
        return events + [{"type": "response.output_item.done", "output_index": self._index, "item": item}]


def _text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def as_chat_messages(items: list[dict]) -> list[dict]:
    """Output items as the chat messages a later turn's template sees (previous_response_id)."""
    def texts(kind: str) -> str:
        return "".join(p["text"] for item in items if item["type"] == kind for p in item["content"])
    text, reasoning = texts("message"), texts("reasoning")
    calls = [{"id": i["call_id"], "type": "function", "function": {"name": i["name"], "arguments": i["arguments"]}}
             for i in items if i["type"] == "function_call"]
    message: dict[str, Any] = {"role": _ASSISTANT, "content": text if text or not calls else None}
    if calls:
        message["tool_calls"] = calls
    if reasoning:  # templates that show earlier thinking read it here (vLLM's field)
        message["reasoning_content"] = reasoning
    return [message]


def usage(input_tokens: int, output_tokens: int, cached_tokens: int, reasoning_tokens: int = 0) -> dict:
    return {"input_tokens": input_tokens, "input_tokens_details": {"cached_tokens": cached_tokens},
            "output_tokens": output_tokens, "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
            "total_tokens": input_tokens + output_tokens}


@dataclass
class ResponseHead:
    """The fields of one response object that do not change while it is generated."""

    id: str
    model: str
    echo: dict  # request fields the response repeats (instructions, tools, text, ...)
    created_at: int = field(default_factory=lambda: int(time.time()))

    def body(self, status: str, output: list[dict], usage: dict | None = None,
             incomplete_reason: str | None = None, error: dict | None = None) -> dict:
        return {"id": self.id, "object": "response", "created_at": self.created_at, "status": status,
                "background": False, "error": error,
                "incomplete_details": {"reason": incomplete_reason} if incomplete_reason else None,
                "model": self.model, "output": output, "usage": usage, **self.echo}


def finish_status(finish_reason: str | None) -> tuple[str, str | None]:
    """(status, incomplete reason) of a response whose generation ended for `finish_reason`."""
    if finish_reason == "length":  # max_output_tokens, or the context's end: OpenAI says the former for both
        return "incomplete", "max_output_tokens"
    return "completed", None


class ResponseOutput:
    """One response's output as its engine deltas arrive: the reasoning split off (where the
    server runs a reasoning parser), the rest as text or tool calls; the token counts."""

    def __init__(self, prompt_tokens: int, calls: ToolCalls | None, splitter: ReasoningSplitter | None):
        self.items, self._calls, self._splitter = OutputItems(), calls, splitter
        self.prompt_tokens, self.output_tokens, self.cached_tokens = prompt_tokens, 0, 0
        self.finish_reason: str | None = None

    def feed(self, d: P.Delta) -> list[dict]:
        """The stream events of one engine delta."""
        self.output_tokens += len(d.token_ids)
        if d.finished:
            self.finish_reason, self.cached_tokens = d.finish_reason, d.cached_tokens
        part = self._splitter.feed(d.text, d.token_ids, d.finished) if self._splitter else Split(content=d.text)
        events = self.items.add_reasoning(part.reasoning)
        for delta in chat_deltas(self._calls, part.content, d.finished, d.finish_reason):
            events += self.items.add(delta)
        return events

    def close(self) -> tuple[list[dict], str, str | None]:
        """(the last events, the status, the incomplete reason) once every delta was fed."""
        status, why = finish_status(self.finish_reason)
        return self.items.close(status == "completed"), status, why

    def usage(self) -> dict:
        reasoning = self._splitter.reasoning_tokens if self._splitter else 0
        return usage(self.prompt_tokens, self.output_tokens, self.cached_tokens, reasoning)
