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
