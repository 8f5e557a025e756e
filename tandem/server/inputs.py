"""From a validated request body to engine inputs: token ids and sampling params per sequence.

Every refusal here is a 400 naming the offending field, raised before anything
reaches the engine, so a bad request costs the engine loop nothing.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from tandem import chat_template
from tandem.grammar.compiler import check_spec
from tandem.limits import context_error
from tandem.sampling import SamplingParams
from tandem.sampling.bias import static_bias
from tandem.sampling.params import check_unicode
from tandem.server import protocol as P
from tandem.server.errors import APIError
from tandem.server.openai_schemas import ChatCompletionRequest, ChatMessage, CompletionRequest
from tandem.server.reasoning import ReasoningParser
from tandem.server.structured import ToolMode, constraint

MAX_CHOICES = 128  # prompts x sequences per HTTP request
# No prompt averages this many characters per token (English text: about 4).
MAX_CHARS_PER_TOKEN = 64
_INT64 = 2**63
_SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids",
                    "ignore_eos", "presence_penalty", "frequency_penalty", "repetition_penalty",
                    "n", "best_of", "min_tokens", "prompt_logprobs", "include_stop_str_in_output",
                    "skip_special_tokens", "logit_bias", "bad_words")
_WIRE_FIELDS = P.Params.__struct_fields__


@dataclass
class EngineInputs:
    """One HTTP request as engine requests: prompt-major, `samples` sequences per prompt."""

    prompts: list[list[int]]  # per engine request
    params: list[P.Params]
    n: int  # choices answered per prompt
    samples: int  # sequences run per prompt: best_of, else n (best_of > n keeps the n likeliest)
    with_logprobs: bool  # the caller asked for logprobs (best_of computes them regardless)
    with_prompt_logprobs: bool = False  # prompt_logprobs (or echo with logprobs) asked for them
    echo_only: bool = False  # completions echo with max_tokens 0: the prompt alone is answered

    @property
    def prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts[::self.samples])  # a prompt counts once


def completion_inputs(body: CompletionRequest, tokenizer: Any, max_model_len: int,
                      vocab_size: int) -> EngineInputs:
    """vLLM's echo: with logprobs, the prompt tokens' logprobs come first (prompt_logprobs
    defaults to logprobs); with max_tokens 0, only the prompt is answered (scoring): the engine
    samples one token (its smallest max_tokens), which is dropped."""
    _refuse(body.suffix is not None, "suffix", "suffix is not supported")
    _refuse_streamed_prompt_logprobs(body)
    raw = _prompt_list(body.prompt)
    constrained, source = constraint(body)
    echo_only = bool(body.echo) and body.max_tokens == 0
    max_tokens = 1 if echo_only else body.max_tokens
    sp = _sampling_params(body, len(raw), max_tokens, "max_tokens", body.logprobs, tokenizer, vocab_size,
                          constrained, source)
    if body.echo and body.logprobs is not None and sp.prompt_logprobs is None:
        sp = sp.clone(prompt_logprobs=body.logprobs)
    prompts = [_prompt_ids(p, tokenizer, vocab_size, max_model_len) for p in raw]  # the costly part: last
    explicit = "max_tokens" in body.model_fields_set and body.max_tokens is not None
    inputs = _choices(prompts, sp, max_tokens, explicit, "max_tokens", "prompt", body.logprobs, max_model_len)
    inputs.echo_only = echo_only
    return inputs


def chat_inputs(body: ChatCompletionRequest, tokenizer: Any, max_model_len: int, vocab_size: int,
                tools: ToolMode | None = None, reasoning: ReasoningParser | None = None) -> EngineInputs:
    """`reasoning`: the server's reasoning parser where the request thinks; a constraint
    (structured output, tools) then applies after the reasoning, from `</think>` on."""
    _refuse(bool(body.functions), "functions", "functions are not supported; use tools")
    _refuse(bool(body.echo), "echo", "echo is supported on /v1/completions only")
    _refuse_streamed_prompt_logprobs(body)
    _refuse(body.audio is not None or "audio" in (body.modalities or ()), "modalities",
            "this model accepts and produces text only")
    if body.top_logprobs is not None and not body.logprobs:
        raise APIError(400, "top_logprobs needs logprobs set to true", "top_logprobs")
    name = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    constrained, source = constraint(body, tools)  # a 400 about the constraint names its field
    sp = _sampling_params(body, 1, max_tokens, name, logprobs, tokenizer, vocab_size, constrained, source)
    if reasoning is not None and sp.constraint is not None:
        sp = _after_reasoning(sp, reasoning, source)
    ids = render_chat(tokenizer, body.messages, body.add_generation_prompt, body.continue_final_message,
                      body.chat_template_kwargs, tools)  # the costly part: after the cheap checks
    return _choices([ids], sp, max_tokens, max_tokens is not None, name, "messages", logprobs, max_model_len)


def render_chat(tokenizer: Any, messages: list[ChatMessage], add_generation_prompt: bool | None,
                continue_final_message: bool | None, template_kwargs: dict | None,
                tools: ToolMode | None = None) -> list[int]:
    """The chat template applied to the messages (content parts joined), as token ids."""
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise APIError(400, "this model has no chat template; use /v1/completions", "messages")
    conversation = [_message(m) for m in messages]
    tool_list = [t.model_dump(exclude_none=True) for t in tools.tools] if tools is not None else None
    # Names, ids and arguments reach the tokenizer and (a tool's name) the response too.
    _check_texts(conversation, "messages")
    _check_texts(tool_list or [], "tools")
    try:
        return chat_template.render_chat(tokenizer, conversation, add_generation_prompt=bool(add_generation_prompt),
                                         continue_final_message=bool(continue_final_message), tools=tool_list,
                                         template_kwargs=template_kwargs)
    except chat_template.ChatTemplateError as exc:
        raise APIError(400, str(exc), exc.field) from None


def _message(m: ChatMessage) -> dict:
    out = m.model_dump(exclude_none=True)
    out["role"] = "system" if m.role == "developer" else m.role
    out["content"] = _content(m.content)
    for call in out.get("tool_calls", ()):  # templates read arguments as a mapping
        call["function"]["arguments"] = _arguments(call["function"]["arguments"])
    return out


def _arguments(args: Any) -> Any:
    if isinstance(args, str):
        try:
            return json.loads(args)
        except json.JSONDecodeError:
            return args
    return args


def _sampling_params(body, num_prompts: int, max_tokens: int | None, max_name: str, logprobs: int | None,
                     tokenizer: Any, vocab_size: int, constrained: dict,
                     constraint_source: str | None = None) -> SamplingParams:
    """The cheap checks, before any tokenization: every sampling field, then the choice count."""
    fields = {k: getattr(body, k) for k in _SAMPLING_FIELDS if getattr(body, k) is not None}
    _check_int64(fields)
    sp = _validate({**fields, **constrained}, max_tokens, logprobs, max_name, constraint_source)
    if sp.best_of is not None and sp.best_of > sp.n and body.stream:
        raise APIError(400, "best_of greater than n cannot be streamed", "best_of")
    if num_prompts * sp.num_samples > MAX_CHOICES:
        raise APIError(400, f"{num_prompts} prompts x {sp.num_samples} sequences exceeds "
                            f"{MAX_CHOICES}", "best_of" if sp.best_of else "n")
    try:
        static_bias(sp, tokenizer, vocab_size)  # the engine's check, here to name the field
    except ValueError as exc:
        raise APIError(400, str(exc), "bad_words" if str(exc).startswith("bad_words") else "logit_bias") from None
    return sp


def _after_reasoning(sp: SamplingParams, reasoning: ReasoningParser, source: str | None) -> SamplingParams:
    """The request's constraint (already checked, so a 400 names its own field) behind a
    reasoning part: one EBNF grammar in its place."""
    try:
        grammar = reasoning.constrain(*sp.constraint)
    except (RuntimeError, ValueError) as exc:
        raise APIError(400, f"{source} cannot follow the reasoning: {exc}", source) from None
    return sp.clone(json_schema=None, regex=None, choice=None, grammar=grammar)


def _choices(prompts: list[list[int]], sp: SamplingParams, max_tokens: int | None, explicit: bool,
             max_name: str, prompt_name: str, logprobs: int | None, max_model_len: int) -> EngineInputs:
    out_prompts, out_params = [], []
    for ids in prompts:
        too_long = context_error(max_model_len, len(ids), max_tokens if explicit else None)
        if too_long:
            param = prompt_name if len(ids) >= max_model_len else max_name
            raise APIError(400, too_long, param, "context_length_exceeded")
        limit = max_model_len - len(ids) if max_tokens is None else max_tokens
        for seq in sp.samples():
            wire = {k: getattr(seq, k) for k in _WIRE_FIELDS}
            if seq.json_schema is not None:  # JSON text on the wire (key order is the output order)
                wire["json_schema"] = json.dumps(seq.json_schema)
            out_params.append(P.Params(**{**wire, "max_tokens": min(limit, max_model_len - len(ids))}))
            out_prompts.append(ids)
    return EngineInputs(out_prompts, out_params, sp.n, sp.num_samples, logprobs is not None,
                        sp.prompt_logprobs is not None)


def _validate(fields: dict, max_tokens: int | None, logprobs: int | None, max_name: str,
              constraint_source: str | None = None) -> SamplingParams:
    """SamplingParams is the one place that knows valid ranges; its message names the field
    (a constraint's: `constraint_source` where the request field is not the usual one)."""
    try:
        sp = SamplingParams(max_tokens=max_tokens, logprobs=logprobs, **fields)
        if sp.constraint is not None:  # parse the grammar here too: the 400 names the API field
            check_spec(*sp.constraint)
        return sp
    except ValueError as exc:
        msg = str(exc)
        param = msg.split(" ", 1)[0].rstrip(":")
        if param == "max_tokens":
            param, msg = max_name, msg.replace("max_tokens", max_name, 1)
        elif param in ("json_schema", "grammar", "regex") and constraint_source is not None:
            msg = msg.replace(msg.split(" ", 1)[0], constraint_source, 1)
            param = constraint_source
        raise APIError(400, msg, param) from None


def _check_int64(fields: dict) -> None:
    # Wider ints cannot cross the wire; no real request needs them.
    for name in ("seed", "top_k", "min_tokens"):
        if name in fields and not -_INT64 <= fields[name] < _INT64:
            raise APIError(400, f"{name} must fit in 64 bits, got {fields[name]}", name)
    if any(not 0 <= t < _INT64 for t in fields.get("stop_token_ids", ())):
        raise APIError(400, "stop_token_ids must be ints in [0, 2**63)", "stop_token_ids")


def _prompt_list(prompt: str | list) -> list[str | list[int]]:
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise APIError(400, "prompt is empty", "prompt")
    if isinstance(prompt[0], int):
        return [prompt]
    return list(prompt)


def _prompt_ids(prompt: str | list[int], tokenizer: Any, vocab_size: int, max_model_len: int) -> list[int]:
    if isinstance(prompt, str):
        if tokenizer is None:
            raise APIError(400, "this model has no tokenizer: send prompts as token ids", "prompt")
        check_prompt_text(prompt, max_model_len)
        ids = list(tokenizer.encode(prompt))
    else:
        ids = prompt
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            raise APIError(400, f"prompt token ids must be in [0, {vocab_size}); got {bad[:5]}", "prompt")
    if not ids:
        raise APIError(400, "prompt is empty", "prompt")
    return ids


def check_prompt_text(prompt: str, max_model_len: int) -> None:
    """A prompt worth tokenizing: valid Unicode, and not certainly longer than the context."""
    _check_text(prompt, "prompt")
    if len(prompt) > max_model_len * MAX_CHARS_PER_TOKEN:
        raise APIError(400, f"the prompt has {len(prompt)} characters, far more than this model's "
                            f"context of {max_model_len} tokens holds", "prompt")


def _content(content: str | list | None) -> str:
    if content is None or isinstance(content, str):
        _check_text(content or "", "messages")
        return content or ""
    texts = []
    for part in content:
        if part.type == "text" and part.text is not None:
            texts.append(part.text)
        elif part.type == "refusal" and part.refusal is not None:
            texts.append(part.refusal)
        else:
            raise APIError(400, f"this model accepts text only; remove the {part.type!r} content part",
                           "messages")
    text = "".join(texts)
    _check_text(text, "messages")
    return text


def _check_text(text: str, param: str) -> None:
    try:
        check_unicode(text, param)
    except ValueError as exc:
        raise APIError(400, str(exc), param) from None


def _check_texts(value: Any, param: str) -> None:
    """Every string in a JSON-like value (keys too) is valid Unicode."""
    if isinstance(value, str):
        _check_text(value, param)
    elif isinstance(value, dict):
        for k, v in value.items():
            _check_texts(k, param)
            _check_texts(v, param)
    elif isinstance(value, list):
        for v in value:
            _check_texts(v, param)


def _refuse_streamed_prompt_logprobs(body) -> None:
    """vLLM's rule: the prompt_logprobs field is not answered in streams (completions' echo with
    logprobs streams the prompt's logprobs in its first chunk instead)."""
    _refuse(bool(body.stream) and body.prompt_logprobs is not None, "prompt_logprobs",
            "prompt_logprobs are not available when stream is true")


def _refuse(condition: bool, param: str, message: str) -> None:
    if condition:
        raise APIError(400, message, param)
