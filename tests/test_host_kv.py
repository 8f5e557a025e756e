"""The prefix cache's host tier, below the engine: tree bookkeeping across tiers, write-ahead,
prefetch and the plan's holds, the copies, their fences and pace."""
import random

import pytest
import torch

from tandem.memory.allocator import SlotAllocator
from tandem.memory.host_kv import HostKVPool, contiguous_runs
from tandem.memory.kv_cache import KVCache, byte_view
from tandem.memory.lru_heap import attached
from tandem.memory.prefix_cache import HostTier, PrefixCache
from tandem.memory.radix_cache import HostTierHooks, RadixCache
from tandem.overlap import kv_tier_copy
from tandem.overlap.kv_tier_copy import MAX_PERIOD_S, CopyPace, KVTierCopier
from tandem.overlap.streams import StreamSet
from tandem.request import Request
from tandem.sampling import SamplingParams
from host_tier import instant_tier


def _tiered_tree(gpu: int = 100, host: int = 50):
    kv, host_pool, copies = SlotAllocator(gpu), SlotAllocator(host, first=0), []
    tree = RadixCache(kv.free, HostTierHooks(host_pool, lambda g, h: copies.append((list(g), list(h))) or len(copies)))
    return tree, kv, host_pool, copies


def test_eviction_writes_back_and_a_match_continues_on_the_host():
    tree, kv, host, copies = _tiered_tree()
    a = kv.alloc(6)
    tree.insert([1, 2, 3, 4, 5, 6], a)
    b = kv.alloc(4)
    present, _ = tree.insert([1, 2, 3, 9], b)  # splits after [1, 2, 3]
    kv.free(b[:present])  # the caller's duplicates
    assert tree.evict(3) == 3  # the LRU leaf [4, 5, 6] goes to the host
    assert copies == [(a[3:], [0, 1, 2])] and tree.host_tokens == 3
    slots, node = tree.match([1, 2, 3, 4, 5, 6, 7])
    assert slots == a[:3]  # the GPU part
    path = tree.host_continuation(node, [1, 2, 3, 4, 5], 3)  # ends inside [4, 5, 6]: split
    assert [n.key for n in path] == [(4, 5)] and path[0].host_slots == (0, 1)
    loaded = kv.alloc(2)
    tree.mark_loaded(path[0], loaded, copy_seq=2)
    assert tree.match([1, 2, 3, 4, 5])[0] == a[:3] + loaded and tree.host_tokens == 3  # in both tiers
    tree.check({})
    before = kv.num_free
    tree.evict(100)  # everything: [4, 5] needs no copy (it is on the host already)
    assert [c[0] for c in copies[1:]] == [b[3:], a[:3]]  # [9] and [1, 2, 3]; not [4, 5]
    assert kv.num_free == before + 6 and tree.host_tokens == 7
    tree.check({})


def test_write_ahead_copies_cold_nodes_and_their_eviction_copies_nothing():
    tree, kv, host, copies = _tiered_tree(host=8)
    for first in (10, 20, 30):  # 30 is the warmest
        tree.insert([first, first + 1, first + 2], kv.alloc(3))
    assert tree.write_ahead(5) == 6  # the two coldest, whole nodes
    assert [c[1] for c in copies] == [[0, 1, 2], [3, 4, 5]] and kv.num_free == 91
    assert tree.write_ahead(5) == 0  # already covered
    assert tree.evict(6) == 6 and len(copies) == 2  # no copy: they were written ahead
    assert tree.write_ahead(9) == 3  # [30..] takes the room of the coldest host-only node
    assert tree.match_length([10, 11, 12]) == 0 and tree.match_length([20, 21, 22]) == 3
    tree.check({})


def test_evicting_what_was_written_ahead_copies_nothing_and_keeps_lru_order():
    tree, kv, host, copies = _tiered_tree(host=20)
    for first in (10, 20, 30):  # 30 is the warmest
        tree.insert([first, first + 1, first + 2], kv.alloc(3))
    assert tree.evict_copied(9) == 0  # nothing written ahead: the coldest needs a copy, so none goes
    assert tree.write_ahead(6) == 6 and len(copies) == 2  # [10..] and [20..]
    free = kv.num_free
    assert tree.evict_copied(9) == 6 and len(copies) == 2  # both, no copy; it stops at [30..]
    assert kv.num_free == free + 6 and tree.match_length([30, 31, 32]) == 3
    assert tree.match_lengths([20, 21, 22]) == (0, 3)  # on the host
    tree.check({})
    assert tree.evict(3) == 3 and len(copies) == 3  # [30..] is still evictable, with its copy
    tree.check({})


def test_evict_ahead_frees_the_next_plans_need_only_while_it_is_short():
    kv, host_pool = SlotAllocator(100), SlotAllocator(100, first=0)
    cache = PrefixCache(kv, host=instant_tier(host_pool))
    for first in range(10, 90, 10):
        cache.tree.insert(list(range(first, first + 10)), kv.alloc(10))  # 80 of 100 cached
    assert cache.evict_ahead(15) == 0  # 20 free already
    cache.write_ahead(50)
    assert cache.evict_ahead(50) == 30 and kv.num_free == 50  # whole nodes, coldest first
    assert PrefixCache(SlotAllocator(10)).evict_ahead(50) == 0  # no host tier: nothing to do


def test_write_ahead_follows_eviction_down_a_chain():
    tree, kv, host, copies = _tiered_tree(host=20)
    history, slots = [10, 11, 12], kv.alloc(3)
    for turn in range(3):  # one conversation's turns: a chain, its leaf the only evictable node
        history, slots = history + [20 + 3 * turn, 21 + 3 * turn, 22 + 3 * turn], slots + kv.alloc(3)
        tree.insert(history, slots)
    assert tree.write_ahead(12) == 12  # the leaf, then its parent as if the leaf were gone, ...
    assert [c[0] for c in copies] == [[10, 11, 12], [7, 8, 9], [1, 2, 3, 4, 5, 6]]  # (GPU slots)
    assert tree.evict(12) == 12 and len(copies) == 3  # ... so eviction copies nothing more
    tree.check({})


def test_write_ahead_queues_about_most_tokens_a_call_and_the_rest_later():
    tree, kv, host, copies = _tiered_tree(host=20)
    for first in (10, 20, 30, 40):
        tree.insert([first, first + 1, first + 2], kv.alloc(3))
    assert tree.write_ahead(12, most=4) == 6  # whole nodes: the second starts below 4
    assert tree.write_ahead(12, most=2) == 3  # the first node whatever its size: progress
    assert tree.write_ahead(12, most=100) == 3 and tree.write_ahead(12, most=100) == 0
    assert [c[0][0] for c in copies] == sorted(c[0][0] for c in copies)  # coldest first
    tree.check({})


def _waiting(prompt: list[int]) -> Request:
    """A waiting request: its match may cover all of `prompt` but the last token."""
    return Request("w", prompt, SamplingParams(max_tokens=1), seed=0, max_samples=1)


def test_a_load_budget_smaller_than_a_host_node_loads_its_head():
    kv, host_pool, loads = SlotAllocator(100), SlotAllocator(200, first=0), []
    cache = PrefixCache(kv, host=instant_tier(
        host_pool, load=lambda h, g: loads.append((list(h), list(g))) or len(loads)))
    tokens = list(range(100, 200))
    cache.tree.insert(tokens, kv.alloc(100))
    cache.tree.evict(100)  # all on the host
    req = _waiting(tokens + [7])
    assert cache.prefetch([req], keep=0, most=70) == 70  # the node's first 70 tokens
    assert len(cache.tree.match(tokens)[0]) == 70
    assert cache.prefetch([req], keep=0, most=20) == 0  # a piece under MIN_LOAD_TOKENS waits for more
    assert cache.prefetch([req], keep=0, most=64) == 30  # the rest, whole
    assert [len(h) for h, _ in loads] == [70, 30] and loads[0][0] + loads[1][0] == list(range(100))
    assert len(cache.tree.match(tokens)[0]) == 100
    cache.tree.check({})


def test_prefetch_without_evicting_takes_free_slots_only_and_counts_a_host_hit_at_first_admission():
    kv, host_pool, loads = SlotAllocator(400), SlotAllocator(400, first=0), []
    cache = PrefixCache(kv, host=instant_tier(host_pool, load=lambda h, g: loads.append(len(g)) or len(loads)))
    tokens, cold = list(range(1000, 1200)), list(range(2000, 2100))
    cache.tree.insert(tokens, kv.alloc(200))
    cache.tree.evict(200)  # all on the host
    cache.tree.insert(cold, kv.alloc(100))  # a cached prefix on the GPU, evictable
    others = kv.alloc(200)  # running requests hold the rest but 100 slots
    waiting = _waiting(tokens + [7])
    assert cache.prefetch([waiting], keep=20, most=1000, evict=False) == 80 and kv.num_free == 20
    assert len(cache.tree.match(cold)[0]) == 100  # nothing evicted for a request not admitted yet
    assert cache.host_hit_tokens == 0  # a prefetch is not a hit until a request reads it
    kv.free(others)
    req = Request("r", tokens + [7], SamplingParams(max_tokens=1), seed=0, max_samples=1)
    cache.new_step()
    assert cache.admit(req) == 200 and loads == [80, 120] and cache.host_hit_tokens == 200
    cache.cache_and_free(req)
    again = Request("s", tokens + [9], SamplingParams(max_tokens=1), seed=0, max_samples=1)
    assert cache.admit(again) == 200 and cache.host_hit_tokens == 200  # a GPU hit now
    cache.cache_and_free(again)
    cache.check([])


def test_prefetch_evicts_colder_prefixes_beyond_what_the_next_plan_keeps():
    kv, host_pool, copies = SlotAllocator(400), SlotAllocator(400, first=0), []
    cache = PrefixCache(kv, host=instant_tier(
        host_pool, write_back=lambda g, h: copies.append(("back", len(g))) or len(copies),
        load=lambda h, g: copies.append(("load", len(g))) or len(copies)))
    tokens, cold = list(range(1000, 1200)), list(range(2000, 2100))
    cache.tree.insert(tokens, kv.alloc(200))
    cache.tree.evict(200)  # all on the host
    cache.tree.insert(cold, kv.alloc(100))  # a cached prefix on the GPU, evictable
    others = kv.alloc(200)  # running requests hold the rest but 100 slots
    copies.clear()
    waiting = _waiting(tokens + [7])
    assert cache.prefetch([waiting], keep=20, most=1000) == 180  # 100 free + 100 evictable - 20 kept
    assert copies == [("back", 100), ("load", 180)]  # the cold prefix went to the host first
    assert kv.num_free == 20 and cache.tier_moves.prefetched == 180
    assert cache.tree.match_length(cold) == 100  # still cached, in the host tier now
    kv.free(others)
    cache.check([])


def _plan_hold(cache: PrefixCache, req: Request, prefetched: bool):
    """A plan's question for one request (each plan counts a wait for its first held request)."""
    cache.new_step()
    return cache.prefetch_hold(req, prefetched)


def test_the_queue_head_waits_for_prefetch_at_most_a_few_plans():
    """(With the FIFO experiment on: a request prefetch has not reached is STOPped, uncounted.)"""
    from tandem.memory.prefix_cache import MAX_PREFETCH_WAITS, Hold
    kv, host_pool = SlotAllocator(400), SlotAllocator(400, first=0)
    cache = PrefixCache(kv, host=instant_tier(host_pool, admit_after_prefetch=True, fifo_beyond_prefetch=True))
    tokens, slots = list(range(1000, 1200)), kv.alloc(200)
    cache.tree.insert(tokens[:80], slots[:80])
    cache.tree.insert(tokens, slots)
    cache.tree.evict(120)  # the tail, 120 tokens, on the host only
    assert cache.tree.match_lengths(tokens + [5]) == (80, 200)
    head = Request("r", tokens + [7], SamplingParams(max_tokens=1), seed=0, max_samples=1)
    assert cache.prefetch_hold(head, prefetched=False) is Hold.STOP and head.prefetch_waits == 0
    assert cache.prefetch_hold(head, prefetched=True) is Hold.SKIP and head.prefetch_waits == 1
    assert cache.prefetch([head], keep=0, most=100) == 100  # a window's budget: 20 left on the host
    assert cache.prefetch_hold(head, prefetched=True) is None  # < MIN_LOAD_TOKENS: admission loads them
    assert cache.prefetch_hold(head, prefetched=False) is None
    cache.tree.evict(cache.tree.evictable_tokens)
    patient = Request("s", tokens + [9], SamplingParams(max_tokens=1), seed=0, max_samples=1)
    holds = [_plan_hold(cache, patient, prefetched=True) for _ in range(MAX_PREFETCH_WAITS + 5)]
    assert holds == [Hold.SKIP] * MAX_PREFETCH_WAITS + [None] * 5
    cache.new_step()
    assert cache.admit(patient) == 200  # then admission loads it
    cache.cache_and_free(patient)
    cache.check([])


def test_a_request_waits_for_prefetch_only_once_prefetch_reaches_it():
    """Passed while prefetch has not reached it (outside the queue's head), a request counts no
    wait: its MAX_PREFETCH_WAITS start when its loads do (counted from the tail of a long
    queue, late turns reached the head with none left, and admission loaded their histories
    while the GPU waited)."""
    from tandem.memory.prefix_cache import MAX_PREFETCH_WAITS, Hold
    kv, host_pool = SlotAllocator(400), SlotAllocator(400, first=0)
    cache = PrefixCache(kv, host=instant_tier(host_pool, admit_after_prefetch=True))
    tokens = list(range(1000, 1200))
    cache.tree.insert(tokens, kv.alloc(200))
    cache.tree.evict(200)
    req = _waiting(tokens + [7])
    assert [cache.prefetch_hold(req, prefetched=False) for _ in range(3 * MAX_PREFETCH_WAITS)] == \
        [Hold.SKIP] * (3 * MAX_PREFETCH_WAITS)
    assert req.prefetch_waits == 0
    assert cache.prefetch_hold(req, prefetched=True) is Hold.SKIP and req.prefetch_waits == 1


def test_a_request_is_held_while_the_load_it_would_read_runs():
    """Prefetch queued the whole host part, so nothing is left on the host only; while that
    load runs, admitting the request would make its forward wait on the device: it is held
    (a counted wait). Once the load completed, or at the waits' bound, it is admitted."""
    from tandem.memory.prefix_cache import MAX_PREFETCH_WAITS, Hold
    kv, host_pool, copies, running = SlotAllocator(400), SlotAllocator(400, first=0), [], set()
    tier, required = _numbered_tier(host_pool, copies, running, admit_after_prefetch=True)
    cache = PrefixCache(kv, host=tier)
    tokens = list(range(1000, 1200))
    cache.tree.insert(tokens, kv.alloc(200))
    cache.tree.evict(200)  # copy 1, the write-back
    req = _waiting(tokens + [7])
    assert cache.prefetch([req], keep=0, most=1000) == 200 and copies[-1] == ("load", 200)
    running.add(2)  # the load, copy 2, still runs
    assert cache.prefetch_hold(req, prefetched=True) is Hold.SKIP and req.prefetch_waits == 1
    running.clear()
    assert cache.prefetch_hold(req, prefetched=True) is None
    running.add(2)
    req.prefetch_waits = MAX_PREFETCH_WAITS
    assert cache.prefetch_hold(req, prefetched=True) is None  # bounded: then its forward waits
    cache.new_step()
    assert cache.admit(req) == 200 and required == [2] and len(copies) == 2
    cache.cache_and_free(req)
    other = _waiting(tokens + [8])  # read already: the first reader's forward ordered it
    assert cache.prefetch_hold(other, prefetched=True) is None and other.prefetch_waits == 0
    cache.check([])


@pytest.mark.parametrize("window", [None, 2])
def test_prefetch_loads_for_the_queue_head_only_and_skips_what_is_on_the_gpu(window):
    """Prefetch reads the first PREFETCH_REQUESTS waiting requests (or the tier's own count),
    in order, and loads host parts only: a request whose match is all on the GPU costs no
    match (no LRU touch)."""
    kv, host_pool = SlotAllocator(4000), SlotAllocator(4000, first=0)
    loads = []
    tier = instant_tier(host_pool, load=lambda h, g: loads.append(len(g)) or len(loads), admit_after_prefetch=True)
    if window is not None:
        tier.prefetch_requests = window
    cache = PrefixCache(kv, host=tier)
    n = cache.prefetch_requests
    assert n == (window or 4)
    histories = [[1000 * (c + 1) + i for i in range(100)] for c in range(n + 2)]
    for h in histories:
        cache.tree.insert(h, kv.alloc(100))
    cache.tree.evict(cache.tree.evictable_tokens)  # every history on the host only
    on_gpu = [7, 8, 9]
    cache.tree.insert(on_gpu, kv.alloc(3))
    hot_node = cache.tree.match(on_gpu)[1]
    clock = hot_node.last_access
    waiting = [Request(f"r{c}", h + [5], SamplingParams(max_tokens=1), seed=0, max_samples=1)
               for c, h in enumerate(histories)]
    waiting.insert(1, Request("hot", on_gpu + [5], SamplingParams(max_tokens=1), seed=0, max_samples=1))
    assert cache.prefetch(waiting, keep=0, most=10_000) == 100 * (n - 1)
    assert loads == [100] * (n - 1)  # the head's cold ones; "hot" took a place
    assert cache.tree.match_lengths(histories[n - 1] + [5]) == (0, 100)  # not reached
    assert hot_node.last_access == clock  # prefetch did not mark the hot path as used
    cache.check([])


def test_a_load_evicted_unread_is_no_host_hit_later():
    kv, host_pool = SlotAllocator(300), SlotAllocator(400, first=0)
    cache = PrefixCache(kv, host=instant_tier(host_pool))
    tokens = list(range(1000, 1200))
    cache.tree.insert(tokens, kv.alloc(200))
    cache.tree.evict(200)
    waiting = _waiting(tokens + [7])
    assert cache.prefetch([waiting], keep=0, most=1000) == 200
    cache.tree.evict(200)  # unread: back to the host only
    cache.tree.insert(tokens, kv.alloc(200))  # a request computed it again: its KV takes the node over
    again = Request("s", tokens + [9], SamplingParams(max_tokens=1), seed=0, max_samples=1)
    assert cache.admit(again) == 200 and cache.host_hit_tokens == 0  # its own KV, never a load read


def test_an_undone_admission_takes_its_host_hit_back():
    """Admission counts the loads it reads as host hits; one that does not go ahead (no room)
    gives them back, so the request's later admission counts them once, even after the node went
    back to the host and was loaded again meanwhile (the CPU's multi-turn run had host hits above
    all hits: 0.83 against 0.51)."""
    kv, host_pool = SlotAllocator(300), SlotAllocator(400, first=0)
    cache = PrefixCache(kv, host=instant_tier(host_pool))
    tokens = list(range(1000, 1200))
    cache.tree.insert(tokens, kv.alloc(200))
    cache.tree.evict(200)
    req = Request("r", tokens + [7], SamplingParams(max_tokens=1), seed=0, max_samples=1)
    cache.new_step()
    assert cache.admit(req) == 200 and cache.host_hit_tokens == 200
    cache.undo_admit(req)  # no room this step
    assert (cache.host_hit_tokens, cache.hit_tokens) == (0, 0)
    cache.tree.evict(200)  # back to the host before the request's turn comes again
    assert cache.prefetch([_waiting(tokens + [7])], keep=0, most=1000) == 200
    cache.new_step()
    assert cache.admit(req) == 200 and (cache.host_hit_tokens, cache.hit_tokens) == (200, 200)
    cache.undo_admit(req)
    cache.new_step()
    assert cache.admit(req) == 200 and (cache.host_hit_tokens, cache.hit_tokens) == (200, 200)  # loaded once, read once
    cache.cache_and_free(req)
    cache.check([])


def test_slots_freed_behind_a_copy_cool_and_their_taker_waits_for_it():
    """Slots freed while a copy may still touch them are handed out after the free list, oldest
    first; whoever takes one records that copy (`copy_needed`), unless its own writes run on the
    copy stream (a load); a double free is still caught."""
    kv = SlotAllocator(10)
    a, b = kv.alloc(3), kv.alloc(3)
    kv.free(a, after_copy=5)
    kv.free(b, after_copy=7)
    assert kv.num_free == 10 and kv.copy_needed == 0
    assert sorted(kv.alloc(4)) == [7, 8, 9, 10] and kv.copy_needed == 0  # the free list first
    assert kv.alloc(2) == a[:2] and kv.copy_needed == 5  # then the oldest cooling slots
    assert kv.alloc(2, by_copy=True) == [a[2], b[0]] and kv.copy_needed == 5  # a load: ordered on its stream
    assert kv.alloc(2) == b[1:] and kv.copy_needed == 7 and kv.num_free == 0
    with pytest.raises(MemoryError):
        kv.alloc(1)
    kv.free([a[0]])
    with pytest.raises(AssertionError, match="freed twice"):
        kv.free([a[0]], after_copy=9)


def _numbered_tier(host_pool, copies: list, running: set = frozenset(), **options) -> tuple[HostTier, list[int]]:
    """A host tier whose copies are numbered in order, as the copier numbers them (the numbers
    in `running` have not completed), and the list of copy numbers it was asked to require."""
    def copy(kind):
        return lambda x, y: copies.append((kind, len(x))) or len(copies)
    required = []
    return HostTier(host_pool, write_back=copy("back"), load=copy("load"), require=required.append,
                    copy_done=lambda seq: seq not in running, **options), required


def test_a_plan_waits_only_for_the_copies_it_reads_or_whose_slots_it_takes():
    kv, host_pool, copies = SlotAllocator(400), SlotAllocator(400, first=0), []
    tier, required = _numbered_tier(host_pool, copies)
    cache = PrefixCache(kv, host=tier)
    history, cold = list(range(1000, 1200)), list(range(2000, 2100))
    cache.tree.insert(history, kv.alloc(200))
    assert cache.tree.evict(200) == 200 and copies == [("back", 200)]  # copy 1 reads those slots
    assert kv.copy_needed == 0 and kv.num_free == 400  # they cool: nobody has taken them yet
    mine = cache.alloc(100)  # a decode or prefill plan: the free list covers it
    assert kv.copy_needed == 0
    cache.tree.insert(cold, mine)
    loaded = cache.prefetch([_waiting(history + [7])], keep=0, most=150, evict=False)
    assert loaded == 150 and copies[-1] == ("load", 150)  # copy 2, into cooling slots of copy 1
    assert kv.copy_needed == 0 and required == []  # 50 cooling slots: ordered after copy 1 on its stream
    req = Request("r", history + [7], SamplingParams(max_tokens=1), seed=0, max_samples=1)
    cache.new_step()
    assert cache.admit(req) == 200  # 150 prefetched, 50 loaded now (copy 3)
    assert copies[-1] == ("load", 50) and max(required) == 3  # its forward waits for both loads
    cache.cache_and_free(req)
    again = Request("s", history + [9], SamplingParams(max_tokens=1), seed=0, max_samples=1)
    required.clear()
    assert cache.admit(again) == 200 and max(required, default=0) == 0  # ordered after r's forward
    cache.cache_and_free(again)
    assert kv.num_free == 100
    taken = cache.alloc(100)  # the last cooling slots of copy 1: the forward that writes them waits for it
    assert kv.copy_needed == 1
    kv.free(taken)
    cache.check([])


def test_the_fence_waits_for_the_copy_required_and_not_again():
    """KVTierCopier.fence: one device wait, on the end event of the latest copy the forward
    depends on; none when it depends on none or waited for it already; with `precise` off (the
    old fence), on the last copy queued."""
    cpu = torch.device("cpu")
    kv = KVCache(2, 20, 1, 4, torch.float32, cpu)
    copier = KVTierCopier([kv], HostKVPool([kv], 10, pin=False), StreamSet.create(cpu))

    class Forward:
        def __init__(self):
            self.waited = []

        def wait_event(self, event):
            self.waited.append(event)

    forward = Forward()
    first, second = copier.write_back([1, 2], [0, 1]), copier.load([0, 1], [5, 6])
    ends = {r.seq: r.end for r in copier._in_flight}
    assert (first, second) == (1, 2) and copier.fence(forward) == [("write_back", [1, 2], [0, 1]),
                                                                   ("load", [5, 6], [0, 1])]
    assert forward.waited == [] and copier.stats.fence_waits == 0  # a forward that needs neither
    copier.require(first)
    copier.fence(forward)
    assert forward.waited == [ends[1]] and copier.fenced == 1
    copier.require(first)
    copier.fence(forward)  # waited for it already
    assert forward.waited == [ends[1]] and copier.stats.fence_waits == 1
    copier.precise = False
    copier.fence(forward)
    assert forward.waited == [ends[1], ends[2]] and copier.fenced == 2
    copier.collect()  # complete: a later requirement finds nothing to wait for
    third = copier.load([2], [7])
    copier.collect()
    copier.require(third)
    copier.precise = True
    copier.fence(forward)
    assert len(forward.waited) == 2 and copier.fenced == third and copier.stats.fence_waits == 2


def test_a_timed_fence_says_why_the_forward_waits_and_what_was_still_copying():
    """The timeline's stall by cause: the fence names the cause of the latest copy required
    (a later requirement of an earlier copy keeps it) and the bytes of the copies up to it
    that had not finished when the forward was queued."""
    cpu = torch.device("cpu")
    kv = KVCache(2, 20, 1, 4, torch.float32, cpu)
    copier = KVTierCopier([kv], HostKVPool([kv], 10, pin=False), StreamSet.create(cpu))

    class Forward:
        def record_event(self, event=None):
            return event

        def wait_event(self, event):
            pass

    class Running:  # an end event the copy stream has not reached
        def query(self):
            return False

    written, loaded, later = copier.write_back([1, 2, 3], [0, 1, 2]), copier.load([0, 1], [5, 6]), copier.load([3], [7])
    for record in copier._in_flight:
        if record.seq != written:
            record.end = Running()  # the write-back is done; the two loads are not
    copier.require(loaded)
    copier.require(written, cause="slot_reuse")  # earlier: the forward waits for the load anyway
    copier.fence(Forward(), timed=True)
    wait = copier.fence_wait
    assert wait.cause == "load" and wait.pending_bytes == 2 * copier.host.token_bytes  # not the third copy's
    copier.require(later, cause="slot_reuse")
    copier.fence(Forward(), timed=True)
    assert copier.fence_wait.cause == "slot_reuse" and copier.fence_wait.pending_bytes == 3 * copier.host.token_bytes
    copier.fence(Forward(), timed=True)
    assert copier.fence_wait is None  # nothing new required: no wait


def test_a_copy_is_done_once_its_end_passed_or_it_was_collected():
    """`done` finds a copy among those in flight by its number (they stay in copy order: a
    bisection), whichever of them `collect` dropped."""
    cpu = torch.device("cpu")
    kv = KVCache(2, 20, 1, 4, torch.float32, cpu)
    copier = KVTierCopier([kv], HostKVPool([kv], 10, pin=False), StreamSet.create(cpu))

    class Running:  # an end event the copy stream has not reached
        def query(self):
            return False

    seqs = [copier.write_back([1 + i], [i]) for i in range(6)]
    running = {seqs[1], seqs[4], seqs[5]}
    for record in copier._in_flight:
        if record.seq in running:
            record.end = Running()
    copier.collect()  # drops the three whose end passed
    assert [r.seq for r in copier._in_flight] == sorted(running)
    assert [copier.done(s) for s in seqs] == [s not in running for s in seqs]
    assert copier.done(seqs[-1] + 1) and copier.done(0)  # not in flight: nothing to wait for


def test_admission_loads_say_why_they_were_not_held_for_prefetch():
    from tandem.memory.prefix_cache import MAX_PREFETCH_WAITS, MIN_LOAD_TOKENS, admission_load_reason
    req = Request("r", [1, 2, 3], SamplingParams(max_tokens=1), seed=0, max_samples=1)
    assert admission_load_reason(req, MIN_LOAD_TOKENS) == "not_held"
    assert admission_load_reason(req, MIN_LOAD_TOKENS - 1) == "small"
    req.prefetch_waits = MAX_PREFETCH_WAITS
    assert admission_load_reason(req, 10 * MIN_LOAD_TOKENS) == "waits_used"


def test_copy_pace_budget_is_a_steps_worth_at_the_measured_rate(monkeypatch):
    monkeypatch.setattr(kv_tier_copy, "WINDOW_SHARE", 0.5)  # the mechanism; the share is tuned on the device
    pace = CopyPace(token_bytes=10, most_tokens=10_000, least_tokens=10, assumed_bytes_per_s=1e6)
    assert pace.window().tokens(None) == 10  # no step seen yet
    for t in (0.0, 0.004, 0.008, 0.020, 0.024, 5.0):  # one stalled step, then an idle gap
        pace.tick(t)
    assert sorted(round(p, 6) for p in pace.periods[False]) == [0.004, 0.004, 0.004, 0.012, MAX_PERIOD_S]
    assert pace.window().tokens(None) == 200  # the assumed 1 MB/s x half the median period (4 ms) / 10 B
    assert pace.window().tokens(2.5e6) == 500  # a measured rate wins
    assert pace.window().tokens(5e9) == 10_000 and pace.window().tokens(1e3) == 10  # clamped both ways


def test_copy_pace_sizes_a_window_by_the_kind_of_step_in_flight(monkeypatch):
    monkeypatch.setattr(kv_tier_copy, "WINDOW_SHARE", 0.5)  # the mechanism; the share is tuned on the device
    pace = CopyPace(token_bytes=1, most_tokens=10_000, least_tokens=1, assumed_bytes_per_s=2**16)
    pace.tick(0.0, prefill=True)
    assert pace.window().tokens(None) == 1  # nothing timed yet
    for t, prefill in ((8, False), (9, True), (17, False), (18, True), (26, False)):
        pace.tick(t / 1024, prefill)  # prefill steps take 8/1024 s, decode-only ones 1/1024 s
    assert pace.window().tokens(None) == 32  # a decode-only step is in flight: half its 1/1024 s
    pace.tick(27 / 1024, prefill=True)
    assert pace.window().tokens(None) == 256  # a prefill step


def test_copy_pace_window_is_shared_by_both_directions(monkeypatch):
    monkeypatch.setattr(kv_tier_copy, "WINDOW_SHARE", 0.5)  # the mechanism; the share is tuned on the device
    pace = CopyPace(token_bytes=10, most_tokens=10_000, least_tokens=10, assumed_bytes_per_s=1e6)
    for t in (0.0, 0.004, 0.008):
        pace.tick(t)
    window = pace.window()
    assert window.tokens(1e6) == 200 and window.tokens(1e6, 1e6) == 100  # a load that may evict: two copies
    window.spend(1000, 1e6)  # the loads took 1 ms of the window's 2 (half the 4 ms step)
    assert window.tokens(1e6) == 100
    window.spend(2000, 1e6)  # overspent: the floor still makes progress
    assert window.tokens(1e6) == 10
    apart = pace.window(shared=False)  # the A/B: each direction the whole window
    apart.spend(1000, 1e6)
    assert apart.tokens(1e6) == 200


def test_host_tier_drops_its_coldest_leaves_and_too_big_nodes_are_dropped():
    tree, kv, host, copies = _tiered_tree(host=4)
    tree.insert([1, 2, 3], kv.alloc(3))
    tree.insert([7, 8, 9], kv.alloc(3))
    tree.evict(3)  # [1, 2, 3] is the older: to the host
    tree.evict(3)  # [7, 8, 9] needs the host room: [1, 2, 3] is dropped
    assert tree.match_length([1, 2, 3]) == 0 and tree.match_length([7, 8, 9]) == 3
    tree.insert([5] * 6, kv.alloc(6))
    tree.evict(6)  # larger than the whole host tier: dropped, nothing copied
    assert len(copies) == 2 and tree.match_length([5] * 6) == 0
    assert kv.num_free == 100 and host.num_free == 1
    tree.check({})


def test_insert_over_a_host_node_takes_the_callers_gpu_copy():
    tree, kv, host, _ = _tiered_tree()
    tree.insert([1, 2, 3, 4], kv.alloc(4))
    tree.evict(4)
    mine = kv.alloc(5)
    present, node = tree.insert([1, 2, 3, 4, 5], mine)
    assert present == 0  # nothing of the caller's is a duplicate: the tree took all five
    assert tree.match([1, 2, 3, 4, 5])[0] == mine and tree.host_tokens == 0 and host.num_free == 50
    tree.check({})


def test_locked_host_nodes_are_not_dropped():
    tree, kv, host, _ = _tiered_tree(host=3)
    tree.insert([1, 2, 3], kv.alloc(3))
    tree.evict(3)
    _, root = tree.match([1])
    (node,) = tree.host_continuation(root, [1, 2, 3], 0)
    tree.lock(node)  # being loaded
    tree.insert([4, 5, 6], kv.alloc(3))
    tree.evict(3)  # no host room: dropped, the locked host node stays
    assert tree.host_tokens == 3 and tree.match_length([4]) == 0
    tree.unlock(node)
    tree.check({})


@pytest.mark.parametrize("dtype", [torch.float32, torch.float8_e4m3fn], ids=["fp32", "fp8"])
def test_write_back_then_load_restores_the_kv(dtype):
    """Byte for byte, an e4m3 pool's too (kv_cache_dtype="fp8": the host rows are e4m3, a byte
    an element, and copied as bytes)."""
    kv = KVCache(3, 20, 2, 4, dtype, torch.device("cpu"))
    for t in kv.k + kv.v:
        t.copy_(torch.randn(t.shape) * 10)
    want = [byte_view(t[[3, 7, 8]]).clone() for t in kv.k + kv.v]
    host = HostKVPool([kv], 10, pin=False)
    assert host.data.dtype == dtype and host.token_bytes == 2 * 3 * 2 * 4 * kv.buffer.element_size()
    copier = KVTierCopier([kv], host, StreamSet.create(torch.device("cpu")))
    copier.chunk_tokens = 2  # several chunks
    copier.write_back([3, 7, 8], [5, 6, 2])
    for t in kv.k + kv.v:
        t.zero_()
    copier.load([5, 6, 2], [11, 12, 13])
    assert copier.fence(StreamSet.create(torch.device("cpu")).forward)
    copier.collect()
    for got, expect in zip(kv.k + kv.v, want):
        assert torch.equal(byte_view(got[[11, 12, 13]]), expect)
    s = copier.stats
    assert s.load_tokens == s.write_back_tokens == 3 and s.load_bytes == 3 * host.token_bytes


def test_a_draft_cache_moves_with_the_targets():
    """Two caches of other shapes (a draft's KV shares the target's slots): one host row per
    token holds both, and a write-back then load restores both at the new slots."""
    cpu = torch.device("cpu")
    target, draft = KVCache(3, 20, 2, 4, torch.float32, cpu), KVCache(1, 20, 1, 8, torch.float32, cpu)
    caches = [target, draft]
    for t in target.k + target.v + draft.k + draft.v:
        t.copy_(torch.randn_like(t))
    want = [t[[3, 7, 8]].clone() for t in target.k + target.v + draft.k + draft.v]
    host = HostKVPool(caches, 10, pin=False)
    assert host.token_parts == [2 * 3 * 2 * 4 * 4, 2 * 1 * 1 * 8 * 4] and host.token_bytes == sum(host.token_parts)
    assert HostKVPool.bytes_per_token(caches) == host.token_bytes == host.data[0].nbytes
    copier = KVTierCopier(caches, host, StreamSet.create(cpu))
    copier.chunk_tokens = 2  # several chunks
    copier.write_back([3, 7, 8], [5, 6, 2])
    assert torch.equal(host.part(host.data, 1)[5, 1], draft.v[0][3])  # the draft's V after its K
    for t in target.k + target.v + draft.k + draft.v:
        t.zero_()
    copier.load([5, 6, 2], [11, 12, 13])
    copier.fence(StreamSet.create(cpu).forward)
    copier.collect()
    for got, expect in zip(target.k + target.v + draft.k + draft.v, want):
        assert torch.equal(got[[11, 12, 13]], expect)
    assert copier.stats.load_bytes == copier.stats.write_back_bytes == 3 * host.token_bytes
    with pytest.raises(ValueError, match="one dtype"):
        HostKVPool([target, KVCache(1, 20, 1, 8, torch.float16, cpu)], 4, pin=False)


def test_contiguous_runs():
    assert contiguous_runs([4, 5, 6, 9, 2, 3]) == [(0, 4, 3), (3, 9, 1), (4, 2, 2)]
    assert contiguous_runs([]) == []


def test_eviction_takes_the_least_recently_used_node_in_both_tiers():
    """The LRU heaps against a brute-force scan: after random inserts, matches, locks,
    evictions and subtree drops, each eviction's victim is a least recently used eligible node
    (GPU: unlocked, no GPU child; host: a host copy that may go), the debug check finds no node
    missing from either heap, and no host slot is lost or freed twice."""
    rng = random.Random(5)
    tree, kv, host, _ = _tiered_tree(gpu=400, host=120)
    held = []
    for _ in range(300):
        op = rng.random()
        tokens = [rng.randrange(4) for _ in range(rng.randint(1, 12))]
        if op < 0.35 and kv.num_free >= len(tokens):
            present, node = tree.insert(tokens, kv.alloc(len(tokens)))
        elif op < 0.55:
            _, node = tree.match(tokens)
            if node is not tree.root and rng.random() < 0.5:
                tree.lock(node)
                held.append(node)
        elif op < 0.65 and held:
            tree.unlock(held.pop(rng.randrange(len(held))))
        elif op < 0.70:  # no room on the host for them: dropped with their host-only subtrees
            tree.evict(rng.randint(1, 8), to_host=False)
        elif op < 0.85:
            nodes = list(tree._nodes())
            gpu = [n for n in nodes if tree._gpu_evictable(n)]
            if gpu:
                oldest = min(n.last_access for n in gpu)
                tree.evict(1)
                taken = [n for n in gpu if not n.slots or not attached(n)]
                assert len(taken) == 1 and taken[0].last_access == oldest
        else:
            nodes = list(tree._nodes())
            droppable = [n for n in nodes if tree.host_tier._droppable(n)]
            if droppable:
                oldest = min(n.last_access for n in droppable)
                tree.evict_host(1)
                dropped = [n for n in droppable if n.host_slots is None]
                assert len(dropped) == 1 and dropped[0].last_access == oldest
        tree.check({id(n): sum(1 for h in held for p in _path(tree, h) if p is n) for n in tree._nodes()})
        assert host.num_free + len(tree.all_host_slots()) == host.count  # no host slot lost or freed twice


def _path(tree, node):
    while node is not tree.root:
        yield node
        node = node.parent


def test_a_dropped_subtrees_host_copies_are_freed_once():
    """Dropping a GPU node drops its host-only descendants and frees their host slots; the
    host tier's LRU heap still holds entries for them, which must read as dead (the H200 suite
    at afbd3bd: `reset_prefix_cache` after warm-up freed a host slot twice)."""
    tree, kv, host, copies = _tiered_tree()
    tree.insert([1, 2, 3], kv.alloc(3))
    b = kv.alloc(6)
    present, _ = tree.insert([1, 2, 3, 4, 5, 6], b)
    kv.free(b[:present])  # the caller's duplicates
    assert tree.evict(3) == 3  # [4, 5, 6] to the host only
    assert tree.host_tokens == 3
    free_before = host.num_free
    assert tree.evict(3, to_host=False) == 3  # [1, 2, 3] dropped with its host-only child
    assert host.num_free == free_before + 3 and tree.host_tokens == 0
    assert tree.evict_host(10) == 0  # nothing left to drop, and nothing freed twice
    tree.check({})


def test_a_kept_match_walk_equals_a_fresh_one_whatever_the_tree_did():
    """`match_lengths_again` returns its kept walk only while that walk still holds: after
    random inserts, splits, evictions to the host, drops, host-tier drops and loads, its answer
    for a fixed set of waiting prompts equals a fresh `match_lengths` every time. And it is
    kept (not walked again) across operations that leave its path alone."""
    rng = random.Random(11)
    tree, kv, host, _ = _tiered_tree(gpu=300, host=150)
    prompts = [[rng.randrange(3) for _ in range(rng.randint(4, 20))] for _ in range(12)]
    walks: list = [None] * len(prompts)
    kept = 0
    for _ in range(600):
        op = rng.random()
        tokens = [rng.randrange(3) for _ in range(rng.randint(1, 16))]
        if op < 0.3 and kv.num_free >= len(tokens):
            present, _ = tree.insert(tokens, kv.alloc(len(tokens)))
        elif op < 0.45:
            tree.match(tokens)  # may split a node
        elif op < 0.65:
            tree.evict(rng.randint(1, 10))
        elif op < 0.7:
            tree.evict(rng.randint(1, 6), to_host=False)
        elif op < 0.8:
            tree.evict_host(rng.randint(1, 6))
        elif op < 0.9:  # a load of the host part of a match, as admission and prefetch do it
            slots, node = tree.match(tokens)
            path = tree.host_continuation(node, tokens, len(slots))
            if path and kv.num_free >= len(path[0].key):
                tree.mark_loaded(path[0], kv.alloc(len(path[0].key)), copy_seq=1)
        else:
            tree.write_ahead(rng.randint(1, 20))
        for i, prompt in enumerate(prompts):
            end = rng.choice([len(prompt), len(prompt) - 1])
            walk = tree.match_lengths_again(prompt, end, walks[i])
            kept += walk is walks[i]
            assert (walk.gpu, walk.cached) == tree.match_lengths(prompt, end), (prompt, end)
            walks[i] = walk
    assert kept > 600  # most operations leave most prompts' paths alone


def test_prefetch_hold_sees_a_prefix_evicted_to_the_host_after_it_asked():
    """The kept walk of a waiting prompt notices eviction to the host (none of its tokens
    changed, only their tier), and a load back."""
    kv, host_pool = SlotAllocator(400), SlotAllocator(400, first=0)
    cache = PrefixCache(kv, host=instant_tier(host_pool, admit_after_prefetch=True))
    tokens, slots = list(range(1000, 1200)), kv.alloc(200)
    cache.tree.insert(tokens, slots)
    req = Request("r", tokens + [7], SamplingParams(max_tokens=1), seed=0, max_samples=1)
    assert cache.prefetch_hold(req, prefetched=True) is None  # all on the GPU
    cache.tree.evict(200)
    assert cache.prefetch_hold(req, prefetched=True) is not None  # now all on the host
    assert cache.prefetch([req], keep=0, most=200) == 200
    assert cache.prefetch_hold(req, prefetched=True) is None  # loaded back


def _tree_dump(tree) -> list:
    """Every node's path of keys, slots and host slots, in a canonical order."""
    out, stack = [], [((), tree.root)]
    while stack:
        path, node = stack.pop()
        for first in sorted(node.children):
            child = node.children[first]
            key = path + (tuple(child.key),)
            out.append((key, tuple(child.slots), None if child.host_slots is None else tuple(child.host_slots)))
            stack.append((key, child))
    return sorted(out)


def _twin_trees(seed: int, rounds: int):
    """Two tiered trees that take the same random operations: each round, an insertion,
    eviction, host eviction or write-ahead is done on both, or else it is an admission of
    prompts[i][:end] for the caller to do on each. Yields (trees, prompts, admission, i, end)."""
    rng = random.Random(seed)
    trees = [_tiered_tree(gpu=300, host=150) for _ in range(2)]
    prompts = [[rng.randrange(3) for _ in range(rng.randint(4, 20))] for _ in range(10)]
    for _ in range(rounds):
        op, tokens = rng.random(), [rng.randrange(3) for _ in range(rng.randint(1, 16))]
        i, evict = rng.randrange(len(prompts)), rng.randint(1, 10)
        end = len(prompts[i]) - rng.randint(0, 1)
        for tree, kv, _, _ in trees:
            if op < 0.3:
                if kv.num_free >= len(tokens):
                    tree.insert(tokens, kv.alloc(len(tokens)))
            elif op < 0.5:
                tree.evict(evict)
            elif op < 0.6:
                tree.evict_host(3)
            elif op < 0.7:
                tree.write_ahead(10)
        yield trees, prompts, op >= 0.7, i, end


def test_a_match_along_a_kept_walk_does_what_a_walked_match_does():
    """Two trees take the same random operations; admissions match with the kept walk on one
    and walk the tokens on the other: same slots, same end node, same tree (splits, tiers),
    and the same eviction order afterwards (the same touches)."""
    walks: list = [None] * 10
    followed = 0
    for trees, prompts, admission, i, end in _twin_trees(7, 500):
        for side, (tree, kv, host, _) in enumerate(trees):
            if admission:  # an admission's match, then a load of its host part
                prefix = prompts[i][:end]
                if side == 0:
                    walks[i] = tree.match_lengths_again(prompts[i], end, walks[i])
                    followed += tree._path_stands(walks[i])
                    slots, node = tree.match(prefix, walks[i])
                else:
                    slots, node = tree.match(prefix)
                path = tree.host_continuation(node, prefix, len(slots))
                if path and kv.num_free >= len(path[0].key):
                    tree.mark_loaded(path[0], kv.alloc(len(path[0].key)), copy_seq=1)
                if side == 0:
                    got = (slots, [n.key for n in _path(tree, node)])
                else:
                    assert (slots, [n.key for n in _path(tree, node)]) == got
        assert _tree_dump(trees[0][0]) == _tree_dump(trees[1][0])
    assert followed > 50
    while trees[0][0].evict(1):  # the same LRU order: the same node goes each time
        assert trees[1][0].evict(1)
        assert _tree_dump(trees[0][0]) == _tree_dump(trees[1][0])
    assert not trees[1][0].evict(1)


# ---- kept walks: trusted while nothing under their first node changed, re-walked cheaply ----
_HISTORY = list(range(1, 21))  # two nodes once inserted in two parts: [1..10], [11..20]
_PROMPT = _HISTORY + [99]  # a waiting prompt: its history, then a token no child has


def _history_tree():
    """A tree holding _HISTORY as two GPU nodes, and an unrelated prompt [50..59] used after
    it (so LRU eviction takes the history's leaf first); the waiting prompt's kept walk."""
    tree, kv, host, copies = _tiered_tree(gpu=100, host=50)
    slots = kv.alloc(20)
    tree.insert(_HISTORY[:10], slots[:10])
    tree.insert(_HISTORY, slots)
    kv.free(slots[:10])  # the second insert's duplicates of the first ten
    tree.insert(list(range(50, 60)), kv.alloc(10))
    return tree, kv, slots, tree.match_lengths_again(_PROMPT, len(_PROMPT), None)


def _to_host(tree, kv, walk):
    assert tree.evict(10) == 10  # the history's leaf [11..20] (LRU) to the host
    return tree.match_lengths_again(_PROMPT, len(_PROMPT), walk)


def _load_back(tree, kv, walk):
    walk = _to_host(tree, kv, walk)
    slots, node = tree.match(_HISTORY)
    (host_node,) = tree.host_continuation(node, _HISTORY, len(slots))
    tree.mark_loaded(host_node, kv.alloc(10), copy_seq=1)
    return walk


def _split(tree, kv, walk):
    present, _ = tree.insert(_HISTORY[:5] + [77, 78], kv.alloc(7))  # splits [1..10] after 5
    assert present == 5
    return walk


def _new_child_where_it_stopped(tree, kv, walk):
    tree.insert(_PROMPT + [100], kv.alloc(22))  # its own 20 duplicate the cached ones: no matter here
    return walk


def _host_drop(tree, kv, walk):
    walk = _to_host(tree, kv, walk)
    assert tree.evict_host(10) == 10  # the host-only leaf leaves the tree
    return walk


def _drop(tree, kv, walk):
    assert tree.evict(10, to_host=False) == 10
    return walk


def _promote(tree, kv, walk):
    walk = _to_host(tree, kv, walk)
    tree.insert(_HISTORY, kv.alloc(20))  # a request computed it again: its slots make [11..20] GPU-resident
    return walk


@pytest.mark.parametrize("change", [_to_host, _load_back, _split, _new_child_where_it_stopped, _host_drop,
                                    _drop, _promote])
def test_every_change_a_kept_walk_depends_on_is_seen(change):
    """Each way the tree changes a kept walk's answer or path (a tier move either way, a
    split, a new child where it stopped, a host-tier drop, a drop, a promotion) reaches
    `_path_stands` through `Node.changed` on the walk's first node: its answer and the match
    along it equal a fresh walk's. Without the bump the kept walk is trusted as it was."""
    tree, kv, _, walk = _history_tree()
    walk = change(tree, kv, walk)
    again = tree.match_lengths_again(_PROMPT, len(_PROMPT), walk)
    assert (again.gpu, again.cached) == tree.match_lengths(_PROMPT)
    slots, node = tree.match(_PROMPT, again)
    assert (slots, node) == tree.match(_PROMPT)  # a second match: no split left to make
    tree.check({})


def test_a_kept_walk_is_trusted_without_its_path_while_its_subtree_stands(monkeypatch):
    """Changes elsewhere (another prompt's subtree, write-ahead copies that keep the GPU
    copies) leave the kept walk as it is, its path unread; the first change under its first
    node checks the path again, and a path that still stands is trusted again after that."""
    tree, kv, _, walk = _history_tree()
    checked = []
    real = tree._path_checked
    monkeypatch.setattr(tree, "_path_checked", lambda w: checked.append(w) or real(w))
    tree.insert(list(range(50, 65)), kv.alloc(15))  # the other prompt's subtree grows
    assert tree.write_ahead(20) > 0  # host copies; every GPU copy stays
    assert tree.match_lengths_again(_PROMPT, len(_PROMPT), walk) is walk and not checked
    tree.insert(_HISTORY + [98], kv.alloc(21))  # a sibling of the stop token: the path stands
    assert tree.match_lengths_again(_PROMPT, len(_PROMPT), walk) is walk and len(checked) == 1
    assert tree.match_lengths_again(_PROMPT, len(_PROMPT), walk) is walk and len(checked) == 1  # stamped again


def test_a_rewalk_compares_only_the_tokens_of_nodes_that_changed(monkeypatch):
    """A kept walk whose path broke is walked again from its nodes: one that is still where
    it was and as long takes its matched length as it was (a key changes only by a split,
    which shortens it); only new or shortened nodes compare tokens."""
    from tandem.memory import radix_cache
    tree, kv, _, walk = _history_tree()
    compared = []
    real = radix_cache.common_length
    monkeypatch.setattr(radix_cache, "common_length", lambda key, *a: compared.append(len(key)) or real(key, *a))
    walk = _to_host(tree, kv, walk)  # only a tier changed: no token compared
    assert (walk.gpu, walk.cached) == (10, 20) and compared == []
    _split(tree, kv, walk)  # [1..10] -> [1..5] above [6..10]: both compare, [11..20] does not
    compared.clear()  # the insert's own
    walk = tree.match_lengths_again(_PROMPT, len(_PROMPT), walk)
    assert (walk.gpu, walk.cached) == (10, 20) and compared == [5, 5]
    assert tree.match_lengths(_PROMPT) == (10, 20)


def _node_by_node_match(tree, tokens: list[int]):
    """`RadixCache.match` as it was before `_use_path`: every node of the path split, marked and
    touched in both LRU heaps one by one (`_use`). The reference its shortcuts must equal."""
    from tandem.memory import radix_cache
    node, slots, i = tree.root, [], 0
    now = next(radix_cache._clock)
    while i < len(tokens):
        child = node.children.get(tokens[i])
        if child is None or not child.slots:
            break
        n = radix_cache.common_length(child.key, tokens, i)
        child = tree._use(child, n, now)
        slots += child.slots
        node, i = child, i + n
    return slots, node


def _use_order(tree) -> list:
    """Every node's last use as its rank among them (the clock is shared by all trees)."""
    ranks = {t: r for r, t in enumerate(sorted({n.last_access for n in tree._nodes()}))}
    return [ranks[n.last_access] for n in tree._nodes()]


def _live_entries(tree, heap) -> list:
    """The heap's live entries in its pop order, each as its node's path of keys."""
    return [tuple(tuple(n.key) for n in _path(tree, node)) for key, _, node in sorted(heap._heap)
            if key == node.last_access and heap.eligible(node)]


def test_a_match_touches_the_heaps_as_node_by_node_touches_did():
    """`match` (walked or along a kept walk) pushes only the entries that can be live (the
    path's last node for GPU eviction, its nodes with host copies for the host tier): both
    heaps' live entries, in order, and every node's last use equal those of touching every
    node of the path in both heaps."""
    walks: list = [None] * 10
    for trees, prompts, admission, i, end in _twin_trees(5, 400):
        for side, (tree, kv, host, _) in enumerate(trees):
            if admission:  # an admission's match (kept walk or not), then a load of its host part
                kept = i % 2 == 0
                if side == 0:
                    if kept:
                        walks[i] = tree.match_lengths_again(prompts[i], end, walks[i])
                    slots, node = tree.match(prompts[i], walks[i] if kept else None, end)
                else:
                    slots, node = _node_by_node_match(tree, prompts[i][:end])
                path = tree.host_continuation(node, prompts[i], len(slots), end)
                if path and kv.num_free >= len(path[0].key):
                    tree.mark_loaded(path[0], kv.alloc(len(path[0].key)), copy_seq=1)
        (a, *_), (b, *_) = trees
        assert _tree_dump(a) == _tree_dump(b)
        assert _use_order(a) == _use_order(b)
        assert _live_entries(a, a.lru) == _live_entries(b, b.lru)
        assert _live_entries(a, a.host_tier.lru) == _live_entries(b, b.host_tier.lru)


def test_slots_come_out_in_the_order_they_always_did():
    """`alloc` hands out the free list's last slots in pop() order (low slots first from a
    fresh pool, the earliest freed first after a free), then cooling slots oldest first: the
    same slots in the same order as popping one by one, over random allocs and frees."""
    kv = SlotAllocator(10)
    assert kv.alloc(3) == [1, 2, 3]
    kv.free([2, 1])
    assert kv.alloc(3) == [2, 1, 4]
    rng = random.Random(3)
    kv, free, cooling, held = SlotAllocator(200), list(range(200, 0, -1)), [], []
    for _ in range(2000):
        if held and rng.random() < 0.5:
            slots = held.pop(rng.randrange(len(held)))
            seq = rng.choice([0, 0, 1])
            kv.free(slots, after_copy=seq)
            if seq:
                cooling += slots
            else:
                free += reversed(slots)
        else:
            n = rng.randint(0, min(30, len(free) + len(cooling)))
            want = [free.pop() for _ in range(min(n, len(free)))]
            want += [cooling.pop(0) for _ in range(n - len(want))]
            assert kv.alloc(n) == want
            held.append(want)
