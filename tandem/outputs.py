"""What the engine returns to callers."""
from dataclasses import dataclass, field
from typing import Callable


@dataclass
class TokenLogprob:
    """The engine's record of one generated token's logprobs (the server streams these);
    `LLM` hands users vLLM's `dict[int, Logprob]` per position instead."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)  # best first
    rank: int | None = None  # 1-based over the whole vocabulary, where computed (prompt logprobs)


@dataclass
class Logprob:
    """vLLM's per-token record: `CompletionOutput.logprobs[position][token_id]`."""

    logprob: float
    # 1 is the likeliest. None: a sampled token outside the top `logprobs` ones (the engine
    # ranks only those; vLLM counts the whole vocabulary).
    rank: int | None = None
    decoded_token: str | None = None


SampleLogprobs = list[dict[int, Logprob]]  # vLLM's name: one dict per generated token
PromptLogprobs = list[dict[int, Logprob] | None]  # vLLM's name: None for the first prompt token


def sample_logprobs(lps: list[TokenLogprob], decode: Callable[[int], str]) -> SampleLogprobs:
    """The engine's logprobs in vLLM's shape: per position the sampled token first, then the
    top ones by rank (a sampled token among them appears once, with its rank)."""
    return [_position(lp, decode) for lp in lps]


def prompt_logprobs(lps: list[TokenLogprob | None], decode: Callable[[int], str]) -> PromptLogprobs:
    """The engine's prompt logprobs in vLLM's shape: per prompt position None (the first) or
    the actual token with its rank, then the top ones by rank."""
    return [None if lp is None else _position(lp, decode) for lp in lps]


def _position(lp: TokenLogprob, decode: Callable[[int], str]) -> dict[int, Logprob]:
    ranks = {token: i + 1 for i, (token, _) in enumerate(lp.top)}
    rank = lp.rank if lp.rank is not None else ranks.get(lp.token_id)
    out = {lp.token_id: Logprob(lp.logprob, rank, decode(lp.token_id))}
    for token, value in lp.top:
        if token not in out:
            out[token] = Logprob(value, ranks[token], decode(token))
    return out


@dataclass
class StepOutput:
    """What one request gained in one engine step (for streaming)."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: str | None = None
    new_logprobs: list[TokenLogprob] | None = None
    num_cached_tokens: int = 0  # set when finished: prompt tokens reused from the prefix cache
    error: str | None = None  # finish_reason "error": why the engine could not run the request
    # The HTTP status a server answers the error with: 500 the engine failed, 400 the request
    # cannot be served as asked (its constraints leave no token; its grammar is invalid or took
    # too long to compile).
    error_status: int = 500
    error_code: str | None = None  # the API's error code for it (e.g. "invalid_grammar"); None: generic
    # On a request's first output, when it asked: its prompt logprobs (None first, then one per
    # prompt token), computed by the steps that ran its prefill.
    prompt_logprobs: list[TokenLogprob | None] | None = None
    # A request whose caller makes its text (Engine.add_request's detokenize=False): the ids of
    # this output that carry text, in order (a stop id does not, unless include_stop_str_in_output).
    # A finished output that is not an error ends the text (RequestText.finish). None otherwise.
    text_ids: list[int] | None = None


@dataclass
class CompletionOutput:
    """One sampled sequence of a prompt (vLLM's shape)."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None  # sum of the chosen tokens' logprobs; None unless computed
    logprobs: SampleLogprobs | None  # from the engine: list[TokenLogprob] (Engine.output)
    finish_reason: str | None
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it


@dataclass
class RequestOutput:
    """A prompt's whole result: `outputs` holds its n sequences. `.text`, `.token_ids`,
    `.finish_reason`, `.stop_reason` and `.logprobs` read `outputs[0]`."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    # vLLM's PromptLogprobs from LLM; the engine's list[TokenLogprob | None] from Engine.output.
    prompt_logprobs: list | None = None
    num_preemptions: int = 0
    num_cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache

    @property
    def finished(self) -> bool:
        return all(o.finish_reason is not None for o in self.outputs)

    text = property(lambda self: self.outputs[0].text)
    token_ids = property(lambda self: self.outputs[0].token_ids)
    finish_reason = property(lambda self: self.outputs[0].finish_reason)
    stop_reason = property(lambda self: self.outputs[0].stop_reason)
    logprobs = property(lambda self: self.outputs[0].logprobs)
