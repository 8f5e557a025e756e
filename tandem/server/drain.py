"""Graceful shutdown: on SIGTERM (or Ctrl-C) stop taking requests, let the in-flight ones
finish, then fail the rest with a proper error, so that the process is gone within
`--shutdown-timeout` seconds (an orchestrator's grace period): the requests get the timeout
less EXIT_RESERVE_S for the shutdown itself (at least half of it).

The listener stays open while requests drain, so /health answers 503 (and new requests 503)
instead of refusing connections; only then is uvicorn told to exit, and it has FLUSH_S for
the responses that are ending. The exit status stays 0 (uvicorn would re-raise the signal
after a graceful stop, making the process exit with -15). A second Ctrl-C fails what is
still running at once (streams end with an error event) and exits; a third forces it.
"""
from __future__ import annotations

import asyncio
import logging
import signal

log = logging.getLogger("tandem.server")

# After the drain: how long uvicorn waits for responses that are ending (error events, last chunks).
FLUSH_S = 5.0
# After the drain: the engine process's close and both interpreters' teardown (~2 s each on
# two loaded CPU cores).
EXIT_RESERVE_S = 4.0
_POLL_S = 0.05


def drain_budget(timeout: float) -> float:
    """Seconds the in-flight requests get out of the shutdown timeout."""
    return max(timeout - EXIT_RESERVE_S, timeout / 2)


def install(server, state, client, timeout: float) -> None:
    """Route the server's exit signals through a drain; call before `server.serve()`."""
    loop = asyncio.get_running_loop()
    tasks: list[asyncio.Task] = []  # a reference keeps the drain task alive

    budget = drain_budget(timeout)

    async def drain() -> None:
        log.info("shutting down: finishing %d in-flight requests (up to %.1f s)", client.num_tracked, budget)
        deadline = loop.time() + budget
        while client.num_tracked and loop.time() < deadline:
            await asyncio.sleep(_POLL_S)
        client.fail_all(f"the server is shutting down and the request did not finish within {budget:g} s")
        server.should_exit = True

    def begin() -> None:
        if not state.draining:
            state.draining = True
            tasks.append(loop.create_task(drain()))

    def stop_now() -> None:
        client.fail_all("the server is shutting down now (interrupted twice)")
        server.should_exit = True

    def on_signal(sig: int, frame) -> None:  # in the main thread, between bytecodes: flags only
        if sig != signal.SIGINT or not state.draining:
            loop.call_soon_threadsafe(begin)
        elif not server.should_exit:
            loop.call_soon_threadsafe(stop_now)
        else:
            server.force_exit = True

    server.handle_exit = on_signal  # uvicorn installs `self.handle_exit` as the handler
