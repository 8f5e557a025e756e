"""count_compiles: records what Triton's build hook reports, chains the hooks it replaces and
puts them back. (A real build needs a GPU: the prefix bench's rows on the H200 show those.)"""
import pytest

from tandem.diagnostics.compiles import count_compiles

knobs = pytest.importorskip("triton.knobs")


def test_builds_are_counted_and_the_replaced_hooks_chained_and_restored():
    seen = []
    outer = lambda *a, **kw: seen.append("outer")  # noqa: E731
    knobs.runtime.jit_post_compile_hook = outer
    try:
        with count_compiles() as c:
            knobs.runtime.jit_cache_hook()
            knobs.runtime.jit_post_compile_hook(fn=type("F", (), {"name": "pkg.mod._kernel"})())
        assert c.kernels == ["_kernel"] and seen == ["outer"] and c.seconds >= 0
        assert knobs.runtime.jit_post_compile_hook is outer and knobs.runtime.jit_cache_hook is None
    finally:
        knobs.runtime.jit_post_compile_hook = None


def test_listeners_come_and_go_in_any_order_and_the_hooks_come_back_after_the_last():
    from tandem.diagnostics.compiles import watch_compiles
    engine_seen = []
    stop_engine = watch_compiles(lambda kernel, s: engine_seen.append(kernel))
    with count_compiles() as bench:
        knobs.runtime.jit_cache_hook()
        knobs.runtime.jit_post_compile_hook(fn=type("F", (), {"name": "m._a"})())
        stop_engine()  # the engine closes inside the bench's block: the bench still counts
        knobs.runtime.jit_cache_hook()
        knobs.runtime.jit_post_compile_hook(fn=type("F", (), {"name": "m._b"})())
    assert engine_seen == ["_a"] and bench.kernels == ["_a", "_b"]
    assert knobs.runtime.jit_cache_hook is None and knobs.runtime.jit_post_compile_hook is None
