"""The soak's canary: one greedy stream after another beside the fuzzed traffic, timed.

Each canary asks for a long answer (EOS ignored) and records when every chunk arrived. Its
longest wait between two chunks is what a user streaming beside the traffic felt: a request
that stalls the engine loop or the front end's event loop shows up here, whatever it was.
The wait for the first chunk (queueing behind admitted prompts) is reported apart.
"""
from __future__ import annotations

import asyncio
import json
import time
from dataclasses import asdict, dataclass, field

import httpx


@dataclass
class CanaryReport:
    streams: int = 0  # canaries that reached [DONE]
    failed: int = 0  # canaries that got anything but a complete stream
    chunks: int = 0
    longest_gap_s: float = 0.0  # between two chunks of one stream
    longest_gap_at_s: float = 0.0  # when it ended, seconds into the soak
    longest_first_chunk_s: float = 0.0
    gaps_over_1s: int = 0
    errors: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


class Canary:
    def __init__(self, base: str, model: str, max_tokens: int = 256):
        self.url = f"{base}/v1/completions"
        self.body = json.dumps({"model": model, "prompt": "the river and the stone", "max_tokens": max_tokens,
                                "temperature": 0, "ignore_eos": True, "stream": True}).encode()
        self.report = CanaryReport()
        self.start = time.monotonic()

    async def run(self, stop: asyncio.Event) -> None:
        """Canaries back to back until `stop` is set (the one in flight is finished)."""
        async with httpx.AsyncClient(timeout=httpx.Timeout(600)) as http:
            while not stop.is_set():
                await self._one(http)

    async def _one(self, http: httpx.AsyncClient) -> None:
        r, sent = self.report, time.monotonic()
        last: float | None = None
        try:
            async with http.stream("POST", self.url, content=self.body,
                                   headers={"content-type": "application/json"}) as resp:
                if resp.status_code != 200:
                    raise RuntimeError(f"status {resp.status_code}: {(await resp.aread())[:200]!r}")
                async for line in resp.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    now = time.monotonic()
                    if line[5:].strip() == "[DONE]":
                        r.streams += 1
                        return
                    if '"error"' in line:
                        raise RuntimeError(line[:300])
                    self._chunk(now, sent, last)
                    last = now
            raise RuntimeError("stream ended without [DONE]")
        except (httpx.HTTPError, RuntimeError) as exc:
            r.failed += 1
            if len(r.errors) < 20:
                r.errors.append(f"{type(exc).__name__}: {exc}")
            await asyncio.sleep(0.5)  # a server that refuses is not hammered

    def _chunk(self, now: float, sent: float, last: float | None) -> None:
        r = self.report
        r.chunks += 1
        if last is None:
            r.longest_first_chunk_s = max(r.longest_first_chunk_s, now - sent)
            return
        gap = now - last
        r.gaps_over_1s += gap > 1.0
        if gap > r.longest_gap_s:
            r.longest_gap_s, r.longest_gap_at_s = gap, now - self.start
