"""Triton kernel compiles while a block runs. A benchmark that compiles inside its measured
run measures the compiler: the prefix bench reports the count so a warm-up gap shows (on the
H200 the eager cascade path once compiled 9 variants, 5.4 s, inside a 14 s run).

Counts every kernel build Triton's launcher performs, loads from its on-disk cache included
(those cost milliseconds, not seconds: the seconds tell them apart)."""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Iterator


@dataclass
class Compiles:
    kernels: list[str] = field(default_factory=list)  # one name per build, in order
    seconds: float = 0.0


@contextlib.contextmanager
def count_compiles() -> Iterator[Compiles]:
    """Yields a `Compiles` filled while the block runs (empty where Triton has no hooks: before
    its `knobs`, or without Triton)."""
    found = Compiles()
    try:
        from triton import knobs
        runtime = knobs.runtime
        previous = runtime.jit_cache_hook, runtime.jit_post_compile_hook
    except (ImportError, AttributeError):
        yield found
        return
    started = [0.0]

    def before(*args, **kwargs):
        started[0] = time.perf_counter()
        return previous[0](*args, **kwargs) if previous[0] is not None else None  # truthy skips the build

    def after(*args, **kwargs):
        found.seconds += time.perf_counter() - started[0]
        fn = kwargs.get("fn")
        found.kernels.append(str(getattr(fn, "name", fn)).rsplit(".", 1)[-1])
        if previous[1] is not None:
            previous[1](*args, **kwargs)

    runtime.jit_cache_hook, runtime.jit_post_compile_hook = before, after
    try:
        yield found
    finally:
        runtime.jit_cache_hook, runtime.jit_post_compile_hook = previous
