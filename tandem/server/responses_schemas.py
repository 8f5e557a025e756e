"""The request body of `POST /v1/responses` (OpenAI's Responses API), for text.

Input items, tools and tool_choice are taken as plain JSON and converted by hand
(`responses_input`): their kinds are many (images, files, built-in tools, ...) and a
refused one must get a 400 that names it, not a pydantic union's list of mismatches.
Every other field is typed here, strictly, as the chat and completions bodies are.
"""
from __future__ import annotations

from typing import Any, Literal

from pydantic import Field
from pydantic.json_schema import SkipJsonSchema

from tandem.server.openai_schemas import StreamOptions, _Body, _Lenient, _Opaque

# Standard Responses fields that change nothing here, with the reason the server logs once.
RESPONSES_IGNORED = {
    "reasoning": "this server runs no reasoning-effort control",
    "service_tier": "there is one service tier",
    "prompt_cache_key": "prompt caching needs no key here",
    "prompt_cache_retention": "prompt caching needs no retention setting here",
    "safety_identifier": "no safety system runs here",
    "context_management": "the context is not compacted here",
    "max_tool_calls": "each response makes the calls of one model turn",
}


class TextFormat(_Lenient):
    """`text.format`: plain text, any JSON object, or JSON matching a schema."""

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: _Opaque = Field(None, alias="schema")  # any JSON: left out of the document
    description: str | None = None
    strict: bool | None = None


class TextConfig(_Lenient):
    format: TextFormat | None = None
    verbosity: str | None = None  # accepted and ignored: no verbosity control


class ResponsesRequest(_Body):
    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    previous_response_id: str | None = None
    store: bool | None = True
    metadata: dict[str, str] | None = None  # echoed in the response, as OpenAI does
    user: str | None = None
    include: list[str] | None = None
    truncation: Literal["auto", "disabled"] | None = None
    top_logprobs: int | None = None
    # Refused when set (no background runs, conversations or stored prompts here).
    background: bool | None = None
    conversation: SkipJsonSchema[str | dict[str, Any] | None] = None
    prompt: _Opaque = None
    # vLLM's sampling extensions, as on the chat endpoint.
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = None
    min_tokens: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    skip_special_tokens: bool | None = None
    include_stop_str_in_output: bool | None = None
    # Accepted and ignored (RESPONSES_IGNORED).
    reasoning: _Opaque = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    safety_identifier: str | None = None
    context_management: SkipJsonSchema[list[dict[str, Any]] | dict[str, Any] | None] = None
    max_tool_calls: int | None = None
