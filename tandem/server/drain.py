"""Graceful shutdown: on SIGTERM (or Ctrl-C) stop taking requests, let the in-flight ones
finish for up to `--shutdown-timeout` seconds, then fail the rest with a proper error.

uvicorn closes the listening sockets and waits for open connections; this adds the deadline
for requests still generating, and keeps the exit status 0 (uvicorn would re-raise the
signal after a graceful stop, making the process exit with -15). A second Ctrl-C stops at once.
"""
from __future__ import annotations

import asyncio
import logging
import signal

log = logging.getLogger("tandem.server")


def install(server, state, client, timeout: float) -> None:
    """Route the server's exit signals through a drain; call before `server.serve()`."""
    loop = asyncio.get_running_loop()

    def begin() -> None:
        if state.draining:
            return
        state.draining = True
        log.info("shutting down: finishing %d in-flight requests (up to %.0f s)", client.num_tracked, timeout)
        loop.call_later(timeout, client.fail_all,
                        f"the server is shutting down and the request did not finish within {timeout:g} s")

    def on_signal(sig: int, frame) -> None:  # in the main thread, between bytecodes: flags only
        if server.should_exit and sig == signal.SIGINT:
            server.force_exit = True
        server.should_exit = True
        loop.call_soon_threadsafe(begin)

    server.handle_exit = on_signal  # uvicorn installs `self.handle_exit` as the handler
