"""Engine lifetime: close() and `with LLM(...)` give everything back, and a closed engine says so."""
import gc
import os
import weakref

import pytest

from tandem import LLM, SamplingParams
from tandem.engine import Engine
from tandem.config import EngineConfig
from tiny_models import TEST_DEVICE

GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)


def _rss_mib() -> float:
    return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _kv_refs(engine: Engine) -> list[weakref.ref]:
    return [weakref.ref(t) for t in engine.kv.k + engine.kv.v] + [weakref.ref(p) for p in engine.model.parameters()]


def test_with_block_closes_and_later_calls_say_so(tiny_text_model):
    with LLM(str(tiny_text_model), device=TEST_DEVICE, dtype="float32") as llm:
        assert llm.generate([[5, 6, 7]], GREEDY, use_tqdm=False)[0].finish_reason == "length"
        refs = _kv_refs(llm.engine)
    assert all(r() is None for r in refs)  # freed at close, while `llm` itself is still alive
    with pytest.raises(RuntimeError, match="closed"):
        llm.generate([[5, 6, 7]], GREEDY, use_tqdm=False)
    with pytest.raises(RuntimeError, match="closed"):
        llm.engine.add_request([5, 6])
    with pytest.raises(RuntimeError, match="closed"):
        llm.engine.step()
    llm.close()  # idempotent
    assert not llm.engine.has_unfinished()


def test_dropping_an_llm_or_engine_frees_it_without_close(tiny_text_model):
    """No reference cycle holds device state: `del` frees it at once, though the engine froze
    its objects out of the garbage collector's reach."""
    llm = LLM(str(tiny_text_model), device=TEST_DEVICE, dtype="float32")
    llm.generate([[5, 6, 7]], GREEDY, use_tqdm=False)
    refs = _kv_refs(llm.engine)
    del llm
    assert all(r() is None for r in refs)
    engine = Engine(EngineConfig(model=str(tiny_text_model), device=TEST_DEVICE, dtype="float32"))
    refs, engine_ref = _kv_refs(engine), weakref.ref(engine)
    del engine
    assert engine_ref() is None and all(r() is None for r in refs)


def test_close_mid_generation_and_other_engines_keep_working(tiny_text_model):
    a = LLM(str(tiny_text_model), device=TEST_DEVICE, dtype="float32")
    b = LLM(str(tiny_text_model), device=TEST_DEVICE, dtype="float32")
    expected = a.generate([[9, 10]], GREEDY, use_tqdm=False)[0].token_ids
    a.engine.add_request([5, 6, 7], GREEDY)
    a.engine.step()
    a.close()  # with a request in flight
    assert b.generate([[9, 10]], GREEDY, use_tqdm=False)[0].token_ids == expected
    b.close()


def test_six_create_close_cycles_keep_memory_flat(tiny_text_model):
    """Each engine's KV pool is 128 MiB here; a leak of one pool per cycle would show in RSS."""
    rss, pools = [], []
    for _ in range(6):
        llm = LLM(str(tiny_text_model), device=TEST_DEVICE, dtype="float32", max_running_requests=512)
        assert llm.engine.kv_slots.count >= 200_000
        llm.generate([[5, 6, 7]] * 4, GREEDY, use_tqdm=False)
        pools += _kv_refs(llm.engine)
        llm.close()
        del llm
        rss.append(_rss_mib())
    assert all(r() is None for r in pools)
    # The first cycles warm allocator caches and lazily built state; after that, flat.
    assert max(rss[2:]) - rss[1] < 48, rss


def test_an_engine_taken_from_a_dropped_llm_keeps_working(tiny_text_model):
    """`engine = LLM(...).engine`: the LLM is gone at once, its engine serves on while held (it
    used to be closed under the caller by the LLM's finalizer), and is freed with its last holder."""
    engine = LLM(str(tiny_text_model), device=TEST_DEVICE, dtype="float32").engine
    gc.collect()
    rid = engine.add_request([5, 6, 7], GREEDY)
    while engine.has_unfinished():
        engine.step()
    assert len(engine.output(rid).token_ids) == GREEDY.max_tokens
    engine.release(rid)
    refs, engine_ref = _kv_refs(engine), weakref.ref(engine)
    del engine
    assert engine_ref() is None and all(r() is None for r in refs)


class _Event:
    def __init__(self, ready: bool):
        self.ready = ready

    def query(self) -> bool:
        return self.ready


def _generations_collected(fn) -> list[int]:
    seen = []

    def on_gc(phase, info):
        if phase == "start":
            seen.append(info["generation"])
    gc.callbacks.append(on_gc)
    try:
        fn()
    finally:
        gc.callbacks.remove(on_gc)
    return seen


def test_shadow_collector_collects_only_in_the_wait_for_a_long_running_step():
    """A young pass before waiting for a long step still running; none for a short step, a
    finished one, or with the experiment off; the full pass once the third generation's count
    is at its threshold."""
    from tandem.lifetime import ShadowCollector
    shadow = ShadowCollector(True, min_tokens=100)
    gc.collect()  # counts at 0: no automatic pass trips inside the few allocations below
    assert _generations_collected(lambda: shadow.before_wait(99, _Event(False))) == []
    assert _generations_collected(lambda: shadow.before_wait(100, _Event(True))) == []
    assert _generations_collected(lambda: ShadowCollector(False, 100).before_wait(4096, _Event(False))) == []
    assert _generations_collected(lambda: shadow.before_wait(100, _Event(False))) == [1]
    assert gc.get_count()[0] < 50 and gc.get_count()[2] == 1
    threshold = gc.get_threshold()
    try:
        gc.set_threshold(threshold[0], threshold[1], 2)
        seen = _generations_collected(lambda: [shadow.before_wait(100, _Event(False)) for _ in range(2)])
    finally:
        gc.set_threshold(*threshold)
    assert seen == [1, 2] and shadow.passes == 3
