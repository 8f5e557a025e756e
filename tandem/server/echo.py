"""Completions' echo: each choice answers its prompt first (text, and with logprobs the prompt
tokens' logprobs, vLLM's way); with max_tokens 0 it answers the prompt alone (scoring)."""
from __future__ import annotations

from dataclasses import dataclass, field

from tandem.server import protocol as P
from tandem.server.responses import Choice, EchoedPrompt


@dataclass
class Echo:
    """One completions request's echo: per prompt its text and token ids."""

    texts: list[str]
    prompt_ids: list[list[int]]
    n: int  # choices per prompt (a stream runs exactly these)
    with_logprobs: bool  # the prompt's logprobs lead each choice's logprobs
    echo_only: bool  # max_tokens 0: the generated token is dropped

    def prompt(self, choice: int, lps: list[P.Logprob | None] | None) -> EchoedPrompt:
        ids = self.prompt_ids[choice // self.n]
        return EchoedPrompt(ids, lps if lps is not None else [None] * len(ids))

    def finish(self, choices: list[Choice]) -> list[EchoedPrompt]:
        """Non-streaming: the prompt text in front of each choice's; its echoed prompt."""
        for i, c in enumerate(choices):
            if self.echo_only:
                c.text, c.logprobs, c.num_tokens, c.finish_reason = [], [], 0, "length"
            c.text.insert(0, self.texts[i // self.n])
        return [self.prompt(i, c.prompt_logprobs) for i, c in enumerate(choices)]

    def generated(self, d: P.Delta) -> P.Delta | None:
        """A delta as the stream answers it: with max_tokens 0 nothing but the end."""
        if not self.echo_only:
            return d
        if not d.finished:
            return None
        return P.Delta(d.request_id, [], "", True, "length", None, d.cached_tokens)


@dataclass
class EchoGate:
    """Streaming: a choice's echo chunk goes first. With logprobs it waits for its prompt's
    logprobs, which come with the first delta of the prompt's first sequence (the one that
    computed them); a sibling's deltas that come earlier are held until then."""

    echo: Echo
    sent: set[int] = field(default_factory=set)
    held: dict[int, list[P.Delta]] = field(default_factory=dict)
    known: dict[int, list[P.Logprob | None] | None] = field(default_factory=dict)  # by prompt

    def feed(self, index: int, d: P.Delta) -> list[tuple[int, EchoedPrompt | None, P.Delta | None]]:
        """(choice, its echoed prompt or None, a delta or None) to send, in order."""
        group = index // self.echo.n
        if index == group * self.echo.n and (d.prompt_logprobs is not None or d.finished):
            self.known.setdefault(group, d.prompt_logprobs)
        if index in self.sent:
            return [(index, None, d)]
        self.held.setdefault(index, []).append(d)
        if self.echo.with_logprobs and group not in self.known:
            return []
        out = []
        for j in sorted(i for i in self.held if i // self.echo.n == group):
            self.sent.add(j)
            out.append((j, self.echo.prompt(j, self.known.get(group)), None))
            out += [(j, None, held) for held in self.held.pop(j)]
        return out
