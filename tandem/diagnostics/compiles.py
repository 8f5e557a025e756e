"""Triton kernel builds, reported to listeners: a block's count (`count_compiles`) and the
engine's watch after its warm-up (`watch_compiles`). A benchmark that compiles inside its
measured run measures the compiler: the prefix bench reports the count so a warm-up gap shows
(on the H200 the eager cascade path once compiled 9 variants, 5.4 s, inside a 14 s run); a
server that builds a kernel while serving stalls every request in that step.

Counts every kernel build Triton's launcher performs, loads from its on-disk cache included
(those cost milliseconds, not seconds: the seconds tell them apart). Triton's two hooks are
process-wide: one pair of ours is installed while any listener listens, chaining the hooks it
replaced, which come back when the last listener leaves (so listeners may come and go in
any order). Triton calls the hooks only on a cache miss: launches pay nothing."""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator

Listener = Callable[[str, float], None]  # (kernel name, seconds its build took)
_listeners: list[Listener] = []
_replaced: tuple | None = None  # Triton's hooks before ours (installed while this is not None)
_started = [0.0]


@dataclass
class Compiles:
    kernels: list[str] = field(default_factory=list)  # one name per build, in order
    seconds: float = 0.0

    def note(self, kernel: str, seconds: float) -> None:
        self.kernels.append(kernel)
        self.seconds += seconds


def watch_compiles(listener: Listener) -> Callable[[], None]:
    """Call `listener` after every kernel build from now on; returns the call that stops it.
    Nothing is watched where Triton has no hooks (before its `knobs`, or without Triton)."""
    if not _install():
        return lambda: None
    _listeners.append(listener)

    def stop() -> None:
        if listener in _listeners:
            _listeners.remove(listener)
            if not _listeners:
                _uninstall()
    return stop


@contextlib.contextmanager
def count_compiles() -> Iterator[Compiles]:
    """Yields a `Compiles` filled while the block runs (empty where Triton has no hooks)."""
    found = Compiles()
    stop = watch_compiles(found.note)
    try:
        yield found
    finally:
        stop()


def _install() -> bool:
    global _replaced
    try:
        from triton import knobs
        runtime = knobs.runtime
        previous = runtime.jit_cache_hook, runtime.jit_post_compile_hook
    except (ImportError, AttributeError):
        return False
    if _replaced is not None:
        return True

    def before(*args, **kwargs):
        _started[0] = time.perf_counter()
        return previous[0](*args, **kwargs) if previous[0] is not None else None  # truthy skips the build

    def after(*args, **kwargs):
        seconds = time.perf_counter() - _started[0]
        fn = kwargs.get("fn")
        kernel = str(getattr(fn, "name", fn)).rsplit(".", 1)[-1]
        for listener in list(_listeners):
            listener(kernel, seconds)
        if previous[1] is not None:
            previous[1](*args, **kwargs)

    _replaced = previous
    runtime.jit_cache_hook, runtime.jit_post_compile_hook = before, after
    return True


def _uninstall() -> None:
    global _replaced
    from triton import knobs
    knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook = _replaced
    _replaced = None
