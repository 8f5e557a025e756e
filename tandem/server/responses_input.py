"""A Responses request as the chat request the chat machinery already runs.

Input items become chat messages (function calls an assistant message's `tool_calls`,
their outputs `tool` messages), flat function tools become chat tools, `text.format`
becomes `response_format`; the chat template, the tool grammars and the tool-call parser
are then the chat endpoint's own. Every refusal is a 400 naming the Responses field.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from tandem.server.errors import APIError
from tandem.server.openai_schemas import ChatCompletionRequest, ResponseFormat
from tandem.server.responses_schemas import ResponsesRequest
from tandem.server.structured import ToolMode, tool_mode, with_response_format

_TEXT_PARTS = ("input_text", "output_text")
_ROLES = ("user", "assistant", "system", "developer")
_ITEM_KINDS = "message, function_call, function_call_output"
# Responses fields passed to the chat request as they are (same names, same meaning).
_SAME_FIELDS = ("model", "temperature", "top_p", "parallel_tool_calls", "stream", "top_k", "min_p", "seed",
                "stop", "stop_token_ids", "ignore_eos", "min_tokens", "presence_penalty", "frequency_penalty",
                "repetition_penalty", "logit_bias", "skip_special_tokens", "include_stop_str_in_output")
# A chat field in a 400 from the chat machinery -> the Responses field it came from.
_RENAMED = {"messages": "input", "max_completion_tokens": "max_output_tokens", "response_format": "text.format"}


@dataclass
class ChatView:
    """A Responses request as a chat request, and what the response echoes back."""

    chat: ChatCompletionRequest
    history: list[dict]  # the conversation without instructions: stored for previous_response_id
    tools: list[dict]  # function tools in the Responses (flat) shape
    tool_choice: str | dict
    text_format: dict


def refuse_unsupported(body: ResponsesRequest) -> None:
    """400s for what this server does not do, before any work."""
    _refuse(bool(body.background), "background", "background responses are not supported")
    _refuse(body.conversation is not None, "conversation", "conversations are not supported; use "
                                                           "previous_response_id")
    _refuse(body.prompt is not None, "prompt", "stored prompt templates are not supported")
    _refuse(bool(body.top_logprobs), "top_logprobs", "top_logprobs is not supported on /v1/responses")
    _refuse(body.truncation == "auto", "truncation", "truncation 'auto' is not supported: the input "
                                                     "must fit the context")
    kept = [i for i in body.include or () if i != "reasoning.encrypted_content"]  # no reasoning here
    _refuse(bool(kept), "include", f"include: {', '.join(map(repr, kept))} not supported")


def chat_view(body: ResponsesRequest, previous: list[dict], chat_template: str | None) -> tuple[ChatView,
                                                                                                ToolMode | None]:
    """The chat request of a Responses request whose earlier conversation is `previous`, and
    its tool mode (as the chat endpoint computes it)."""
    history = previous + input_messages(body.input, _call_names(previous))
    tools = function_tools(body.tools or [])
    choice, chosen = _tool_choice(body.tool_choice, tools)
    fmt = _text_format(body)
    fields = {k: getattr(body, k) for k in _SAME_FIELDS if getattr(body, k) is not None}
    system = [{"role": "system", "content": body.instructions}] if body.instructions is not None else []
    fields.update(messages=system + history, max_completion_tokens=body.max_output_tokens)
    if chosen:
        fields.update(tools=[{"type": "function", "function": {k: v for k, v in t.items() if k != "type"}}
                             for t in chosen], tool_choice=_chat_choice(choice))
    chat = _validated(fields)
    mode = tool_mode(chat, chat_template)
    response_format = _response_format(fmt)
    if response_format is not None:
        response_format = ResponseFormat.model_validate(response_format)
    mode, chat.response_format = with_response_format(mode, response_format, unknown_format_ok=True)
    return ChatView(chat, history, tools, body.tool_choice if body.tool_choice is not None else "auto", fmt), mode


def renamed(exc: APIError) -> APIError:
    """A 400 from the chat machinery, naming the Responses field instead of the chat one."""
    message = exc.message
    for old, new in _RENAMED.items():
        message = message.replace(old, new)
    return APIError(exc.status, message, _RENAMED.get(exc.param, exc.param), exc.code, exc.headers)


def _validated(fields: dict) -> ChatCompletionRequest:
    try:
        return ChatCompletionRequest.model_validate(fields)
    except ValidationError as exc:  # values the hand conversion let through, in the chat schema's words
        err = exc.errors()[0]
        loc = ".".join(str(p) for p in err["loc"])
        raise APIError(400, f"invalid value for {loc}: {err['msg']}", _RENAMED.get(str(err["loc"][0]),
                                                                                   str(err["loc"][0]))) from None


# ---- input items -> chat messages ----

def input_messages(items: str | list[dict], names: dict[str, str] | None = None) -> list[dict]:
    """`input` as chat messages: a string is one user message; a list holds messages,
    function calls (joined to the assistant message before them) and their outputs (`names`:
    call_id -> function name of the calls made earlier, for the tool message answering one)."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    _refuse(not items, "input", "input is empty")
    out: list[dict] = []
    names = dict(names or {})
    thought = ""  # a reasoning item's text, for the assistant message that follows it
    for i, item in enumerate(items):
        where = f"input[{i}]"
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            out.append(_message(item, where))
        elif kind == "function_call":
            _add_call(out, item, where, names)
        elif kind == "function_call_output":
            out.append(_call_output(item, where, names))
        elif kind == "reasoning":
            thought += _reasoning_text(item)
            continue
        else:
            raise APIError(400, f"{where}: input items of type {kind!r} are not supported (supported: "
                                f"{_ITEM_KINDS}, reasoning)", f"{where}.type")
        if thought and out[-1]["role"] == "assistant":  # vLLM's field, which thinking templates read
            out[-1]["reasoning_content"], thought = thought, ""
    return out


def _reasoning_text(item: dict) -> str:
    """A reasoning item's text (its content, else its summary); its encrypted form is not read."""
    parts = item.get("content") or item.get("summary") or []
    return "".join(p["text"] for p in parts if isinstance(p, dict) and isinstance(p.get("text"), str)) \
        if isinstance(parts, list) else ""


def _call_names(messages: list[dict]) -> dict[str, str]:
    return {c["id"]: c["function"]["name"] for m in messages for c in m.get("tool_calls") or ()}


def _message(item: dict, where: str) -> dict:
    role = item.get("role")
    _refuse(role not in _ROLES, f"{where}.role", f"{where}.role must be one of {', '.join(_ROLES)}, got {role!r}")
    return {"role": role, "content": _text(item.get("content"), f"{where}.content")}


def _text(content: Any, where: str) -> str:
    """A message's content as one string: text parts joined; any other part is a 400."""
    if isinstance(content, str):
        return content
    _refuse(not isinstance(content, list), where, f"{where} must be a string or a list of content parts")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in _TEXT_PARTS:
            texts.append(_string(part, "text", f"{where}[{j}]"))
        elif kind == "refusal":
            texts.append(_string(part, "refusal", f"{where}[{j}]"))
        else:
            raise APIError(400, f"{where}[{j}]: content of type {kind!r} is not supported: this model "
                                "accepts text only (input_text, output_text)", f"{where}[{j}].type")
    return "".join(texts)


def _add_call(out: list[dict], item: dict, where: str, names: dict[str, str]) -> None:
    call_id, name = _string(item, "call_id", where), _string(item, "name", where)
    call = {"id": call_id, "type": "function",
            "function": {"name": name, "arguments": _string(item, "arguments", where)}}
    names[call_id] = name
    last = out[-1] if out else None
    if last is not None and last["role"] == "assistant":  # one turn: its text and its calls
        last.setdefault("tool_calls", []).append(call)
    else:
        out.append({"role": "assistant", "content": None, "tool_calls": [call]})


def _call_output(item: dict, where: str, names: dict[str, str]) -> dict:
    call_id = _string(item, "call_id", where)
    message = {"role": "tool", "tool_call_id": call_id, "content": _text(item.get("output"), f"{where}.output")}
    if call_id in names:
        message["name"] = names[call_id]
    return message


def _string(item: dict, key: str, where: str) -> str:
    value = item.get(key)
    _refuse(not isinstance(value, str), f"{where}.{key}", f"{where}.{key} must be a string")
    return value


# ---- tools, tool_choice, text.format ----

def function_tools(tools: list[dict]) -> list[dict]:
    """The function tools, checked; a built-in tool (web_search, file_search, ...) is a 400."""
    out = []
    for i, tool in enumerate(tools):
        kind = tool.get("type")
        _refuse(kind != "function", f"tools[{i}].type",
                f"tools[{i}]: tools of type {kind!r} are not supported: only function tools are")
        _string(tool, "name", f"tools[{i}]")
        params = tool.get("parameters")
        _refuse(params is not None and not isinstance(params, dict), f"tools[{i}].parameters",
                f"tools[{i}].parameters must be a JSON schema object")
        desc = tool.get("description")
        _refuse(desc is not None and not isinstance(desc, str), f"tools[{i}].description",
                f"tools[{i}].description must be a string")
        out.append({k: tool[k] for k in ("type", "name", "description", "parameters", "strict")
                    if tool.get(k) is not None})
    return out


def _tool_choice(choice: str | dict | None, tools: list[dict]) -> tuple[str | dict, list[dict]]:
    """(the choice as auto / required / none / a named function, the tools it may use)."""
    if choice is None or choice in ("auto", "required", "none"):
        return choice or "auto", tools
    if isinstance(choice, str):
        raise APIError(400, f"tool_choice must be auto, required, none or an object; got {choice!r}",
                       "tool_choice")
    kind = choice.get("type")
    if kind == "function":
        name = _string(choice, "name", "tool_choice")
        _refuse(all(t["name"] != name for t in tools), "tool_choice",
                f"tool_choice names function {name!r}, which is not in tools")
        return {"type": "function", "name": name}, tools
    if kind == "allowed_tools":
        return _allowed_tools(choice, tools)
    raise APIError(400, f"tool_choice of type {kind!r} is not supported: only function tools are", "tool_choice")


def _allowed_tools(choice: dict, tools: list[dict]) -> tuple[str, list[dict]]:
    mode = choice.get("mode", "auto")
    _refuse(mode not in ("auto", "required"), "tool_choice.mode", "tool_choice.mode must be auto or required")
    allowed = choice.get("tools")
    _refuse(not isinstance(allowed, list), "tool_choice.tools", "tool_choice.tools must be a list")
    names = set()
    for i, t in enumerate(allowed):
        _refuse(not isinstance(t, dict) or t.get("type") != "function", f"tool_choice.tools[{i}]",
                "tool_choice.tools may name function tools only")
        names.add(_string(t, "name", f"tool_choice.tools[{i}]"))
    unknown = sorted(names - {t["name"] for t in tools})
    _refuse(bool(unknown), "tool_choice.tools", f"tool_choice.tools names {unknown}, not in tools")
    return mode, [t for t in tools if t["name"] in names]


def _chat_choice(choice: str | dict) -> str | dict:
    if isinstance(choice, dict):
        return {"type": "function", "function": {"name": choice["name"]}}
    return choice


def _text_format(body: ResponsesRequest) -> dict:
    fmt = body.text.format if body.text is not None else None
    if fmt is None:
        return {"type": "text"}
    if fmt.type == "json_schema":
        _refuse(fmt.name is None, "text.format.name", "text.format of type json_schema needs a name")
        _refuse(fmt.schema_ is None, "text.format.schema", "text.format of type json_schema needs a schema")
    return fmt.model_dump(by_alias=True, exclude_none=True)


def _response_format(fmt: dict) -> dict | None:
    if fmt["type"] == "json_schema":
        return {"type": "json_schema", "json_schema": {k: fmt[k] for k in ("name", "schema", "description", "strict")
                                                       if k in fmt}}
    return {"type": "json_object"} if fmt["type"] == "json_object" else None


def _refuse(condition: bool, param: str, message: str) -> None:
    if condition:
        raise APIError(400, message, param)
