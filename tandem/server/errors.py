"""Errors as OpenAI shapes them: {"error": {"message", "type", "param", "code"}}."""
from __future__ import annotations

import re
from dataclasses import dataclass, field

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
          405: "invalid_request_error", 413: "invalid_request_error", 499: "client_closed_request",
          503: "service_unavailable"}


@dataclass
class APIError(Exception):
    status: int
    message: str
    param: str | None = None
    code: str | None = None
    headers: dict[str, str] = field(default_factory=dict)

    def __str__(self) -> str:
        return self.message

    def body(self) -> dict:
        return error_body(self.status, self.message, self.param, self.code)


# A native library's source location in its messages (xgrammar: "[13:59:27] /project/cpp/
# json_schema_converter.cc:5082: "): nothing a client can act on, and it describes the build.
_NATIVE_LOCATION = re.compile(r"\[\d\d:\d\d:\d\d\] [^\s:]+:\d+: ")


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    kind = _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": _NATIVE_LOCATION.sub("", message), "type": kind, "param": param, "code": code}}


class EngineDead(Exception):
    """The engine process is gone; every in-flight and future request fails with this."""
