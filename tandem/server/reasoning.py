"""Reasoning output: a reasoning model's `<think>…</think>` part, apart from its answer.

`tandem serve --reasoning-parser NAME` picks how a reply is split (names as vLLM's):

* `deepseek_r1`: the chat template may already have opened `<think>`, so a reply starts
  inside its reasoning: text before the first `</think>` is reasoning even with no `<think>`
  seen (one at the reply's start is dropped). A reply that never closes it is all reasoning.
* `qwen3`: a reply has reasoning only when it opens with `<think>` (after any whitespace);
  text from there to `</think>` (or to the end, if never closed) is reasoning, the rest
  content. Any other reply is all content.

After the first `</think>` everything is content, later tags included; the tags themselves
are never shown. A request whose `chat_template_kwargs` turns thinking off (`enable_thinking`,
or DeepSeek's `thinking`, false) has no reasoning: the kwargs go to the template as always,
its reply is all content, and its constraint is not moved behind a reasoning part.

The interface, for every route that answers with reasoning (chat completions; the
Responses API): `reasoning_parser(name)` once at start; per request `thinking_requested`;
per sequence `ReasoningParser.splitter(thinking)`, fed each engine delta (`feed`), or
`ReasoningParser.split(text)` for a whole reply; and `ReasoningParser.constrain(kind, spec)`,
the grammar that lets the reasoning come first and the request's constraint after `</think>`.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Sequence

_OPENING, _REASONING, _CONTENT = "opening", "reasoning", "content"  # a splitter's states


@dataclass(frozen=True)
class ReasoningParser:
    """How a reply's reasoning is marked (one per server: `--reasoning-parser`)."""

    name: str
    starts_in_reasoning: bool  # deepseek_r1: the template may have opened <think> already
    start: str = "<think>"
    end: str = "</think>"
    # The vocabulary's id of `end` when it is one token (Qwen3, DeepSeek-R1): the token that
    # ends the reasoning is then known exactly, whatever the engine's deltas hold.
    end_token_id: int | None = None

    def for_tokenizer(self, tokenizer: Any) -> "ReasoningParser":
        """This parser knowing the end tag's token id, where the tokenizer has it as one token."""
        if tokenizer is None:
            return self
        token_id = tokenizer.get_vocab().get(self.end)  # vLLM's test: the tag is a vocabulary entry
        return replace(self, end_token_id=token_id) if token_id is not None else self

    def splitter(self, thinking: bool = True) -> "ReasoningSplitter":
        return ReasoningSplitter(self, thinking)

    def split(self, text: str, thinking: bool = True) -> "Split":
        """A whole reply's (reasoning, content)."""
        return self.splitter(thinking).feed(text, finished=True)

    def constrain(self, kind: str, spec: str) -> str:
        """EBNF for a constrained reply of a thinking request: the reasoning part (free text
        up to `</think>`, which it cannot contain), then the constraint (`kind` and `spec` as
        `SamplingParams.constraint` gives them: json_schema, regex or grammar), which starts
        right after `</think>`. ValueError for a kind it does not know."""
        import xgrammar as xgr

        answers = {"json_schema": lambda: xgr.Grammar.from_json_schema(spec, any_whitespace=False),
                   "regex": lambda: xgr.Grammar.from_regex(spec), "grammar": lambda: xgr.Grammar.from_ebnf(spec)}
        if kind not in answers:
            raise ValueError(f"a {kind} constraint cannot follow reasoning")
        return str(xgr.Grammar.concat(xgr.Grammar.from_ebnf(self._reasoning_ebnf()), answers[kind]()))

    def _reasoning_ebnf(self) -> str:
        # TagDispatch with `excludes`: any text without the end tag (xgrammar's any_text).
        free = f"thought ::= TagDispatch(loop_after_dispatch=false, excludes=({_literal(self.end)}))"
        if self.starts_in_reasoning:
            return f"root ::= {_literal(self.start)}? thought {_literal(self.end)}\n{free}"
        return f"root ::= ({_literal(self.start)} thought {_literal(self.end)})?\n{free}"


def _literal(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


PARSERS = {p.name: p for p in (ReasoningParser("deepseek_r1", starts_in_reasoning=True),
                               ReasoningParser("qwen3", starts_in_reasoning=False))}


def reasoning_parser(name: str | None) -> ReasoningParser | None:
    """The parser of `--reasoning-parser NAME` (None: off); ValueError naming the known ones."""
    if name is None:
        return None
    if name not in PARSERS:
        raise ValueError(f"unknown reasoning parser {name!r}; the known ones: {', '.join(sorted(PARSERS))}")
    return PARSERS[name]


def thinking_requested(template_kwargs: dict | None) -> bool:
    """False when the request's chat_template_kwargs turn thinking off (Qwen3's
    `enable_thinking`, DeepSeek-V3.1's `thinking`)."""
    kwargs = template_kwargs or {}
    return kwargs.get("enable_thinking", True) is not False and kwargs.get("thinking", True) is not False


@dataclass
class Split:
    """Reply text, divided: reasoning, then content."""

    reasoning: str = ""
    content: str = ""


@dataclass
class ReasoningSplitter:
    """One sequence's reply, split as it streams in. Text that may be the start of a tag is
    held until the next delta tells (so a tag split across deltas is never shown); the
    delta that finishes the sequence releases it."""

    parser: ReasoningParser
    thinking: bool = True  # False: the request turned thinking off, the reply is all content
    _state: str = field(default=_OPENING, init=False)
    _held: str = field(default="", init=False)  # text whose side is not known yet
    _tokens: int = field(default=0, init=False)  # the reply's tokens so far
    _reasoned: bool = field(default=False, init=False)  # the reply has a reasoning part
    _first_end_id: int | None = field(default=None, init=False)  # tokens through the first end_token_id
    _closed_at: int | None = field(default=None, init=False)  # tokens through the one that ended it
    _reasoning: list[str] = field(default_factory=list, init=False, repr=False)
    _content: list[str] = field(default_factory=list, init=False, repr=False)

    def __post_init__(self) -> None:
        if not self.thinking:
            self._state = _CONTENT
        self._reasoned = self.thinking and self.parser.starts_in_reasoning

    def feed(self, text: str, token_ids: Sequence[int] = (), finished: bool = False) -> Split:
        """The next delta's text and tokens; returns what of the reply is now known to be
        reasoning or content (tags left out)."""
        end_id = self.parser.end_token_id
        if end_id is not None and self._first_end_id is None and end_id in token_ids:
            self._first_end_id = self._tokens + list(token_ids).index(end_id) + 1
        self._tokens += len(token_ids)
        self._held += text
        out = Split()
        while self._advance(out, finished):
            pass
        self._reasoning.append(out.reasoning)
        self._content.append(out.content)
        return out

    @property
    def reasoning(self) -> str:
        """The reasoning so far."""
        return "".join(self._reasoning)

    @property
    def content(self) -> str:
        """The content so far."""
        return "".join(self._content)

    @property
    def has_reasoning(self) -> bool:
        return self._reasoned

    @property
    def reasoning_tokens(self) -> int:
        """The reply's tokens from its first through the one that completes `</think>` (the
        opening `<think>` and both tags' tokens count); all of them while the reasoning has
        not ended; 0 for a reply without reasoning. The closing token is found by its id where
        `</think>` is one token of the vocabulary (Qwen3, DeepSeek-R1); otherwise it is taken
        as the last token of the delta whose text completes the tag, which is exact while
        each delta carries one token (more, with speculative decoding, may count a few after)."""
        if not self._reasoned:
            return 0
        return self._closed_at if self._closed_at is not None else self._tokens

    def _advance(self, out: Split, finished: bool) -> bool:
        """One step of the state machine over the held text; False once it needs more text."""
        if self._state == _OPENING:
            return self._open(finished)
        if self._state == _CONTENT:
            out.content += self._held
            self._held = ""
            return False
        end = self.parser.end
        at = self._held.find(end)
        if at < 0:
            keep = 0 if finished else _tag_prefix(self._held, end)
            out.reasoning += self._held[:len(self._held) - keep]
            self._held = self._held[len(self._held) - keep:]
            return False
        out.reasoning += self._held[:at]
        self._held = self._held[at + len(end):]
        self._state = _CONTENT
        self._closed_at = self._first_end_id if self._first_end_id is not None else self._tokens
        return True

    def _open(self, finished: bool) -> bool:
        """At the reply's start: an opening tag (after whitespace) begins the reasoning;
        anything else leaves the parser's default side."""
        start = self.parser.start
        body = self._held.lstrip()
        if body.startswith(start):
            self._held, self._state, self._reasoned = body[len(start):], _REASONING, True
            return True
        if start.startswith(body) and not finished:
            return False  # may still become the tag
        self._state = _REASONING if self.parser.starts_in_reasoning else _CONTENT
        return True


def _tag_prefix(text: str, tag: str) -> int:
    """The length of the longest end of `text` that begins `tag` (a tag maybe arriving)."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0
