"""From a validated request body to engine inputs: token ids and sampling params per choice.

Every refusal here is a 400 naming the offending field, raised before anything
reaches the engine, so a bad request costs the engine loop nothing.
"""
from __future__ import annotations

import json
from typing import Any

from tandem.grammar.compiler import check_spec
from tandem.sampling import SamplingParams
from tandem.sampling.params import check_unicode
from tandem.server import protocol as P
from tandem.server.errors import APIError
from tandem.server.openai_schemas import ChatCompletionRequest, CompletionRequest
from tandem.server.structured import ToolMode, constraint, constraint_param

MAX_CHOICES = 128  # prompts x n per HTTP request
# No prompt averages this many characters per token (English text: about 4).
MAX_CHARS_PER_TOKEN = 64
_INT64 = 2**63
_SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids",
                    "ignore_eos", "presence_penalty", "frequency_penalty", "repetition_penalty")


def completion_inputs(body: CompletionRequest, tokenizer: Any, max_model_len: int,
                      vocab_size: int) -> tuple[list[list[int]], list[P.Params]]:
    _refuse(body.echo, "echo", "echo is not supported")
    _refuse(body.suffix is not None, "suffix", "suffix is not supported")
    _refuse(body.best_of not in (None, body.n), "best_of", "best_of must be null or equal to n")
    raw = _prompt_list(body.prompt)
    fields = _sampling_fields(body, len(raw), body.max_tokens, "max_tokens", body.logprobs, constraint(body))
    prompts = [_prompt_ids(p, tokenizer, vocab_size, max_model_len) for p in raw]  # the costly part: last
    explicit = "max_tokens" in body.model_fields_set and body.max_tokens is not None
    return _choices(body, prompts, fields, body.max_tokens, explicit, "max_tokens", "prompt",
                    body.logprobs, max_model_len)


def chat_inputs(body: ChatCompletionRequest, tokenizer: Any, max_model_len: int,
                tools: ToolMode | None = None) -> tuple[list[list[int]], list[P.Params]]:
    if body.top_logprobs is not None and not body.logprobs:
        raise APIError(400, "top_logprobs needs logprobs set to true", "top_logprobs")
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise APIError(400, "this model has no chat template; use /v1/completions", "messages")
    name = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    fields = _sampling_fields(body, 1, max_tokens, name, logprobs, constraint(body, tools))
    messages = [_message(m) for m in body.messages]
    extra = {"tools": [t.model_dump(exclude_none=True) for t in tools.tools]} if tools is not None else {}
    try:
        ids = list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                 return_dict=False, **extra))
    except Exception as exc:  # jinja raises whatever the template author chose
        raise APIError(400, f"the chat template refused these messages: {exc}", "messages") from None
    return _choices(body, [ids], fields, max_tokens, max_tokens is not None, name, "messages", logprobs,
                    max_model_len)


def _message(m) -> dict:
    out = {"role": "system" if m.role == "developer" else m.role, "content": _content(m.content)}
    if m.tool_calls:  # templates read arguments as a mapping
        out["tool_calls"] = [{**c, "function": {**c.get("function", {}),
                                                "arguments": _arguments(c.get("function", {}).get("arguments"))}}
                             for c in m.tool_calls]
    if m.tool_call_id is not None:
        out["tool_call_id"] = m.tool_call_id
    return out


def _arguments(args: Any) -> Any:
    if isinstance(args, str):
        try:
            return json.loads(args)
        except json.JSONDecodeError:
            return args
    return args


def _sampling_fields(body, num_prompts: int, max_tokens: int | None, max_name: str,
                     logprobs: int | None, constrained: dict) -> dict:
    """The cheap checks, before any tokenization: choice count, then every sampling field."""
    _refuse(bool(body.logit_bias), "logit_bias", "logit_bias is not supported")
    if num_prompts * body.n > MAX_CHOICES:
        raise APIError(400, f"{num_prompts} prompts x n={body.n} exceeds {MAX_CHOICES} choices", "n")
    fields = {k: getattr(body, k) for k in _SAMPLING_FIELDS if getattr(body, k) is not None}
    _check_int64(fields)
    _validate({**fields, **constrained}, max_tokens, logprobs, max_name)
    if "json_schema" in constrained:  # JSON text on the wire
        constrained = {**constrained, "json_schema": json.dumps(constrained["json_schema"])}
    fields.update(constrained)
    return fields


def _choices(body, prompts: list[list[int]], fields: dict, max_tokens: int | None, explicit: bool,
             max_name: str, prompt_name: str, logprobs: int | None, max_model_len: int):
    out_prompts, out_params = [], []
    for ids in prompts:
        room = max_model_len - len(ids)
        if room < 1:
            raise APIError(400, f"the prompt has {len(ids)} tokens but this model's context holds "
                                f"{max_model_len}, and at least one must be left to generate", prompt_name)
        if explicit and len(ids) + max_tokens > max_model_len:
            raise APIError(400, f"this model's maximum context length is {max_model_len} tokens, but "
                                f"the prompt has {len(ids)} tokens and {max_name} is {max_tokens} "
                                f"({len(ids) + max_tokens} in total); reduce the prompt or {max_name}",
                           max_name)
        limit = room if max_tokens is None else min(max_tokens, room)
        for i in range(body.n):
            seed = fields.get("seed")
            extra = {"seed": (seed + i) % _INT64} if seed is not None and i else {}
            stop = fields.get("stop")
            out_params.append(P.Params(**{**fields, **extra, "max_tokens": limit, "logprobs": logprobs,
                                          "stop": [stop] if isinstance(stop, str) else stop}))
            out_prompts.append(ids)
    return out_prompts, out_params


def _validate(fields: dict, max_tokens: int | None, logprobs: int | None, max_name: str) -> None:
    """SamplingParams is the one place that knows valid ranges; its message names the field."""
    try:
        params = SamplingParams(max_tokens=1 if max_tokens is None else max_tokens, logprobs=logprobs, **fields)
        if params.constraint is not None:  # parse the grammar here too: the 400 names the API field
            check_spec(*params.constraint)
    except ValueError as exc:
        msg = str(exc)
        param = msg.split(" ", 1)[0]
        if param == "max_tokens":
            param, msg = max_name, msg.replace("max_tokens", max_name, 1)
        elif param in ("json_schema", "grammar"):
            param = constraint_param(param)
            msg = msg.replace(msg.split(" ", 1)[0], param, 1)
        raise APIError(400, msg, param) from None


def _check_int64(fields: dict) -> None:
    # Wider ints cannot cross the wire; no real request needs them.
    for name in ("seed", "top_k"):
        if name in fields and not -_INT64 <= fields[name] < _INT64:
            raise APIError(400, f"{name} must fit in 64 bits, got {fields[name]}", name)
    if any(not 0 <= t < _INT64 for t in fields.get("stop_token_ids", [])):
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
        _check_text(prompt, "prompt")
        if len(prompt) > max_model_len * MAX_CHARS_PER_TOKEN:  # certainly too long: not worth tokenizing
            raise APIError(400, f"the prompt has {len(prompt)} characters, far more than this model's "
                                f"context of {max_model_len} tokens holds", "prompt")
        ids = list(tokenizer.encode(prompt))
    else:
        ids = prompt
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            raise APIError(400, f"prompt token ids must be in [0, {vocab_size}); got {bad[:5]}", "prompt")
    if not ids:
        raise APIError(400, "prompt is empty", "prompt")
    return ids


def _content(content: str | list | None) -> str:
    if content is None or isinstance(content, str):
        text = content or ""
    else:
        text = "".join(part.text for part in content)
    _check_text(text, "messages")
    return text


def _check_text(text: str, param: str) -> None:
    try:
        check_unicode(text, param)
    except ValueError as exc:
        raise APIError(400, str(exc), param) from None


def _refuse(condition: bool, param: str, message: str) -> None:
    if condition:
        raise APIError(400, message, param)
