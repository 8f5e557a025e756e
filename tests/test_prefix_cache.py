"""The prefix cache: the radix tree's books, and that reusing KV never changes a token."""
import random

import pytest

from tandem import LLM, SamplingParams
from tandem.config import EngineConfig
from tandem.engine import Engine
from tandem.memory.allocator import SlotAllocator
from tandem.memory.radix_cache import RadixCache
from tiny_models import TEST_DEVICE
from workload import Spec, assert_kv_conserved, run_workload


# ---- the radix tree ----
def _tree(n: int = 100):
    alloc = SlotAllocator(n)
    return RadixCache(alloc.free), alloc


def test_match_returns_longest_cached_prefix_and_splits_edges():
    tree, alloc = _tree()
    slots = alloc.alloc(6)
    assert tree.insert([1, 2, 3, 4, 5, 6], slots) == (0, tree.match([1, 2, 3, 4, 5, 6])[1])
    got, node = tree.match([1, 2, 3, 9])
    assert got == slots[:3] and node.key == (1, 2, 3)  # the edge was cut after 3 tokens
    assert tree.match([7])[0] == [] and tree.match_length([1, 2, 3, 4, 8]) == 4
    present, _ = tree.insert([1, 2, 3, 7, 8], slots[:3] + alloc.alloc(2))
    assert present == 3  # the caller keeps its 3 duplicate slots
    assert tree.total_tokens == 8


def test_locked_paths_survive_eviction_and_lru_goes_first():
    tree, alloc = _tree()
    old, new, kept = alloc.alloc(3), alloc.alloc(3), alloc.alloc(3)
    tree.insert([1, 1, 1], old)
    tree.insert([2, 2, 2], new)
    _, kept_node = tree.insert([3, 3, 3], kept)
    tree.lock(kept_node)
    tree.match([2, 2, 2])  # touched: now newer than [1, 1, 1]
    assert tree.evict(1) == 3 and tree.match([1, 1, 1])[0] == []  # least recently used first
    assert tree.evict(100) == 3  # [2, 2, 2]; the locked [3, 3, 3] stays
    assert tree.match([3, 3, 3])[0] == kept
    assert alloc.num_free == 100 - 3
    tree.unlock(kept_node)
    assert tree.evictable_tokens == 3 and tree.evict(3) == 3 and alloc.num_free == 100


def test_lock_counts_follow_splits():
    tree, alloc = _tree()
    _, leaf = tree.insert([1, 2, 3, 4], alloc.alloc(4))
    tree.lock(leaf)
    _, upper = tree.match([1, 2])  # split above a locked node: the upper half is locked too
    assert upper.lock_ref == 1 and tree.locked_tokens == 4 and tree.evictable_tokens == 0
    tree.check({id(leaf): 1, id(upper): 1})
    with pytest.raises(AssertionError):
        tree.check({})


# ---- the engine ----
def _engine(path, **kw) -> Engine:
    return Engine(EngineConfig(model=str(path), device=TEST_DEVICE, dtype="float32", **kw))


def shared_prefix_specs(n: int, seed: int, stop_pool: list[str] = ()) -> list[Spec]:
    """Requests built from a handful of shared prefixes with random suffixes; some repeat a
    prompt exactly (n > 1 samples), some abort, some stop on strings."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(3, 1000) for _ in range(rng.randint(20, 70))] for _ in range(5)]
    specs: list[Spec] = []
    while len(specs) < n:
        prompt = rng.choice(prefixes) + [rng.randrange(3, 1000) for _ in range(rng.randint(0, 12))]
        params = dict(max_tokens=rng.randint(1, 30), temperature=0.0 if rng.random() < 0.5 else 0.9,
                      top_k=rng.choice([-1, 30]), seed=rng.randrange(1000))
        if stop_pool and rng.random() < 0.3:
            params["stop"] = [rng.choice(stop_pool)]
        abort = rng.randint(0, 8) if rng.random() < 0.1 else None
        for _ in range(rng.choice([1, 1, 1, 3])):  # n > 1: the same prompt, its own seed each
            specs.append(Spec(f"r{len(specs)}", prompt, SamplingParams(**params), abort))
            params["seed"] = rng.randrange(1000)
    return specs


@pytest.mark.slow
def test_cache_on_equals_off_with_eviction_preemption_and_overlap(tiny_text_model, builtin_tokenizer):
    probe = LLM(str(tiny_text_model), device=TEST_DEVICE, dtype="float32").generate(
        [[5, 6, 7], [900, 11]], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True),
        use_tqdm=False)
    generated = [t for o in probe for t in o.token_ids]
    stop_pool = [s for s in (builtin_tokenizer.decode(generated[i:i + 2]) for i in range(0, 20, 3)) if s]
    specs = shared_prefix_specs(200, seed=11, stop_pool=stop_pool)
    runs, stats = {}, {}
    for cache, overlap in ((True, True), (False, True), (True, False)):
        engine = _engine(tiny_text_model, max_total_tokens=700, chunked_prefill_size=24,
                         max_prefill_tokens=96, disable_overlap=not overlap,
                         enable_prefix_caching=cache)  # the books are checked: conftest's env
        engine.eos_token_ids = {generated[3]}  # make EOS actually happen in a random model
        runs[cache, overlap] = run_workload(engine, specs, arrive_per_step=16)
        stats[cache, overlap] = engine.stats()
        assert_kv_conserved(engine)
    assert runs[True, True] == runs[False, True] == runs[True, False]
    on = stats[True, True]
    assert on["prefix_cache_hit_tokens"] > 0.3 * on["prefix_cache_queried_tokens"]
    assert on["num_preemptions"] > 0, "the pool must be small enough to force preemption"
    assert stats[False, True]["prefix_cache_hit_tokens"] == 0
    assert {r[1] for r in runs[True, True].values()} >= {"stop", "length", "abort"}


def test_eviction_makes_room_before_preemption(tiny_text_model):
    """A full cache is evicted (LRU), not kept at the cost of running requests."""
    engine = _engine(tiny_text_model, max_total_tokens=300)
    rng = random.Random(2)
    greedy = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    for i in range(12):  # each leaves ~48 tokens in the cache: far more than the pool
        engine.add_request([rng.randrange(3, 1000) for _ in range(40)], greedy, request_id=f"a{i}")
        while engine.has_unfinished():
            engine.step()
        engine.release(f"a{i}")
    s = engine.stats()
    assert s["prefix_cache_tokens"] > 200 and s["num_preemptions"] == 0
    assert_kv_conserved(engine)
    assert engine.reset_prefix_cache() == s["prefix_cache_tokens"]
    assert engine.stats()["kv_free_tokens"] == 300


def test_shared_prompts_in_one_batch_are_prefilled_once(tiny_text_model):
    """n copies of a prompt arriving together: one computes it, the others reuse it."""
    engine = _engine(tiny_text_model)
    prompt = list(range(10, 110))
    for i in range(4):
        engine.add_request(prompt, SamplingParams(max_tokens=4, temperature=0.8, seed=i),
                           request_id=f"s{i}")
    while engine.has_unfinished():
        engine.step()
    s = engine.stats()
    assert s["prefix_cache_hit_tokens"] == 3 * 99  # all but the last token, for 3 of the 4
    outs = [engine.output(f"s{i}") for i in range(4)]
    assert all(len(o.token_ids) == 4 for o in outs)


def test_chat_turns_reuse_the_history(tiny_text_model):
    llm = LLM(str(tiny_text_model), device=TEST_DEVICE, dtype="float32")
    params = SamplingParams(max_tokens=12, temperature=0)
    history = [{"role": "system", "content": "You are a terse assistant. " * 8},
               {"role": "user", "content": "Say something about the sea."}]
    first = llm.chat(history, params, use_tqdm=False)[0]
    assert first.num_cached_tokens == 0
    history += [{"role": "assistant", "content": first.text},
                {"role": "user", "content": "And about the sky?"}]
    second = llm.chat(history, params, use_tqdm=False)[0]
    assert second.num_cached_tokens >= len(first.prompt_token_ids) - 1
    off = LLM(str(tiny_text_model), device=TEST_DEVICE, dtype="float32", enable_prefix_caching=False)
    assert off.chat(history, params, use_tqdm=False)[0].token_ids == second.token_ids
    assert llm.reset_prefix_cache() > 0


def test_bad_schedule_policy_is_refused(tiny_text_model):
    with pytest.raises(ValueError, match="schedule_policy must be one of fcfs, lpm"):
        _engine(tiny_text_model, schedule_policy="random")


def test_lpm_admits_longest_match_first(tiny_text_model):
    engine = _engine(tiny_text_model, schedule_policy="lpm", max_running_requests=2)
    warm = list(range(10, 74))
    greedy = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    engine.add_request(warm, greedy, request_id="warm")
    while engine.has_unfinished():
        engine.step()
    engine.add_request(list(range(500, 540)), greedy, request_id="cold")
    engine.add_request(warm + [7, 8], greedy, request_id="hot")
    engine.step()
    admitted = [r.rid for r in engine.scheduler.running]
    assert admitted[0] == "hot"
