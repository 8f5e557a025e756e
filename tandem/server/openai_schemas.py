"""Request bodies of the OpenAI endpoints (pydantic: they also make the OpenAPI document).

Every field of OpenAI's current chat and completions request schemas is declared, plus
vLLM's common extensions, so code written for either passes through. Types are strict (a
string is not a number). Fields are in three groups:

* honoured: the sampling fields, n / best_of, logit_bias, echo, stream_options, ...;
* accepted and ignored (`IGNORED`): fields without meaning here (store, metadata, ...);
  the server logs each one once;
* not declared: kept in `model_extra`, ignored with a warning, or refused under
  `--strict-api` (`tandem.server.fields`).

Value ranges of sampling fields are checked once, by `SamplingParams`, not repeated here.
"""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field
from pydantic.json_schema import SkipJsonSchema

from tandem.sampling import MAX_LOGPROBS  # one bound for the API and the engine

MAX_N = 16

# A free-form JSON object accepted but left out of the OpenAPI document: fields that are only
# ignored need no documented shape, and each recursive "any JSON" schema multiplies what schema
# fuzzers (schemathesis) must generate.
_Opaque = SkipJsonSchema[dict[str, Any] | None]

# Standard fields that change nothing here, with the reason the server logs (once each).
IGNORED = {
    "store": "responses are not stored",
    "metadata": "responses are not stored",
    "service_tier": "there is one service tier",
    "reasoning_effort": "this server runs no reasoning-effort control",
    "verbosity": "this server runs no verbosity control",
    "prompt_cache_key": "prompt caching needs no key here",
    "prompt_cache_options": "prompt caching needs no options here",
    "prompt_cache_retention": "prompt caching needs no retention setting here",
    "safety_identifier": "no safety system runs here",
    "moderation": "no moderation runs here",
    "prediction": "predicted outputs are not used",
    "web_search_options": "there is no web search",
    "function_call": "the deprecated function-call API is not served; use tools",
    "include_obfuscation": "streams are not obfuscated",
    "spaces_between_special_tokens": "special tokens are decoded as the tokenizer does",
    "guided_decoding_backend": "structured output has one backend here (xgrammar)",
}


class _Body(BaseModel):
    # Undeclared fields land in model_extra: warned about, or refused with --strict-api.
    model_config = ConfigDict(strict=True, extra="allow")


class _Lenient(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Lenient):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False  # vLLM: usage in every chunk
    include_obfuscation: bool | None = None


class StructuredOutputs(_Body):
    """vLLM's `structured_outputs` request object (one constraint kind). Keys beyond these are
    refused by name: ignoring one would run the request unconstrained."""

    model_config = ConfigDict(strict=True, extra="allow", populate_by_name=True)

    choice: list[str] | None = None
    regex: str | None = None
    # A JSON schema, or its JSON text ("json" on the wire; the name would shadow BaseModel.json).
    json_: SkipJsonSchema[dict[str, Any] | str | None] = Field(None, alias="json")
    grammar: str | None = None  # EBNF
    json_object: bool | None = None


class _Sampling(_Body):
    model: str | None = None
    n: int | None = Field(1, ge=1, le=MAX_N)
    best_of: int | None = Field(None, ge=1, le=MAX_N)
    temperature: float | None = None
    top_p: float | None = None
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
    bad_words: list[str] | None = None
    skip_special_tokens: bool | None = None
    include_stop_str_in_output: bool | None = None
    prompt_logprobs: int | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # accepted as-is (an end-user id for the caller's own records)
    regex: str | None = None  # SGLang-style structured output
    ebnf: str | None = None
    # vLLM's structured output: the current object and the older guided_* fields.
    structured_outputs: StructuredOutputs | None = None
    guided_choice: list[str] | None = None
    guided_regex: str | None = None
    guided_json: SkipJsonSchema[dict[str, Any] | str | None] = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None  # accepted and ignored (see IGNORED)
    # Accepted and ignored (see IGNORED).
    store: bool | None = None
    metadata: _Opaque = None
    service_tier: str | None = None
    spaces_between_special_tokens: bool | None = None


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool | None = False
    suffix: str | None = None  # accepted only when null
    response_format: ResponseFormat | None = None  # vLLM takes it here too (structured output)


class FunctionCall(_Lenient):
    name: str
    arguments: str


class ToolCall(_Lenient):
    """A tool call an assistant message made earlier (OpenAI's shape), passed to the template."""

    id: str
    type: str = "function"
    function: FunctionCall


class ContentPart(_Lenient):
    """One part of a message's content. Text (and an assistant's refusal) is used; any
    other kind (image_url, input_audio, file, ...) is refused: this model reads text only."""

    type: str
    text: str | None = None
    refusal: str | None = None


class ChatMessage(_Lenient):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: list[ToolCall] | None = None
    function_call: FunctionCall | None = None
    refusal: str | None = None
    reasoning_content: str | None = None  # vLLM: a reasoning model's earlier thoughts


class JsonSchemaFormat(_Lenient):
    name: str
    schema_: _Opaque = Field(None, alias="schema")  # any JSON: left out of the document
    description: str | None = None
    strict: bool | None = None


class ResponseFormat(_Lenient):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class FunctionDef(_Lenient):
    name: str
    description: str | None = None
    parameters: _Opaque = None  # any JSON: left out of the document
    strict: bool | None = None


class Tool(_Lenient):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Lenient):
    name: str


class NamedToolChoice(_Lenient):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    response_format: ResponseFormat | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    functions: SkipJsonSchema[list[dict[str, Any]] | None] = None  # accepted only when empty (old tools)
    modalities: list[str] | None = None  # ["text"] only
    audio: _Opaque = None  # audio output: refused
    echo: bool | None = False  # vLLM's chat echo: refused when true
    # vLLM's chat-template controls.
    add_generation_prompt: bool | None = True
    continue_final_message: bool | None = False
    chat_template_kwargs: SkipJsonSchema[dict[str, Any] | None] = None  # any JSON: left out (see _Opaque)
    # Accepted and ignored (see IGNORED).
    function_call: SkipJsonSchema[str | dict[str, Any] | None] = None
    reasoning_effort: str | None = None
    verbosity: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_options: _Opaque = None
    prompt_cache_retention: str | None = None
    safety_identifier: str | None = None
    moderation: _Opaque = None
    prediction: _Opaque = None
    web_search_options: _Opaque = None


class TokenizeRequest(_Body):
    """vLLM's /tokenize: a prompt, or chat messages rendered by the chat template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # default: True for a prompt, False for messages
    add_generation_prompt: bool | None = True
    continue_final_message: bool | None = False
    chat_template_kwargs: SkipJsonSchema[dict[str, Any] | None] = None  # any JSON: left out (see _Opaque)
    return_token_strs: bool | None = False


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[int]
