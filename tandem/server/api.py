"""The FastAPI app: OpenAI endpoints, health and metrics (the error mapping is in errors_http).

A request is tokenized and checked here, then handed to the engine as one
engine request per choice (`Generation`). A client that goes away aborts its
unfinished choices at once: streaming through the response's cleanup, non-
streaming by racing the work against the ASGI disconnect message.
"""
from __future__ import annotations

import asyncio
import logging
import os
import uuid
from dataclasses import dataclass
from typing import Any, AsyncIterator

import msgspec
from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST

from tandem import __version__
from tandem.server import protocol as P
from tandem.server.errors import APIError, EngineDead, error_body
from tandem.server.echo import Echo, EchoGate
from tandem.server.errors_http import (DEFAULT_MAX_REQUEST_BYTES, ApiKeyMiddleware, BodyShapeCheck,
                                       BodySizeLimit, install_error_handlers)
from tandem.server.generation import Generation
from tandem.server.inputs import EngineInputs, chat_inputs, completion_inputs
from tandem.server.openai_schemas import ChatCompletionRequest, CompletionRequest, StreamOptions
from tandem.server.reasoning import ReasoningSplitter, Split, thinking_requested
from tandem.server.responses import (Choice, Envelope, TokenNames, best_choices, chat_logprobs,
                                     share_prompt_logprobs, usage, with_reasoning)
from tandem.server.responses_api import RouteKit, add_responses_routes
from tandem.server.structured import ToolCalls, ToolMode, tool_mode, with_response_format
from tandem.server.state import ServerState
from tandem.server.tokenize import add_tokenizer_routes

log = logging.getLogger("tandem.server")

def _json(body: dict, status: int = 200) -> Response:
    return Response(msgspec.json.encode(body), status, media_type="application/json")


def _sse(body: dict) -> bytes:
    return b"data: " + msgspec.json.encode(body) + b"\n\n"


class _AbortingStream(StreamingResponse):
    """A stream whose unfinished engine requests are aborted however the response ends."""

    def __init__(self, content: AsyncIterator[bytes], gen: Generation):
        super().__init__(_guarded(content), media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._gen = gen

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._gen.abort()


async def _guarded(content: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """Once headers are sent, a failure can only be told as the stream's last event: without
    this the client sees a cut connection (and the handler's own 500 comes too late)."""
    try:
        async for chunk in content:
            yield chunk
    except Exception as exc:
        log.exception("unhandled error in a stream")
        yield _sse(error_body(500, f"internal error: {type(exc).__name__}"))


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


async def _collect(gen: Generation, splitters: list[ReasoningSplitter] | None = None) -> list[Choice]:
    choices = [Choice(reasoning=s) for s in splitters] if splitters else [Choice() for _ in gen.rids]
    async for index, delta in gen.deltas():
        choices[index].add(delta)
    return choices


@dataclass
class _StreamUsage:
    """stream_options: usage in a last chunk (OpenAI) and/or in every chunk (vLLM)."""

    prompt_tokens: int
    samples: int  # sequences per prompt: a prompt's cached tokens count once
    final: bool = False
    continuous: bool = False
    completion_tokens: int = 0
    cached_tokens: int = 0
    splitters: list[ReasoningSplitter] | None = None  # where a reasoning parser runs: its counts

    @staticmethod
    def of(options: StreamOptions | None, inputs: EngineInputs,
           splitters: list[ReasoningSplitter] | None = None) -> "_StreamUsage":
        if options is None:
            return _StreamUsage(inputs.prompt_tokens, inputs.samples, splitters=splitters)
        return _StreamUsage(inputs.prompt_tokens, inputs.samples, bool(options.include_usage),
                            bool(options.continuous_usage_stats), splitters=splitters)

    def count(self, index: int, d: P.Delta) -> None:
        self.completion_tokens += len(d.token_ids)
        self.cached_tokens += d.cached_tokens if d.finished and index % self.samples == 0 else 0

    def add(self, chunk: dict) -> dict:
        if self.continuous:
            chunk["usage"] = usage(self.prompt_tokens, self.completion_tokens, self.cached_tokens,
                                   _reasoning_tokens(self.splitters))
        return chunk

    def chunk(self, env: Envelope, kind: str) -> dict:
        return env.usage_chunk(kind, self.prompt_tokens, self.completion_tokens, self.cached_tokens,
                               _reasoning_tokens(self.splitters))


def _reasoning_tokens(splitters: list[ReasoningSplitter] | None) -> int | None:
    """Every sequence's reasoning tokens (best_of's discarded ones too, like completion_tokens)."""
    return None if splitters is None else sum(s.reasoning_tokens for s in splitters)


def _echo(body: CompletionRequest, inputs: EngineInputs, tokenizer: Any) -> Echo:
    """Each prompt's text and ids, to put in front of its choices."""
    prompts = [body.prompt] if isinstance(body.prompt, str) else body.prompt
    if prompts and isinstance(prompts[0], int):
        prompts = [prompts]
    texts = [p if isinstance(p, str) else tokenizer.decode(p) if tokenizer is not None else "" for p in prompts]
    return Echo(texts, inputs.prompts[::inputs.samples], inputs.n, inputs.with_logprobs, inputs.echo_only)


def create_app(state: ServerState, api_key: str | None = None,
               max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES) -> FastAPI:
    app = FastAPI(title="tandem", version=__version__,
                  description="OpenAI-compatible server of the tandem inference engine")
    install_error_handlers(app)
    app.add_middleware(BodyShapeCheck, state=state)  # inside the size limit: it reads the body whole
    app.add_middleware(BodySizeLimit, max_bytes=max_request_bytes)
    if api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=api_key)

    async def start(inputs: EngineInputs, prefix: str) -> Generation:
        if state.draining:
            raise APIError(503, "the server is shutting down", code="shutting_down")
        gen = Generation(state.client, f"{prefix}-{uuid.uuid4().hex}", inputs.prompts, inputs.params)
        await gen.start()
        return gen

    async def finished(gen: Generation, inputs: EngineInputs,
                       splitters: list[ReasoningSplitter] | None = None) -> tuple[list[Choice], int, int]:
        """The answered choices (best_of keeps the n likeliest), the tokens generated for all,
        and the prompt tokens the prefix cache served (once per prompt, like the prompt)."""
        choices = await _collect(gen, splitters)
        share_prompt_logprobs(choices, inputs.samples)
        return (best_choices(choices, inputs.samples, inputs.n), sum(c.num_tokens for c in choices),
                sum(c.cached_tokens for c in choices[::inputs.samples]))

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        state.check_model(body.model)
        state.fields.check(body)
        # Tokenizing runs in a worker thread: a long prompt must not stall every other stream.
        inputs = await asyncio.to_thread(completion_inputs, body, state.tokenizer, state.max_model_len,
                                         state.client.ready.vocab_size)
        echo = _echo(body, inputs, state.tokenizer) if body.echo else None
        gen = await start(inputs, "cmpl")
        env, stream_usage = Envelope(gen.request_id, state.model_name), _StreamUsage.of(
            body.stream_options, inputs)
        if body.stream:
            return _AbortingStream(_completion_stream(gen, env, state.names, stream_usage, echo), gen)

        async def work() -> Response:
            choices, tokens, cached = await finished(gen, inputs)
            echoed = echo.finish(choices) if echo else None
            return _json(env.completion(choices, state.names, inputs.with_logprobs, inputs.prompt_tokens,
                                        0 if inputs.echo_only else tokens, cached, echoed,
                                        inputs.with_prompt_logprobs))
        return await _unless_disconnected(request, gen, work())

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        state.check_model(body.model)
        state.fields.check(body)
        # An unknown call format leaves the JSON only, as without a format such tools are never
        # called (and as the Responses route does): a request that worked keeps working.
        tools, body.response_format = with_response_format(
            tool_mode(body, getattr(state.tokenizer, "chat_template", None)), body.response_format,
            unknown_format_ok=True)
        thinking = thinking_requested(body.chat_template_kwargs)
        inputs = await asyncio.to_thread(chat_inputs, body, state.tokenizer, state.max_model_len,
                                         state.client.ready.vocab_size, tools,
                                         state.reasoning if thinking else None)
        gen = await start(inputs, "chatcmpl")
        splitters = [state.reasoning.splitter(thinking) for _ in gen.rids] if state.reasoning else None
        env, stream_usage = Envelope(gen.request_id, state.model_name), _StreamUsage.of(
            body.stream_options, inputs, splitters)
        if body.stream:
            return _AbortingStream(_chat_stream(gen, env, state.names, stream_usage, tools, splitters), gen)

        async def work() -> Response:
            choices, tokens, cached = await finished(gen, inputs, splitters)
            out = env.chat(choices, state.names, inputs.with_logprobs, inputs.prompt_tokens, tokens, cached,
                           _reasoning_tokens(splitters), inputs.with_prompt_logprobs)
            if tools is not None:  # the model's text (after its reasoning) as tool calls
                for c, item in zip(choices, out["choices"]):
                    text = c.reasoning.content if c.reasoning else "".join(c.text)
                    message, item["finish_reason"] = ToolCalls(tools).message(text, c.finish_reason)
                    item["message"] = with_reasoning(message, c.reasoning.reasoning) if c.reasoning else message
            return _json(out)
        return await _unless_disconnected(request, gen, work())

    add_responses_routes(app, state, RouteKit(start, _unless_disconnected, _AbortingStream))

    @app.get("/v1/models")
    async def models() -> Response:
        return _json({"object": "list", "data": [state.model_card()]})

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> Response:
        state.check_model(model_id)
        return _json(state.model_card())

    @app.get("/version")
    async def version() -> Response:
        return _json({"version": __version__})

    @app.get("/server_info")
    async def server_info() -> Response:
        """The configuration in effect, like SGLang's /get_server_info."""
        return _json({"version": __version__, "model": state.model_name, "max_model_len": state.max_model_len,
                      "engine": state.client.ready.resolved, **state.server_info})

    add_tokenizer_routes(app, state)

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache() -> Response:
        """Drop every cached prefix no running request uses (e.g. after changing weights)."""
        state.client.reset_prefix_cache()
        return _json({"status": "ok"})

    @app.get("/health")
    async def health() -> Response:
        if state.client.dead:
            return _json(error_body(503, state.client.dead), 503)
        if state.draining:  # load balancers stop sending here while the requests finish
            return _json(error_body(503, "the server is shutting down", code="shutting_down"), 503)
        # server_pid: a launcher that picked the port tells its own server from another one there
        return _json({"status": "ok", "server_pid": os.getpid(), "engine_pid": state.client.proc.pid})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return app


def _stream_error(exc: EngineDead | APIError) -> dict:
    return exc.body() if isinstance(exc, APIError) else error_body(503, str(exc))


async def _completion_stream(gen: Generation, env: Envelope, names: TokenNames, usage: _StreamUsage,
                             echo: Echo | None) -> AsyncIterator[bytes]:
    """Each engine delta as a chunk; with echo, a choice's prompt first (EchoGate)."""
    offsets = [0] * len(gen.rids)
    gate = EchoGate(echo) if echo is not None else None
    try:
        async for index, d in gen.deltas():
            for i, echoed, delta in gate.feed(index, d) if gate else [(index, None, d)]:
                if echoed is not None:  # the prompt, and with logprobs its tokens' logprobs
                    text = echo.texts[i // echo.n]
                    lps = [] if echo.with_logprobs else None
                    chunk = env.completion_chunk(i, P.Delta("", [], text, False, None, lps), names, 0, echoed)
                    yield _sse(usage.add(chunk))
                    offsets[i] = len(text)
                    continue
                delta = echo.generated(delta) if echo is not None else delta
                if delta is None:
                    continue
                usage.count(i, delta)
                yield _sse(usage.add(env.completion_chunk(i, delta, names, offsets[i])))
                offsets[i] += len(delta.text)
    except (EngineDead, APIError) as exc:  # headers are sent: the error is the stream's last event
        yield _sse(_stream_error(exc))
        return
    if usage.final:
        yield _sse(usage.chunk(env, "text_completion"))
    yield b"data: [DONE]\n\n"


async def _chat_stream(gen: Generation, env: Envelope, names: TokenNames, usage: _StreamUsage,
                       tools: ToolMode | None = None,
                       splitters: list[ReasoningSplitter] | None = None) -> AsyncIterator[bytes]:
    """Chunks of each engine delta: its reasoning (where a parser runs) as `reasoning_content`
    and `reasoning`, then its content, or the tool-call deltas made from the content."""
    calls = [ToolCalls(tools) for _ in gen.rids] if tools is not None else None
    for index in range(len(gen.rids)):
        yield _sse(usage.add(env.chat_chunk(index, {"role": "assistant", "content": None if calls else ""})))
    try:
        async for index, d in gen.deltas():
            usage.count(index, d)
            lps = chat_logprobs(d.logprobs, names) if d.logprobs is not None else None
            part = splitters[index].feed(d.text, d.token_ids, d.finished) if splitters else Split(content=d.text)
            if calls is not None:
                if part.reasoning:
                    yield _sse(usage.add(env.chat_chunk(index, with_reasoning({}, part.reasoning))))
                deltas, reason = calls[index].stream(part.content, d.finished, d.finish_reason)
                for i, delta in enumerate(deltas):
                    yield _sse(usage.add(env.chat_chunk(index, delta, reason if i == len(deltas) - 1 else None)))
                if d.finished and not deltas:
                    yield _sse(usage.add(env.chat_chunk(index, {}, reason)))
                continue
            delta = with_reasoning({}, part.reasoning) if part.reasoning else {}
            if part.content or (d.token_ids and not part.reasoning):
                delta["content"] = part.content
            chunk = env.chat_chunk(index, delta, d.finish_reason if d.finished else None, lps)
            yield _sse(usage.add(chunk))
    except (EngineDead, APIError) as exc:  # headers are sent: the error is the stream's last event
        yield _sse(_stream_error(exc))
        return
    if usage.final:
        yield _sse(usage.chunk(env, "chat.completion.chunk"))
    yield b"data: [DONE]\n\n"
