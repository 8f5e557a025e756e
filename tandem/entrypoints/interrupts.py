"""Ctrl-C between engine steps, not inside one.

A KeyboardInterrupt raised in the middle of a step (while results are being appended, say)
would leave requests half-processed. While a `generate` runs, the first SIGINT is held and
raised at the next step boundary, where the caller cancels its requests cleanly; a second
SIGINT interrupts at once, for a step that hangs.
"""
import contextlib
import signal
import threading
from typing import Callable, Iterator


class HeldInterrupt(KeyboardInterrupt):
    """The held Ctrl-C, raised between steps: every request is in a consistent state, so the
    caller may cancel its requests and go on with the engine."""


@contextlib.contextmanager
def interrupts_between_steps() -> Iterator[Callable[[], None]]:
    """Yields `check()`, which raises the held Ctrl-C (HeldInterrupt); call it between steps.
    Python's own SIGINT handler only, and only in the main thread (where signals are handled):
    a program's own handler is left alone."""
    if (threading.current_thread() is not threading.main_thread()
            or signal.getsignal(signal.SIGINT) is not signal.default_int_handler):
        yield lambda: None
        return
    held = []

    def hold(signum, frame) -> None:
        if held:  # pressed twice: the user means now
            raise KeyboardInterrupt
        held.append(signum)

    def check() -> None:
        if held:
            held.clear()
            raise HeldInterrupt

    signal.signal(signal.SIGINT, hold)
    try:
        yield check
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    check()  # one that arrived while the caller cleaned up, or after the last step
