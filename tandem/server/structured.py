"""Structured output and tool calls over the OpenAI API.

Request side: `response_format`, SGLang-style `regex` / `ebnf`, vLLM's `structured_outputs`
object and its older `guided_choice` / `guided_regex` / `guided_json` / `guided_grammar`
fields, and `tools` + `tool_choice` become one grammar constraint of SamplingParams (a
choice is an EBNF alternation of its strings, emitted verbatim as vLLM does). For `required` the output is a JSON array of
calls ([{"name": ..., "arguments": {...}}], one item unless `parallel_tool_calls`); for a named
function it is that function's arguments. With `auto` the model writes freely with the tools in
its chat template, and calls are parsed from its text: Qwen/Hermes `<tool_call>{...}</tool_call>`
or a Llama 3.1 JSON object {"name": ..., "parameters": {...}}.

Response side: `ToolCalls` turns a choice's text into `message.tool_calls` (finish_reason
"tool_calls"), and into stream deltas shaped as the official API sends them. A reply cut at
its token limit keeps every call it completed (finish_reason "length"); what it left unfinished
is dropped, never returned as content.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from tandem.server.errors import APIError
from tandem.server.openai_schemas import ChatCompletionRequest, NamedToolChoice, ResponseFormat, Tool

_TRIGGER = "<tool_call>"
# family -> (trigger and start of a call up to the function name, arguments key, end of a call)
_CALL_FORMATS = {"hermes": ('<tool_call>\n{"name": ', "arguments", "}\n</tool_call>"),
                 "llama3": ('{"name": ', "parameters", "}")}
_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)


def _parameters(tool: Tool) -> dict:
    return tool.function.parameters or {"type": "object", "properties": {}}


@dataclass
class ToolMode:
    kind: str  # "named", "required" or "auto"
    tools: list[Tool]
    parallel: bool
    family: str | None = None  # the chat template's call format: "hermes" (Qwen), "llama3", or unknown

    @property
    def names(self) -> set[str]:
        return {t.function.name for t in self.tools}

    def schema(self) -> dict | None:
        """The JSON schema the output is constrained to (None for auto)."""
        if self.kind == "named":
            return _parameters(self.tools[0])
        if self.kind == "required":
            calls = [{"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
                      "properties": {"name": {"const": t.function.name}, "arguments": _parameters(t)}}
                     for t in self.tools]
            return {"type": "array", "minItems": 1, "items": {"anyOf": calls},
                    **({} if self.parallel else {"maxItems": 1})}
        return None

    def grammar(self) -> str | None:
        """auto with a known template: free text, but a started call (`<tool_call>` for
        Hermes/Qwen, `{"name": ` for Llama 3.1) must be a valid call of one of the tools
        (EBNF from xgrammar's triggered structural tag)."""
        tags = self.call_tags()
        return structural_grammar(tags) if tags is not None else None

    def call_tags(self, at_least_one: bool = False) -> dict | None:
        """auto with a known template: the calls as xgrammar's triggered-tags format (with
        `at_least_one` the output must start with a call), else None."""
        if self.kind != "auto" or self.family not in _CALL_FORMATS:
            return None
        trigger, key, end = _CALL_FORMATS[self.family]
        tags = [{"begin": trigger + json.dumps(t.function.name) + f', "{key}": ',
                 "content": {"type": "json_schema", "json_schema": _parameters(t)}, "end": end}
                for t in self.tools]
        single = not self.parallel or self.family == "llama3"  # Llama 3.1 makes one call per turn
        return {"type": "triggered_tags", "triggers": [trigger], "tags": tags, "at_least_one": at_least_one,
                "stop_after_first": single}


@dataclass
class FormatOrCalls(ToolMode):
    """auto tool choice with a known call format and a JSON response format: the output is
    either JSON in the format or the template's tool calls (xgrammar's `or` of both), so an
    agent with an output type still calls its tools."""

    format_schema: dict | str | None = None  # the response format's JSON schema

    def grammar(self) -> str | None:
        import xgrammar as xgr

        calls = xgr.Grammar.from_ebnf(structural_grammar(self.call_tags(at_least_one=True)))
        return str(xgr.Grammar.union(_format_grammar(self.format_schema), calls))


def with_response_format(mode: ToolMode | None, fmt: ResponseFormat | None,
                         unknown_format_ok: bool = False) -> tuple[ToolMode | None, ResponseFormat | None]:
    """The tool mode and the response format left to constrain the output, for a request
    with both: a forced call (required, named) is the output whatever the format; auto on a
    template whose call format is known is JSON in the format or a call. With an unknown call
    format no grammar can allow a call next to the JSON: a 400, or with `unknown_format_ok`
    (the Responses route's way) the JSON alone."""
    if mode is None or fmt is None or fmt.type == "text":
        return mode, fmt
    if mode.kind != "auto":
        return mode, None
    if mode.call_tags() is not None:
        return FormatOrCalls(mode.kind, mode.tools, mode.parallel, mode.family, _format_schema(fmt)), None
    if unknown_format_ok:
        return mode, fmt
    raise APIError(400, "response_format with tools and tool_choice 'auto' needs a chat template whose tool-call "
                        "format is known (Hermes/Qwen <tool_call> or Llama 3.1 JSON), so that the output can be "
                        "JSON in the format or a call; this model's template has neither. Send tool_choice "
                        "'required', a named function or 'none', or leave out response_format", "response_format")


def _format_schema(fmt: ResponseFormat) -> dict | str:
    if fmt.type == "json_object":
        return {"type": "object"}
    if fmt.json_schema is None:
        raise APIError(400, "response_format of type json_schema needs a json_schema", "response_format")
    return fmt.json_schema.schema_ or {"type": "object"}


def _format_grammar(schema: dict | str | None):
    """The format's JSON as the engine compiles a lone response_format (no free whitespace:
    a random or weak model would otherwise pad to its token limit); 400 naming the format."""
    import xgrammar as xgr

    try:
        return xgr.Grammar.from_json_schema(schema if isinstance(schema, str) else json.dumps(schema),
                                            any_whitespace=False)
    except (RuntimeError, ValueError, TypeError) as e:
        raise APIError(400, f"response_format: the schema is not a valid JSON schema: {e}",
                       "response_format") from None


def structural_grammar(fmt: dict) -> str:
    """EBNF of an xgrammar structural-tag format; 400 if a JSON schema in it is invalid."""
    import xgrammar as xgr

    try:
        return str(xgr.Grammar.from_structural_tag(json.dumps({"type": "structural_tag", "format": fmt})))
    except (RuntimeError, ValueError) as e:
        raise APIError(400, f"tools: a function's parameters are not a valid JSON schema: {e}",
                       "tools") from None


def tool_mode(body: ChatCompletionRequest, chat_template: str | None = None) -> ToolMode | None:
    if not body.tools or body.tool_choice == "none":
        return None
    parallel = body.parallel_tool_calls is not False
    choice = body.tool_choice
    if isinstance(choice, NamedToolChoice):
        match = [t for t in body.tools if t.function.name == choice.function.name]
        if not match:
            raise APIError(400, f"tool_choice names function {choice.function.name!r}, which is not in tools",
                           "tool_choice")
        return ToolMode("named", match[:1], parallel)
    return ToolMode("required" if choice == "required" else "auto", body.tools, parallel,
                    _template_family(chat_template or ""))


def _template_family(template: str) -> str | None:
    if "<tool_call>" in template:
        return "hermes"
    if "<|python_tag|>" in template or "Environment: ipython" in template:
        return "llama3"
    return None


def constraint(body, tools: ToolMode | None = None) -> tuple[dict, str | None]:
    """SamplingParams fields (json_schema / regex / grammar) from the request, and the request
    field they came from (a 400 about the constraint names it); 400 if two clash."""
    found: dict[str, tuple[str, object]] = {}
    if body.regex is not None:
        found["regex"] = ("regex", body.regex)
    if body.ebnf is not None:
        found["ebnf"] = ("grammar", body.ebnf)
    fmt = getattr(body, "response_format", None)
    if fmt is not None and fmt.type == "json_object":
        found["response_format"] = ("json_schema", {"type": "object"})
    elif fmt is not None and fmt.type == "json_schema":
        if fmt.json_schema is None:
            raise APIError(400, "response_format of type json_schema needs a json_schema", "response_format")
        found["response_format"] = ("json_schema", fmt.json_schema.schema_ or {"type": "object"})
    found.update(_vllm_constraints(body))
    if tools is not None and tools.schema() is not None:
        found["tools"] = ("json_schema", tools.schema())
    elif tools is not None and tools.grammar() is not None:
        found["tools"] = ("grammar", tools.grammar())
    if len(found) > 1:
        raise APIError(400, f"only one of {', '.join(found)} may constrain the output", list(found)[-1])
    source = next(iter(found), None)
    return dict(found.values()), source


_VLLM_KINDS = ("choice", "regex", "json", "grammar", "json_object")


def _vllm_constraints(body) -> dict[str, tuple[str, object]]:
    """vLLM's structured-output fields, by request field name."""
    found: dict[str, tuple[str, object]] = {}
    outputs = getattr(body, "structured_outputs", None)
    if outputs is not None:
        unknown = sorted(outputs.model_extra or ())
        if unknown:
            raise APIError(400, f"structured_outputs: {', '.join(unknown)} not supported (supported: "
                                f"{', '.join(_VLLM_KINDS)})", "structured_outputs")
        for kind in _VLLM_KINDS:
            value = getattr(outputs, "json_" if kind == "json" else kind)
            if value is not None and value is not False:
                found[f"structured_outputs.{kind}"] = _vllm_constraint(kind, value, f"structured_outputs.{kind}")
    for kind in ("choice", "regex", "json", "grammar"):
        value = getattr(body, f"guided_{kind}", None)
        if value is not None:
            found[f"guided_{kind}"] = _vllm_constraint(kind, value, f"guided_{kind}")
    return found


def _vllm_constraint(kind: str, value, name: str) -> tuple[str, object]:
    if kind == "choice":
        if not value or any(not c for c in value):
            raise APIError(400, f"{name} needs at least one choice, each a non-empty string", name)
        # EBNF string literals take JSON's escapes; non-ASCII stays itself.
        return "grammar", "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in value)
    if kind == "json_object":
        return "json_schema", {"type": "object"}
    return {"regex": "regex", "json": "json_schema", "grammar": "grammar"}[kind], value


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text, as the API sends it
    id: str = ""

    def __post_init__(self) -> None:
        self.id = self.id or f"call_{uuid.uuid4().hex[:24]}"

    def as_dict(self, index: int | None = None) -> dict:
        out = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return out if index is None else {"index": index, **out}


class ToolCalls:
    """One choice's tool-call view of the model's text."""

    def __init__(self, mode: ToolMode):
        self.mode = mode
        self.text: list[str] = []
        self.sent = 0  # characters of text already streamed as content
        self.named_call: ToolCall | None = None
        self.scanned = 0  # required: where the array's next item starts (complete_array_items)
        self.streamed = 0  # required: the calls sent

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content, calls) of a choice's text, which may be cut short (finish_reason
        "length"): every complete call is a call. `required` text is the grammar's JSON array
        of calls, never content; other unparsable text stays content."""
        if self.mode.kind == "named":
            return None, [ToolCall(self.mode.tools[0].function.name, text)]
        if self.mode.kind == "required":
            return None, self._required_calls(complete_array_items(text)[0])
        return self._parse_auto(text)

    def _required_calls(self, items: list) -> list[ToolCall]:
        return [ToolCall(c["name"], json.dumps(c["arguments"], ensure_ascii=False)) for c in items
                if isinstance(c, dict) and c.get("name") in self.mode.names and "arguments" in c]

    def _parse_auto(self, text: str) -> tuple[str | None, list[ToolCall]]:
        calls = []
        for raw in _HERMES.findall(text):
            call = self._call(raw, "arguments")
            if call is not None:
                calls.append(call)
        if calls:
            content = text[:text.find("<tool_call>")].strip()
            return content or None, calls if self.mode.parallel else calls[:1]
        call = self._call(text.strip(), "parameters")  # Llama 3.1: the whole reply is one call
        return (None, [call]) if call is not None else (text, [])

    def _call(self, raw: str, key: str) -> ToolCall | None:
        try:
            obj = json.loads(raw)
        except json.JSONDecodeError:
            return None
        if not isinstance(obj, dict) or obj.get("name") not in self.mode.names:
            return None
        args = obj.get(key, obj.get("arguments", obj.get("parameters", {})))
        return ToolCall(obj["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False))

    def message(self, text: str, finish_reason: str | None) -> tuple[dict, str | None]:
        content, calls = self.parse(text)
        if not calls:
            return {"role": "assistant", "content": content}, finish_reason
        return ({"role": "assistant", "content": content, "tool_calls": [c.as_dict() for c in calls]},
                "tool_calls" if finish_reason == "stop" else finish_reason)

    # ---- streaming: a list of delta dicts per engine delta ----
    def stream(self, text: str, finished: bool, finish_reason: str | None) -> tuple[list[dict], str | None]:
        """Named calls stream their arguments as they come; required calls are sent each
        whole as soon as it is complete; auto streams text up to where a call may start, and
        its calls once the choice finished, whole."""
        if self.mode.kind == "named":
            out = []
            if self.named_call is None:
                self.named_call = ToolCall(self.mode.tools[0].function.name, "")
                out.append({"tool_calls": [self.named_call.as_dict(0)]})
            if text:
                out.append({"tool_calls": [{"index": 0, "function": {"arguments": text}}]})
            return out, ("tool_calls" if finish_reason == "stop" else finish_reason) if finished else None
        if self.mode.kind == "required":
            return self._stream_required(text, finished, finish_reason)
        self.text.append(text)
        full = "".join(self.text)
        if not finished:
            safe = self._safe_end(full) if self.mode.kind == "auto" else self.sent
            out, self.sent = full[self.sent:safe], max(self.sent, safe)
            return ([{"content": out}] if out else []), None
        message, reason = self.message(full, finish_reason)
        if "tool_calls" not in message:
            rest = full[self.sent:]
            return ([{"content": rest}] if rest or not self.sent else []), reason
        deltas = [{"tool_calls": [{**c, "index": i}]} for i, c in enumerate(message["tool_calls"])]
        if message["content"] and not self.sent:
            deltas.insert(0, {"content": message["content"]})
        return deltas, reason

    def _stream_required(self, text: str, finished: bool,
                         finish_reason: str | None) -> tuple[list[dict], str | None]:
        self.text.append(text)
        full = "".join(self.text)
        items, self.scanned = complete_array_items(full, self.scanned)
        calls = self._required_calls(items)
        deltas = [{"tool_calls": [c.as_dict(self.streamed + i)]} for i, c in enumerate(calls)]
        self.streamed += len(calls)
        if not finished:
            return deltas, None
        return deltas, "tool_calls" if finish_reason == "stop" and self.streamed else finish_reason

    @staticmethod
    def _safe_end(full: str) -> int:
        """How much of the text so far is content for sure: not a (possible) call's start."""
        if full.lstrip().startswith("{"):
            return 0  # may be a Llama 3.1 call: hold it all
        at = full.find(_TRIGGER)
        if at >= 0:
            return at
        for k in range(len(_TRIGGER) - 1, 0, -1):  # a trigger may be arriving token by token
            if full.endswith(_TRIGGER[:k]):
                return len(full) - k
        return len(full)


_ITEM_GAP = re.compile(r"[\s,\[]*")  # between a JSON array's start or items


def complete_array_items(text: str, start: int = 0) -> tuple[list, int]:
    """The complete items of JSON array text that may be cut short (a reply at its token
    limit), from offset `start` (0, or where an earlier call left off), and the offset after
    the last complete item: items are objects, so an item that decodes is complete."""
    items, at, decoder = [], start, json.JSONDecoder()
    while True:
        at_item = _ITEM_GAP.match(text, at).end()
        try:
            item, end = decoder.raw_decode(text, at_item)
        except json.JSONDecodeError:
            return items, at
        items.append(item)
        at = end
