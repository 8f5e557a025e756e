"""The FastAPI app: OpenAI endpoints, health and metrics (the error mapping is in errors_http).

A request is tokenized and checked here, then handed to the engine as one
engine request per choice (`Generation`). A client that goes away aborts its
unfinished choices at once: streaming through the response's cleanup, non-
streaming by racing the work against the ASGI disconnect message.
"""
from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass
from typing import Any, AsyncIterator

import msgspec
from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST

from tandem.server.client import EngineClient
from tandem.server.errors import APIError, EngineDead, error_body
from tandem.server.errors_http import (DEFAULT_MAX_REQUEST_BYTES, ApiKeyMiddleware, BodySizeLimit,
                                       install_error_handlers)
from tandem.server.generation import Generation
from tandem.server.inputs import chat_inputs, completion_inputs
from tandem.server.metrics import Metrics
from tandem.server.openai_schemas import ChatCompletionRequest, CompletionRequest
from tandem.server.responses import Choice, Envelope, TokenNames, chat_logprobs
from tandem.server.structured import ToolCalls, ToolMode, tool_mode


@dataclass
class ServerState:
    client: EngineClient
    tokenizer: Any
    model_name: str
    model_aliases: frozenset[str]  # other names accepted in "model" (the path it was loaded from)
    metrics: Metrics
    draining: bool = False  # shutting down: no new generations

    def __post_init__(self) -> None:
        self.names = TokenNames(self.tokenizer)

    @property
    def max_model_len(self) -> int:
        return self.client.ready.max_model_len

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name and model not in self.model_aliases:
            raise APIError(404, f"the model {model!r} does not exist; this server serves "
                                f"{self.model_name!r}", "model", "model_not_found")


def _json(body: dict, status: int = 200) -> Response:
    return Response(msgspec.json.encode(body), status, media_type="application/json")


def _sse(body: dict) -> bytes:
    return b"data: " + msgspec.json.encode(body) + b"\n\n"


class _AbortingStream(StreamingResponse):
    """A stream whose unfinished engine requests are aborted however the response ends."""

    def __init__(self, content: AsyncIterator[bytes], gen: Generation):
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._gen = gen

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._gen.abort()


async def _until_disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _unless_disconnected(request: Request, gen: Generation, work) -> Response:
    """Run `work` (non-streaming); if the client leaves first, abort the engine requests."""
    task, watch = asyncio.ensure_future(work), asyncio.ensure_future(_until_disconnected(request))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
            gen.abort()
    if not task.done() or task.cancelled():
        return _json(error_body(499, "client closed the request"), 499)
    return task.result()


async def _collect(gen: Generation) -> list[Choice]:
    choices = [Choice() for _ in gen.rids]
    async for index, delta in gen.deltas():
        choices[index].add(delta)
    return choices


def _prompt_tokens(prompts: list[list[int]], n: int) -> int:
    return sum(len(p) for p in prompts[::n])  # a prompt counts once however many choices it has


def _cached_tokens(choices: list[Choice], n: int) -> int:
    return sum(c.cached_tokens for c in choices[::n])  # like the prompt: once per prompt


def create_app(state: ServerState, api_key: str | None = None,
               max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES) -> FastAPI:
    app = FastAPI(title="tandem", version="0.1.0",
                  description="OpenAI-compatible server of the tandem inference engine")
    install_error_handlers(app)
    app.add_middleware(BodySizeLimit, max_bytes=max_request_bytes)
    if api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=api_key)

    async def start(prompts: list[list[int]], params, prefix: str) -> Generation:
        if state.draining:
            raise APIError(503, "the server is shutting down", code="shutting_down")
        gen = Generation(state.client, f"{prefix}-{uuid.uuid4().hex}", prompts, params)
        await gen.start()
        return gen

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        state.check_model(body.model)
        # Tokenizing runs in a worker thread: a long prompt must not stall every other stream.
        prompts, params = await asyncio.to_thread(completion_inputs, body, state.tokenizer, state.max_model_len,
                                                  state.client.ready.vocab_size)
        gen = await start(prompts, params, "cmpl")
        env, n_prompt = Envelope(gen.request_id, state.model_name), _prompt_tokens(prompts, body.n)
        if body.stream:
            usage = body.stream_options is not None and body.stream_options.include_usage
            return _AbortingStream(_completion_stream(gen, env, state.names, usage, n_prompt, body.n), gen)

        async def work() -> Response:
            choices = await _collect(gen)
            return _json(env.completion(choices, state.names, body.logprobs is not None, n_prompt,
                                        _cached_tokens(choices, body.n)))
        return await _unless_disconnected(request, gen, work())

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        state.check_model(body.model)
        tools = tool_mode(body, getattr(state.tokenizer, "chat_template", None))
        prompts, params = await asyncio.to_thread(chat_inputs, body, state.tokenizer, state.max_model_len, tools)
        gen = await start(prompts, params, "chatcmpl")
        env, n_prompt = Envelope(gen.request_id, state.model_name), _prompt_tokens(prompts, body.n)
        if body.stream:
            usage = body.stream_options is not None and body.stream_options.include_usage
            return _AbortingStream(_chat_stream(gen, env, state.names, usage, n_prompt, body.n, tools), gen)

        async def work() -> Response:
            choices = await _collect(gen)
            out = env.chat(choices, state.names, body.logprobs, n_prompt, _cached_tokens(choices, body.n))
            if tools is not None:  # the model's text as tool calls
                for c, item in zip(choices, out["choices"]):
                    item["message"], item["finish_reason"] = ToolCalls(tools).message("".join(c.text),
                                                                                      c.finish_reason)
            return _json(out)
        return await _unless_disconnected(request, gen, work())

    @app.get("/v1/models")
    async def models() -> Response:
        card = {"id": state.model_name, "object": "model", "created": 0, "owned_by": "tandem",
                "max_model_len": state.max_model_len}
        return _json({"object": "list", "data": [card]})

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache() -> Response:
        """Drop every cached prefix no running request uses (e.g. after changing weights)."""
        state.client.reset_prefix_cache()
        return _json({"status": "ok"})

    @app.get("/health")
    async def health() -> Response:
        if state.client.dead:
            return _json(error_body(503, state.client.dead), 503)
        return _json({"status": "ok", "engine_pid": state.client.proc.pid})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return app


async def _completion_stream(gen: Generation, env: Envelope, names: TokenNames, include_usage: bool,
                             prompt_tokens: int, n: int) -> AsyncIterator[bytes]:
    offsets, tokens, cached = [0] * len(gen.rids), 0, 0
    try:
        async for index, d in gen.deltas():
            tokens += len(d.token_ids)
            cached += d.cached_tokens if d.finished and index % n == 0 else 0
            yield _sse(env.completion_chunk(index, d, names, offsets[index]))
            offsets[index] += len(d.text)
    except EngineDead as exc:
        yield _sse(error_body(503, str(exc)))
        return
    if include_usage:
        yield _sse(env.usage_chunk("text_completion", prompt_tokens, tokens, cached))
    yield b"data: [DONE]\n\n"


async def _chat_stream(gen: Generation, env: Envelope, names: TokenNames, include_usage: bool,
                       prompt_tokens: int, n: int, tools: ToolMode | None = None) -> AsyncIterator[bytes]:
    tokens, cached = 0, 0
    calls = [ToolCalls(tools) for _ in gen.rids] if tools is not None else None
    for index in range(len(gen.rids)):
        yield _sse(env.chat_chunk(index, {"role": "assistant", "content": None if calls else ""}))
    try:
        async for index, d in gen.deltas():
            tokens += len(d.token_ids)
            cached += d.cached_tokens if d.finished and index % n == 0 else 0
            lps = chat_logprobs(d.logprobs, names) if d.logprobs is not None else None
            if calls is not None:
                deltas, reason = calls[index].stream(d.text, d.finished, d.finish_reason)
                for i, delta in enumerate(deltas):
                    yield _sse(env.chat_chunk(index, delta, reason if i == len(deltas) - 1 else None))
                if d.finished and not deltas:
                    yield _sse(env.chat_chunk(index, {}, reason))
                continue
            delta = {"content": d.text} if d.text or d.token_ids else {}
            yield _sse(env.chat_chunk(index, delta, d.finish_reason if d.finished else None, lps))
    except EngineDead as exc:
        yield _sse(error_body(503, str(exc)))
        return
    if include_usage:
        yield _sse(env.usage_chunk("chat.completion.chunk", prompt_tokens, tokens, cached))
    yield b"data: [DONE]\n\n"
