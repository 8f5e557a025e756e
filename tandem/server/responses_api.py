"""`POST /v1/responses` (OpenAI's Responses API, text), `GET` and `DELETE /v1/responses/{id}`.

A Responses request is run as the chat request it amounts to (`responses_input`): the
chat template, tool grammars, tool-call parsing and structured output are the chat
endpoint's. Its output is told as Responses items and, streamed, as Responses events
(`responses_output`). Answered responses are kept, bounded, in the server state's
`ResponseStore` unless the request says `store: false`, for `previous_response_id`.
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import AsyncIterator, Awaitable, Callable

import msgspec
from fastapi import FastAPI, Request
from fastapi.responses import Response

from tandem.server.errors import APIError, EngineDead
from tandem.server.generation import Generation
from tandem.server.inputs import EngineInputs, chat_inputs
from tandem.server.responses_input import ChatView, chat_view, refuse_unsupported, renamed
from tandem.server.responses_output import ResponseHead, ResponseOutput, as_chat_messages
from tandem.server.responses_schemas import RESPONSES_IGNORED, ResponsesRequest
from tandem.server.reasoning import ReasoningParser
from tandem.server.state import ServerState
from tandem.server.structured import ToolCalls, ToolMode


@dataclass
class RouteKit:
    """What the route shares with the chat route (api.py lends it: api imports this module)."""

    start: Callable[[EngineInputs, str], Awaitable[Generation]]  # a Generation, started (503 while draining)
    unless_disconnected: Callable[[Request, Generation, Awaitable[Response]], Awaitable[Response]]
    stream: Callable[[AsyncIterator[bytes], Generation], Response]  # SSE that aborts what is left when it ends


@dataclass
class _Run:
    """One response being generated: what its body and its stored conversation are made of."""

    head: ResponseHead
    view: ChatView
    inputs: EngineInputs
    tools: ToolMode | None
    store: bool
    reasoning: ReasoningParser | None  # the server's, where the reply is split into reasoning and text

    def output(self) -> ResponseOutput:
        calls = ToolCalls(self.tools) if self.tools is not None else None
        splitter = self.reasoning.splitter() if self.reasoning is not None else None
        return ResponseOutput(self.inputs.prompt_tokens, calls, splitter)


def _json(body: dict, status: int = 200) -> Response:
    return Response(msgspec.json.encode(body), status, media_type="application/json")


def add_responses_routes(app: FastAPI, state: ServerState, kit: RouteKit) -> None:
    @app.post("/v1/responses")
    async def create_response(body: ResponsesRequest, request: Request) -> Response:
        run = await _prepare(state, body)
        gen = await kit.start(run.inputs, "resp")
        run.head.id = "resp_" + gen.request_id.split("-", 1)[1]
        if body.stream:
            return kit.stream(_events(state, gen, run), gen)

        async def work() -> Response:
            return _json(await _whole(state, gen, run))
        return await kit.unless_disconnected(request, gen, work())

    @app.get("/v1/responses/{response_id}")
    async def get_response(response_id: str) -> Response:
        return _json(_stored(state, response_id).response)

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str) -> Response:
        _stored(state, response_id)
        state.responses.delete(response_id)
        return _json({"id": response_id, "object": "response", "deleted": True})


def _stored(state: ServerState, response_id: str):
    entry = state.responses.get(response_id)
    if entry is None:
        raise APIError(404, f"Response with id {response_id!r} not found.", "response_id")
    return entry


async def _prepare(state: ServerState, body: ResponsesRequest) -> _Run:
    state.check_model(body.model)
    state.fields.check(body, RESPONSES_IGNORED)
    refuse_unsupported(body)
    previous = _previous(state, body.previous_response_id)
    try:
        view, tools = chat_view(body, previous, getattr(state.tokenizer, "chat_template", None))
        # Tokenizing runs in a worker thread: a long conversation must not stall every other stream.
        inputs = await asyncio.to_thread(chat_inputs, view.chat, state.tokenizer, state.max_model_len,
                                         state.client.ready.vocab_size, tools, state.reasoning)
    except APIError as exc:
        raise renamed(exc) from None
    return _Run(ResponseHead("", state.model_name, _echo(body, view)), view, inputs, tools, body.store is not False,
                state.reasoning)


def _previous(state: ServerState, response_id: str | None) -> list[dict]:
    if response_id is None:
        return []
    entry = state.responses.get(response_id)
    if entry is None:
        raise APIError(404, f"Previous response with id {response_id!r} not found.", "previous_response_id",
                       "previous_response_not_found")
    return list(entry.conversation)


def _echo(body: ResponsesRequest, view: ChatView) -> dict:
    """The request fields a response object repeats, with OpenAI's defaults."""
    return {"instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
            "max_tool_calls": body.max_tool_calls, "metadata": body.metadata or {},
            "parallel_tool_calls": body.parallel_tool_calls is not False,
            "previous_response_id": body.previous_response_id, "reasoning": {"effort": None, "summary": None},
            "service_tier": "default", "store": body.store is not False,
            "temperature": 1.0 if body.temperature is None else body.temperature,
            "text": {"format": view.text_format}, "tool_choice": view.tool_choice, "tools": view.tools,
            "top_logprobs": 0, "top_p": 1.0 if body.top_p is None else body.top_p, "truncation": "disabled",
            "user": body.user}


async def _whole(state: ServerState, gen: Generation, run: _Run) -> dict:
    out = run.output()
    async for _, d in gen.deltas():
        out.feed(d)
    _, status, why = out.close()
    return _finished(state, run, run.head.body(status, out.items.items, out.usage(), why))


def _finished(state: ServerState, run: _Run, response: dict) -> dict:
    if run.store:
        state.responses.put(response, run.view.history + as_chat_messages(response["output"]))
    return response


async def _events(state: ServerState, gen: Generation, run: _Run) -> AsyncIterator[bytes]:
    """The stream: created, in_progress, the items' events as text arrives, then completed
    (incomplete when cut by max_output_tokens, failed when the engine failed the request)."""
    seq = _Sequence()
    yield seq.event({"type": "response.created", "response": run.head.body("in_progress", [])})
    yield seq.event({"type": "response.in_progress", "response": run.head.body("in_progress", [])})
    out = run.output()
    try:
        async for _, d in gen.deltas():
            for event in out.feed(d):
                yield seq.event(event)
    except (EngineDead, APIError) as exc:  # headers are sent: the failure is the stream's last event
        error = {"code": getattr(exc, "code", None) or "server_error", "message": str(exc)}
        yield seq.event({"type": "response.failed",
                         "response": run.head.body("failed", out.items.items, out.usage(), error=error)})
        return
    events, status, why = out.close()
    for event in events:
        yield seq.event(event)
    response = _finished(state, run, run.head.body(status, out.items.items, out.usage(), why))
    yield seq.event({"type": "response.completed" if status == "completed" else "response.incomplete",
                     "response": response})


class _Sequence:
    """Numbers a stream's events (sequence_number, from 0) and frames them as SSE."""

    def __init__(self) -> None:
        self.next = 0

    def event(self, event: dict) -> bytes:
        event["sequence_number"] = self.next
        self.next += 1
        return b"event: " + event["type"].encode() + b"\ndata: " + msgspec.json.encode(event) + b"\n\n"
