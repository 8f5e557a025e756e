"""Messages between the front end and the engine process, msgpack-encoded with msgspec.

Every message is a tagged Struct, so a decoder only ever builds these types:
nothing arbitrary is deserialized (never pickle over a socket). Hot-path
records (`Delta`, `Logprob`) are array-like to keep the bytes per token small.
"""
from __future__ import annotations

import msgspec


class Params(msgspec.Struct, frozen=True):
    """The wire form of `tandem.sampling.SamplingParams` (validated again in the engine)."""

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: int | None = None
    json_schema: str | None = None  # JSON text
    regex: str | None = None
    grammar: str | None = None
    choice: list[str] | None = None
    min_tokens: int = 0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    logit_bias: dict[int, float] | None = None
    bad_words: list[str] | None = None
    prompt_logprobs: int | None = None


# ---- front end -> engine ----
class Add(msgspec.Struct, tag=True):
    request_id: str
    prompt_token_ids: list[int]
    params: Params
    # False: the front end makes the text from each delta's `text_ids` (a request without stop
    # strings); the engine's host time per step then holds no detokenization.
    detokenize: bool = True


class Abort(msgspec.Struct, tag=True):
    request_ids: list[str]


class Shutdown(msgspec.Struct, tag=True):
    pass


class ResetPrefixCache(msgspec.Struct, tag=True):
    pass


ToEngine = Add | Abort | Shutdown | ResetPrefixCache


# ---- engine -> front end ----
class Logprob(msgspec.Struct, array_like=True):
    token_id: int
    logprob: float
    top: list[tuple[int, float]]
    rank: int | None = None  # prompt logprobs: 1-based over the whole vocabulary


class Delta(msgspec.Struct, array_like=True):
    """What one request gained in one engine step; its text detokenized by the engine, or by
    the front end from `text_ids`."""

    request_id: str
    token_ids: list[int]
    text: str
    finished: bool
    finish_reason: str | None
    logprobs: list[Logprob] | None
    cached_tokens: int = 0  # on the last delta: prompt tokens whose KV came from the prefix cache
    error: str | None = None  # finish_reason "error": the engine could not run the request
    error_status: int = 500  # 400 when the request itself cannot be served (StepOutput.error_status)
    error_code: str | None = None  # StepOutput.error_code: the error body's code
    # On a choice's first delta when its params asked: None (the first prompt token), then one
    # per prompt token (StepOutput.prompt_logprobs).
    prompt_logprobs: list[Logprob | None] | None = None
    # A request added with detokenize=False: the ids that carry text (StepOutput.text_ids);
    # `text` is then empty and the front end makes it.
    text_ids: list[int] | None = None


class Rejection(msgspec.Struct):
    request_id: str
    status: int  # the HTTP status the front end answers with: 400 bad input, 503 queue full
    message: str


class Stats(msgspec.Struct):
    running: int
    waiting: int
    kv_cache_usage: float
    # Over the engine's recent steps (step timeline); None where not measured (CPU).
    gpu_busy_fraction: float | None = None
    mean_cpu_lead_ms: float | None = None
    mean_host_ms: float = 0.0
    # Prefix cache: running totals in tokens, and the tokens only the cache holds.
    prefix_cache_queried_tokens: int = 0
    prefix_cache_hit_tokens: int = 0
    prefix_cache_tokens: int = 0
    # Speculative decoding: running totals (vLLM's spec_decode_num_*); per position, the rows
    # that accepted proposal j. Empty where it is off.
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    spec_decode_num_accepted_tokens_per_pos: list[int] = []
    # The prefix cache's host tier (zeros where it is off): running totals, and the tokens it holds.
    host_cache_hit_tokens: int = 0
    host_cache_tokens: int = 0
    host_load_bytes: int = 0
    host_load_seconds: float = 0.0
    host_write_back_bytes: int = 0
    host_write_back_seconds: float = 0.0


class Outputs(msgspec.Struct, tag=True):
    """One engine iteration's news: acceptances, rejections, token deltas, and load."""

    accepted: list[str]
    rejected: list[Rejection]
    deltas: list[Delta]
    stats: Stats


class Ready(msgspec.Struct, tag=True):
    max_model_len: int
    vocab_size: int
    stats: Stats
    # What the engine resolved from the configuration ("auto" device and dtype, the KV pool it
    # sized, the attention backend, CUDA graphs): /server_info's "engine".
    resolved: dict[str, str | int | bool] = {}


class Failed(msgspec.Struct, tag=True):
    """The engine could not start (bad model path, out of memory, ...)."""

    message: str


FromEngine = Outputs | Ready | Failed


def encoder() -> msgspec.msgpack.Encoder:
    return msgspec.msgpack.Encoder()


def to_engine_decoder() -> msgspec.msgpack.Decoder:
    return msgspec.msgpack.Decoder(ToEngine)


def from_engine_decoder() -> msgspec.msgpack.Decoder:
    return msgspec.msgpack.Decoder(FromEngine)
