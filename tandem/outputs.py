"""What the engine returns to callers."""
from dataclasses import dataclass, field


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)  # best first


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


@dataclass
class RequestOutput:
    """A request's whole result."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: str | None
    stop_reason: str | int | None = None
    logprobs: list[TokenLogprob] | None = None
    num_preemptions: int = 0
    num_cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache
