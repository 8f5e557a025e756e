"""Every failure leaves as OpenAI's error JSON with the right status; API-key checking."""
from __future__ import annotations

import hmac
import logging

import msgspec
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.exceptions import HTTPException

from tandem.server.body_shape import TOO_DEEP, check_body_shape
from tandem.server.errors import APIError, EngineDead, error_body

log = logging.getLogger("tandem.server")


def _json(body: dict, status: int, headers: dict[str, str] | None = None) -> Response:
    return Response(msgspec.json.encode(body), status, headers=headers, media_type="application/json")


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    """The first problem, said plainly, and the top-level field it concerns."""
    errors = exc.errors()
    if not errors:
        return "invalid request", None
    err = errors[0]
    loc = [str(p) for p in err.get("loc", ()) if p != "body"]
    kind = err.get("type", "")
    if kind == "json_invalid":
        detail = (err.get("ctx") or {}).get("error", "")
        return f"the request body is not valid JSON: {detail}".rstrip(": "), None
    if not loc:
        return "the request body must be a JSON object", None
    if kind == "extra_forbidden":
        return f"unrecognized request argument: {loc[0]}", loc[0]
    if kind == "missing":
        return f"missing required field: {'.'.join(loc)}", loc[0]
    return f"invalid value for {'.'.join(loc)}: {err.get('msg', 'invalid')}", loc[0]


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(_: Request, exc: APIError) -> Response:
        return _json(exc.body(), exc.status, exc.headers)

    @app.exception_handler(EngineDead)
    async def engine_dead(_: Request, exc: EngineDead) -> Response:
        return _json(error_body(503, str(exc)), 503)

    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, exc: RequestValidationError) -> Response:
        message, param = _validation_message(exc)
        return _json(error_body(400, message, param), 400)

    @app.exception_handler(HTTPException)
    async def http_error(_: Request, exc: HTTPException) -> Response:
        if isinstance(exc.__cause__, UnicodeDecodeError):  # FastAPI says only "error parsing the body"
            return _json(error_body(400, f"the request body is not valid UTF-8: {exc.__cause__.reason} at "
                                         f"byte {exc.__cause__.start}"), 400)
        if isinstance(exc.__cause__, RecursionError):  # json.loads of a deeply nested body
            return _json(error_body(400, TOO_DEEP), 400)
        return _json(error_body(exc.status_code, str(exc.detail)), exc.status_code, exc.headers)

    @app.exception_handler(Exception)
    async def unexpected(_: Request, exc: Exception) -> Response:
        log.exception("unhandled error")
        return _json(error_body(500, f"internal error: {type(exc).__name__}"), 500)


DEFAULT_MAX_REQUEST_BYTES = 16 * 2**20
_OPEN_PATHS = frozenset({"/health", "/metrics"})  # probes need no key


class ApiKeyMiddleware:
    """Requires `Authorization: Bearer <key>` everywhere (the API, admin routes, /docs,
    /openapi.json) but on health and metrics, which stay open for probes."""

    def __init__(self, app, api_key: str):
        self.app, self._key = app, api_key.encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"] not in _OPEN_PATHS:
            auth = dict(scope["headers"]).get(b"authorization", b"")
            scheme, _, token = auth.partition(b" ")
            if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), self._key):
                message = "missing API key" if not auth else "incorrect API key"
                body = error_body(401, f"{message}: send 'Authorization: Bearer <key>'", code="invalid_api_key")
                await _json(body, 401, {"WWW-Authenticate": "Bearer"})(scope, receive, send)
                return
        await self.app(scope, receive, send)


class _TooLarge(HTTPException):
    def __init__(self, limit: int):
        super().__init__(413, f"the request body is larger than the server's limit of {limit} bytes "
                              "(--max-request-bytes)")


class BodySizeLimit:
    """413 for a body over `max_bytes`: at once by its Content-Length, else counted as it
    arrives (chunked uploads), before anything parses or keeps it."""

    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope["headers"]).get(b"content-length", b"0")
        if not length.isdigit() or int(length) > self.max_bytes:
            status = 413 if length.isdigit() else 400
            message = str(_TooLarge(self.max_bytes).detail) if status == 413 else "invalid Content-Length"
            await _json(error_body(status, message), status)(scope, receive, send)
            return
        received = 0

        async def limited_receive():
            nonlocal received
            message = await receive()
            received += len(message.get("body", b""))
            if received > self.max_bytes:
                raise _TooLarge(self.max_bytes)  # FastAPI passes HTTPExceptions from body reading on
            return message

        await self.app(scope, limited_receive, send)


class BodyShapeCheck:
    """Reads a POST body whole (inside BodySizeLimit) and refuses it before FastAPI parses it when
    its token ids, logit_bias or messages are certainly too many (`body_shape`): parsing holds
    the event loop, and with it every stream. The body is then handed on unchanged."""

    def __init__(self, app, state):
        self.app, self.state = app, state

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        try:
            body, last = await _whole_body(receive)
            ready = self.state.client.ready
            check_body_shape(body, ready.max_model_len, ready.vocab_size)
        except HTTPException as exc:  # BodySizeLimit's 413, raised from receive
            await _json(error_body(exc.status_code, str(exc.detail)), exc.status_code)(scope, receive, send)
            return
        except APIError as exc:
            await _json(exc.body(), exc.status)(scope, receive, send)
            return
        replayed = False

        async def replay():
            nonlocal replayed
            if replayed:
                return await receive()  # after the body: the disconnect the routes watch for
            replayed = True
            return {**last, "body": body, "more_body": False}

        await self.app(scope, replay, send)


async def _whole_body(receive) -> tuple[bytes, dict]:
    """The body and the last message read (a disconnect ends the reading early)."""
    chunks = []
    while True:
        message = await receive()
        chunks.append(message.get("body", b""))
        if message["type"] != "http.request" or not message.get("more_body"):
            return b"".join(chunks), message
