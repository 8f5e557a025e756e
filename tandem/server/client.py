"""The front end's handle on the engine process: start it, feed it, route what it sends back.

Front end -> engine goes through a plain (non-async) PUSH socket: a send never
blocks (no high-water mark) and works from cleanup code of a cancelled task,
which is where client-disconnect aborts come from. Engine -> front end is read
by one asyncio task that routes each delta to the queue of the HTTP request
that owns it and feeds the metrics. Once it has the tokenizer (`use_tokenizer`),
it also makes the text of every request without stop strings (`_Tracked.text`),
so the engine process does not.
"""
from __future__ import annotations

import asyncio
import logging
import multiprocessing
import shutil
import tempfile
import time
from dataclasses import dataclass, field

import msgspec
import zmq
import zmq.asyncio

from tandem.config import EngineConfig
from tandem.server import protocol as P
from tandem.server.engine_process import run_engine
from tandem.server.errors import APIError, EngineDead
from tandem.server.metrics import Metrics
from tandem.text import RequestText, token_pieces

log = logging.getLogger("tandem.server")


# A reader that stopped reading: the deltas buffered for one HTTP request, counted in
# tokens plus top-logprob entries (~100 B each here), before its generation is aborted.
# ~6 MiB; a reader keeping pace holds about one step's deltas.
MAX_UNREAD_ENTRIES = 2**16


def delta_weight(d: P.Delta) -> int:
    """What a buffered delta holds, in tokens and top-logprob entries."""
    return len(d.token_ids) + sum(len(lp.top) for lp in d.logprobs or ())


class DeltaQueue(asyncio.Queue):
    """One HTTP request's deltas (all its choices), counting what is buffered unread. The
    engine side never waits on it (put_nowait from the read loop); the bound is checked there."""

    def __init__(self) -> None:
        super().__init__()
        self.unread = 0
        self.overflowed = False

    def put_delta(self, item: tuple[int, P.Delta]) -> None:
        self.unread += delta_weight(item[1])
        self.put_nowait(item)

    def take(self, item: object) -> object:
        """Account for an item the reader got (call on each `get`)."""
        if isinstance(item, tuple):
            self.unread -= delta_weight(item[1])
        return item


def slow_reader_error() -> APIError:
    return APIError(429, f"the client read the stream too slowly: more than {MAX_UNREAD_ENTRIES} tokens and "
                         "logprob entries waited unread, so the request was stopped", code="slow_reader")


@dataclass
class _Tracked:
    """A submitted engine request the front end still expects output for."""

    queue: DeltaQueue
    index: int  # the choice index inside its HTTP request
    num_prompt_tokens: int
    accepted: asyncio.Future
    arrival: float = field(default_factory=time.monotonic)
    last_token: float | None = None
    text: RequestText | None = None  # the front end makes its text (from Delta.text_ids); None: the engine


# --restart-engine: an engine that dies within this many seconds of its start is restarted
# only after a back-off (doubling up to RESTART_MAX_DELAY_S), so a crash loop does not spin.
RESTART_QUICK_DEATH_S = 30.0
RESTART_MAX_DELAY_S = 30.0


class EngineClient:
    def __init__(self, config: EngineConfig, max_waiting: int, metrics: Metrics, gpus: str | None = None,
                 restart: bool = False):
        self.config, self.max_waiting, self.metrics, self.gpus = config, max_waiting, metrics, gpus
        self.restart = restart  # start a new engine process when one dies
        self.ready: P.Ready | None = None
        self.dead: str | None = None  # why the engine is gone, once it is
        self._failure: str | None = None  # the engine's own last word (its first fatal error)
        self._tracked: dict[str, _Tracked] = {}
        self._closing = False
        self.proc: multiprocessing.process.BaseProcess | None = None
        self._started_at = 0.0
        self._quick_deaths = 0
        self._restarting: asyncio.Task | None = None
        self._transport_open = False
        self._tokenizer = self._pieces = None  # set by use_tokenizer: then the front end detokenizes

    def use_tokenizer(self, tokenizer) -> None:
        """From now on, requests without stop strings are detokenized here, not in the engine."""
        self._tokenizer, self._pieces = tokenizer, token_pieces(tokenizer)

    # ---- lifecycle ----
    async def start(self) -> P.Ready:
        """Start the engine process and wait until its model is loaded."""
        self._dir = tempfile.mkdtemp(prefix="tandem-")
        self._transport_open = True
        inbound, outbound = f"ipc://{self._dir}/in", f"ipc://{self._dir}/out"
        self._ctx, self._actx = zmq.Context(), zmq.asyncio.Context()
        self._push = self._ctx.socket(zmq.PUSH)
        self._push.setsockopt(zmq.SNDHWM, 0)
        self._push.setsockopt(zmq.LINGER, 0)
        self._push.bind(inbound)
        self._pull = self._actx.socket(zmq.PULL)
        self._pull.setsockopt(zmq.RCVHWM, 0)
        self._pull.bind(outbound)
        self._enc, self._dec = P.encoder(), P.from_engine_decoder()
        self.proc = multiprocessing.get_context("spawn").Process(
            target=run_engine, name="tandem-engine", daemon=True,
            args=(msgspec.msgpack.encode(self.config), inbound, outbound, self.max_waiting, self.gpus))
        self.proc.start()
        log.info("engine process started (pid %d)", self.proc.pid)
        while not await self._pull.poll(200):
            if not self.proc.is_alive():
                raise RuntimeError(f"engine process exited with code {self.proc.exitcode} while starting")
        msg = self._dec.decode(await self._pull.recv())
        if isinstance(msg, P.Failed):
            raise RuntimeError(f"engine failed to start: {msg.message}")
        assert isinstance(msg, P.Ready), msg
        self.ready = msg
        self.metrics.set_stats(msg.stats)
        self.metrics.set_engine_up(True)
        loop = asyncio.get_running_loop()
        loop.add_reader(self.proc.sentinel, self._on_engine_exit)
        self._reader = asyncio.create_task(self._read_loop())
        self._started_at = time.monotonic()
        return msg

    async def close(self) -> None:
        """Stop the engine (politely, then by force) and release sockets; safe after a failed start."""
        self._closing = True
        if self._restarting is not None:
            self._restarting.cancel()
            await asyncio.gather(self._restarting, return_exceptions=True)
        if self.ready is not None:
            asyncio.get_running_loop().remove_reader(self.proc.sentinel)
            self._reader.cancel()
        if not self._transport_open:
            return
        if getattr(self, "proc", None) is not None and self.proc.is_alive():
            try:
                self._send(P.Shutdown())
            except EngineDead:  # it is exiting by itself (a failed start): nobody reads the socket
                pass
            await asyncio.to_thread(self.proc.join, 10)
            if self.proc.is_alive():
                self.proc.kill()
                await asyncio.to_thread(self.proc.join, 5)
        self._release_transport()

    def _release_transport(self) -> None:
        """Sockets, contexts and the IPC folder of the current engine process."""
        if not self._transport_open:
            return
        self._transport_open = False
        self._push.close(0)
        self._pull.close(0)
        self._ctx.term()
        self._actx.term()
        shutil.rmtree(self._dir, ignore_errors=True)

    def _on_engine_exit(self) -> None:
        asyncio.get_running_loop().remove_reader(self.proc.sentinel)
        self.proc.join(1)  # the sentinel fires as it exits; reaping (for the code) follows at once
        self.dead = self._failure or f"the engine process exited (code {self.proc.exitcode})"
        self.metrics.set_engine_up(False)
        if not self._closing:
            log.error("%s; failing %d in-flight requests", self.dead, len(self._tracked))
        self._fail_tracked(self.dead)
        if self.restart and not self._closing:
            self._restarting = asyncio.create_task(self._restart())

    async def _restart(self) -> None:
        """--restart-engine: a fresh engine process (the in-flight requests were failed with 503;
        new ones get 503 until it is ready)."""
        self._reader.cancel()
        await asyncio.gather(self._reader, return_exceptions=True)
        self._release_transport()
        quick = time.monotonic() - self._started_at < RESTART_QUICK_DEATH_S
        self._quick_deaths = self._quick_deaths + 1 if quick else 0
        self.dead = f"the engine is restarting ({self.dead})"
        while True:
            delay = min(RESTART_MAX_DELAY_S, 2.0 ** (self._quick_deaths - 1)) if self._quick_deaths else 0.0
            log.warning("restarting the engine%s", f" in {delay:g} s" if delay else "")
            await asyncio.sleep(delay)
            try:
                await self.start()
                break
            except Exception as exc:  # a failed start is retried with the same back-off
                log.error("engine restart failed: %s", exc)
                self._release_transport()
                self._quick_deaths += 1
        self.dead = self._failure = None
        self.metrics.engine_restarts.inc()
        log.warning("engine restarted (pid %d)", self.proc.pid)

    def fail_all(self, reason: str) -> None:
        """Fail every in-flight request now (the drain timed out): the engine stops them, their
        clients get `reason` as a 503 (an error event when streaming)."""
        if not self._tracked:
            return
        log.warning("%s: failing %d in-flight requests", reason, len(self._tracked))
        if not self.dead:
            try:
                self._send(P.Abort(list(self._tracked)))
            except EngineDead:
                pass
        self._fail_tracked(reason)

    def _fail_tracked(self, reason: str) -> None:
        for t in self._tracked.values():
            if not t.accepted.done():
                t.accepted.set_exception(EngineDead(reason))
            t.queue.put_nowait(EngineDead(reason))
        self._tracked.clear()

    # ---- requests ----
    async def submit(self, queue: DeltaQueue, request_ids: list[str],
                     prompts: list[list[int]], params: list[P.Params]) -> None:
        """Send requests; return once the engine accepted all of them, else abort them all and raise.

        Deltas of request i arrive on `queue` as (i, Delta); EngineDead if the engine dies.
        """
        if self.dead:
            raise EngineDead(self.dead)
        loop = asyncio.get_running_loop()
        futures = []
        try:
            for i, (rid, ids, p) in enumerate(zip(request_ids, prompts, params)):
                t = _Tracked(queue, i, len(ids), loop.create_future(), text=self._text_for(ids, p))
                self._tracked[rid] = t
                futures.append(t.accepted)
                self._send(P.Add(rid, ids, p, detokenize=t.text is None))
            await asyncio.wait(futures)
            for f in futures:
                if f.exception() is not None:
                    raise f.exception()
        except BaseException:  # a rejection, a dead engine, or the client went away meanwhile
            self.abort(request_ids)
            for f in futures:
                if f.done() and not f.cancelled():
                    f.exception()  # retrieved: no "never retrieved" warnings
            raise

    def _text_for(self, prompt_ids: list[int], p: P.Params) -> RequestText | None:
        """The request's text made here; None where the engine makes it (no tokenizer yet, or
        stop strings: they must end the request in the step that completes them)."""
        if self._tokenizer is None or p.stop:
            return None
        return RequestText(self._tokenizer, prompt_ids, None, p.skip_special_tokens,
                           p.include_stop_str_in_output, self._pieces)

    def abort(self, request_ids: list[str]) -> None:
        live = [rid for rid in request_ids if self._tracked.pop(rid, None) is not None]
        if live and not self.dead:
            try:
                self._send(P.Abort(live))
            except EngineDead:
                pass  # nothing left to abort in

    def reset_prefix_cache(self) -> None:
        """Ask the engine to drop unused cached prefixes (applied before its next step)."""
        if self.dead:
            raise EngineDead(self.dead)
        self._send(P.ResetPrefixCache())

    def _send(self, msg: P.ToEngine) -> None:
        try:
            self._push.send(self._enc.encode(msg), zmq.NOBLOCK)
        except zmq.Again:  # nobody connected: the engine is gone
            raise EngineDead("the engine process is not reachable") from None

    # ---- engine -> front end ----
    async def _read_loop(self) -> None:
        while True:
            frame = await self._pull.recv(copy=False)
            msg = self._dec.decode(frame.buffer)
            if isinstance(msg, P.Outputs):
                self._route(msg)
            elif isinstance(msg, P.Failed):  # the engine's first fatal error, just before it exits
                self._failure = msg.message
                log.error("engine failed: %s", msg.message)

    def _route(self, msg: P.Outputs) -> None:
        self.metrics.set_stats(msg.stats)
        for rid in msg.accepted:
            t = self._tracked.get(rid)
            if t is not None and not t.accepted.done():
                t.accepted.set_result(None)
                self.metrics.prompt_tokens.inc(t.num_prompt_tokens)
        for rej in msg.rejected:
            t = self._tracked.pop(rej.request_id, None)
            if t is not None and not t.accepted.done():
                headers = {"Retry-After": "1"} if rej.status == 503 else {}
                code = "queue_full" if rej.status == 503 else None
                t.accepted.set_exception(APIError(rej.status, rej.message, code=code, headers=headers))
        now = time.monotonic()
        for d in msg.deltas:
            self._observe(d, now)
            t = self._tracked.get(d.request_id)
            if t is None:
                continue  # aborted by the front end: nobody is listening
            if t.text is not None and d.text_ids is not None:
                self._make_text(d, t)
            if d.finished:
                del self._tracked[d.request_id]
            t.queue.put_delta((t.index, d))
            if t.queue.unread > MAX_UNREAD_ENTRIES and not d.finished:
                self._stop_slow_reader(d.request_id, t)

    def _make_text(self, d: P.Delta, t: _Tracked) -> None:
        """The delta's text from the ids the engine named, as the engine would have made it; a
        finished delta (not an error) ends the text. A failure ends only this request, with
        the error, as the engine's own detokenization failing would."""
        try:
            text = t.text.append(d.text_ids).text if d.text_ids else ""
            if d.finished and d.finish_reason != "error":
                text += t.text.finish()
            d.text = text
        except Exception as exc:  # noqa: BLE001 (ends only this request)
            log.error("request %s: detokenizing its tokens failed: %s", d.request_id, exc, exc_info=exc)
            if not d.finished:
                try:
                    self._send(P.Abort([d.request_id]))  # its later deltas go untracked
                except EngineDead:
                    pass  # nothing left to abort in
            d.text, d.finished, d.finish_reason = "", True, "error"
            d.error, d.error_status = f"the server could not detokenize this request's tokens: {exc}", 500

    def _stop_slow_reader(self, rid: str, t: _Tracked) -> None:
        """Abort this choice (its siblings follow on their next delta); the reader gets the
        error after what is already buffered, which no longer grows."""
        self.abort([rid])
        if not t.queue.overflowed:
            t.queue.overflowed = True
            t.queue.put_nowait(slow_reader_error())

    def _observe(self, d: P.Delta, now: float) -> None:
        m, t = self.metrics, self._tracked.get(d.request_id)
        if d.token_ids:
            m.generation_tokens.inc(len(d.token_ids))
            if t is not None:
                if t.last_token is None:
                    m.ttft.observe(now - t.arrival)
                else:
                    m.itl.observe(now - t.last_token)
                t.last_token = now
        if d.finished:
            m.finished.labels(d.finish_reason or "unknown").inc()
            if t is not None:
                m.e2e.observe(now - t.arrival)

    @property
    def num_tracked(self) -> int:
        return len(self._tracked)
