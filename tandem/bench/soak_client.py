"""Send one soak case over HTTP and record what came back.

A stream is read to its `[DONE]` (or dropped after a few chunks when the case disconnects);
a non-streamed request is awaited (or cancelled after a delay when the case aborts). The
answer is reduced to what the comparison needs: each choice's text and finish reason.
"""
from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field

import httpx

from tandem.bench.soak_cases import Case


@dataclass
class Outcome:
    index: int
    kind: str
    # completed | disconnected | aborted | refused (4xx) | server_error (5xx) | stream_error
    # (an error event in a 200 stream) | broken (transport failure or a malformed answer)
    result: str
    status: int | None = None
    texts: list[str] = field(default_factory=list)
    finish: list[str | None] = field(default_factory=list)
    error: str = ""


async def send(http: httpx.AsyncClient, base: str, case: Case) -> Outcome:
    url = f"{base}/v1/{case.path}"
    try:
        if case.stream:
            return await _streamed(http, url, case)
        request = http.request(case.method, url, content=case.body, headers=_JSON)
        if case.leave == "abort":
            try:
                resp = await asyncio.wait_for(request, case.after)
            except asyncio.TimeoutError:
                return Outcome(case.index, case.kind, "aborted")
        else:
            resp = await request
        return _whole(case, resp)
    except (httpx.HTTPError, ValueError, KeyError, TypeError, IndexError) as exc:
        return Outcome(case.index, case.kind, "broken", error=f"{type(exc).__name__}: {exc}")


_JSON = {"content-type": "application/json"}


def _refused(case: Case, status: int, text: str) -> Outcome:
    result = "server_error" if status >= 500 else "refused"
    return Outcome(case.index, case.kind, result, status, error=text[:300])


def _whole(case: Case, resp: httpx.Response) -> Outcome:
    if resp.status_code != 200:
        return _refused(case, resp.status_code, resp.text)
    out = Outcome(case.index, case.kind, "completed", 200)
    for choice in sorted(resp.json()["choices"], key=lambda c: c["index"]):
        out.texts.append(choice["message"]["content"] if "message" in choice else choice["text"])
        out.finish.append(choice["finish_reason"])
    return _checked(out, case.choices)


async def _streamed(http: httpx.AsyncClient, url: str, case: Case) -> Outcome:
    texts: dict[int, list[str]] = {}
    finish: dict[int, str | None] = {}
    chunks = 0
    async with http.stream(case.method, url, content=case.body, headers=_JSON) as resp:
        if resp.status_code != 200:
            return _refused(case, resp.status_code, (await resp.aread()).decode(errors="replace"))
        async for line in resp.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                out = Outcome(case.index, case.kind, "completed", 200,
                              ["".join(texts[i]) for i in sorted(texts)], [finish.get(i) for i in sorted(texts)])
                return _checked(out, case.choices)
            msg = json.loads(data)
            if "error" in msg:
                return Outcome(case.index, case.kind, "stream_error", 200, error=json.dumps(msg["error"])[:300])
            for choice in msg.get("choices") or ():
                i = choice["index"]
                piece = choice["delta"].get("content") if "delta" in choice else choice["text"]
                texts.setdefault(i, []).append(piece or "")
                if choice.get("finish_reason") is not None:
                    finish[i] = choice["finish_reason"]
            chunks += 1
            if case.leave == "disconnect" and chunks > case.after:
                return Outcome(case.index, case.kind, "disconnected", 200)  # leaving closes the connection
    return Outcome(case.index, case.kind, "broken", 200, error="stream ended without [DONE]")


def _checked(out: Outcome, choices: int) -> Outcome:
    """A completed answer has every choice, each with a finish reason."""
    if len(out.texts) != choices or any(f is None for f in out.finish):
        out.result, out.error = "broken", f"expected {choices} finished choices, got {out.finish}"
    return out
