"""Who owns which KV slot: the free list, the radix tree, or a request.

A request's table row lists the slots of its tokens in order (`req.kv_slots`). The first
`req.cached_len` of them belong to the radix tree and are locked by the request (through
`req.cache_node`); the rest belong to the request, which frees them when it is released, as
does the list `req.duplicate_slots` (tokens another request cached first while this one was
computing them; the request keeps reading its own copy, so they stay until it is released).

Lifetime rules (the one-step lag): `release` and `preempt` run only when no launched step can
still read or write the request's KV (finished requests are released once their last step
completed; preemption happens after the in-flight step was processed). `cache_prefill` caches
tokens whose KV writes were launched but may still run: later readers are ordered behind them
on the forward stream. Eviction takes only nodes no request locks, and a request locks what it
uses until it is released, so nothing an in-flight step reads can be evicted.

With caching disabled the same calls keep the same books with an always-empty tree.

Host tier (`HostTier`): eviction writes unreferenced prefixes back to pinned host memory, and
`admit` loads the host-resident part of a match back into fresh GPU slots (at most
`load_tokens_per_step` tokens per planned step: the copy's share of the step). The copies'
ordering rules are in `tandem.overlap.kv_tier_copy`.
"""
from __future__ import annotations

import enum
import itertools
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Callable

from tandem.memory.allocator import SlotAllocator
from tandem.memory.radix_cache import HostTierHooks, Node, RadixCache
from tandem.request import Request


MIN_LOAD_TOKENS = 64  # a smaller piece of a host node waits for a larger budget
MAX_PREFETCH_WAITS = 32  # plans a request waits for prefetch before its admission loads the rest
PREFETCH_REQUESTS = 4  # default of the waiting requests at the queue's head whose host parts prefetch loads


class Hold(enum.Enum):
    """Why admission holds a waiting request back for the host tier (`PrefixCache.prefetch_hold`)."""

    SKIP = "skip"  # prefetch is loading its host part: the requests behind it may go ahead
    STOP = "stop"  # prefetch has not reached it: it keeps its place, nobody behind it passes (FIFO)


@dataclass
class HostTier:
    """The host tier as the prefix cache sees it: host slots and the two copy directions."""

    host_slots: SlotAllocator
    write_back: Callable[[list[int], list[int]], int]  # (gpu_slots, host_slots) -> the copy's number
    load: Callable[[list[int], list[int]], int]  # (host_slots, gpu_slots) -> the copy's number
    require: Callable[[int], None]  # the next forward waits for this copy (it reads what the copy loads)
    copy_done: Callable[[int], bool]  # has this copy completed? (asks the device, never waits)
    load_tokens_per_step: int = 16384
    admit_after_prefetch: bool = False  # `PrefixCache.prefetch_hold`
    fifo_beyond_prefetch: bool = False  # `PrefixCache.prefetch_hold`
    prefetch_requests: int = PREFETCH_REQUESTS  # `PrefixCache.prefetch`


@dataclass
class TierMoves:
    """Tokens the prefix cache queued between tiers, by why (the copier counts all bytes and
    times). A plan's own copies (admission loads, eviction write-backs) are what its forward
    waits for; the window's (prefetch, write-ahead) run beside the step in flight."""

    prefetched: int = 0  # loads for waiting requests, in the processing window
    # Loads by an admission (its step's forward waits for them), by why admission did not hold
    # the request for prefetch (`admission_load_reason`).
    admission_loaded_by: Counter = field(default_factory=Counter)
    written_ahead: int = 0  # write-backs ahead of pressure, in the processing window

    @property
    def admission_loaded(self) -> int:
        return sum(self.admission_loaded_by.values())


def admission_load_reason(req: Request, loaded: int) -> str:
    """Why an admission loaded host KV itself (its forward waits for the copy) rather than
    being held for prefetch (`PrefixCache.prefetch_hold`): it used its MAX_PREFETCH_WAITS
    ("waits_used"), less than MIN_LOAD_TOKENS were left ("small"), or it was not held at all
    ("not_held": nothing was running, or holding is off)."""
    if req.prefetch_waits >= MAX_PREFETCH_WAITS:
        return "waits_used"
    return "small" if loaded < MIN_LOAD_TOKENS else "not_held"


def _input(req: Request) -> list[int]:
    """`req.fill_ids`, the tokens its cached prefix is matched against (up to
    `max_cached_prefix`, passed as an end: no copy to cut them). A waiting request's outputs
    are empty unless it was preempted: no copy of its prompt then (~4-8k tokens a long-match
    admission on the CPU replay of issue 23)."""
    return req.fill_ids if req.output_token_ids else req.prompt_token_ids


class PrefixCache:
    def __init__(self, kv_slots: SlotAllocator, enabled: bool = True, debug: bool = False,
                 host: HostTier | None = None):
        self.kv_slots, self.enabled, self.debug = kv_slots, enabled, debug
        self.host = host if enabled else None
        hooks = HostTierHooks(host.host_slots, host.write_back) if self.host is not None else None
        self.tree = RadixCache(kv_slots.free, hooks)
        self.hit_tokens = 0  # running totals, in prompt tokens
        self.queried_tokens = 0
        self.host_hit_tokens = 0  # admitted tokens read from loads (an undone admission keeps its count)
        self.tier_moves = TierMoves()
        self._load_tokens_left = 0  # this step's load budget (new_step)
        self._wait_counted = False  # a held request counted a wait in this plan (`prefetch_hold`)

    # ---- capacity ----
    @property
    def evictable_tokens(self) -> int:
        return self.tree.evictable_tokens

    def available(self) -> int:
        """Slots a request could get now: free ones plus what eviction can free."""
        return self.kv_slots.num_free + self.tree.evictable_tokens

    def alloc(self, n: int, by_copy: bool = False) -> list[int]:
        """n free slots, evicting unreferenced cached prefixes (LRU) first if needed. `by_copy`:
        for a load, which the copy stream orders after earlier copies of the same slots (else
        the next forward waits for them: `SlotAllocator.copy_needed`)."""
        short = n - self.kv_slots.num_free
        if short > 0:
            self.tree.evict(short)
        return self.kv_slots.alloc(n, by_copy)

    def new_step(self) -> None:
        """A step is being planned: its loads from the host tier start a fresh budget."""
        if self.host is not None:
            self._load_tokens_left = self.host.load_tokens_per_step
            self._wait_counted = False

    def write_ahead(self, next_need: int, most: int | None = None) -> int:
        """In the processing window: when the next plan may need `next_need` slots and fewer are
        free, copy cold cached prefixes to the host tier ahead of that pressure (their GPU
        copies stay), so the plan's evictions copy nothing and its forward waits for nothing.
        At most about `most` tokens a call (whole nodes; the first one whatever its size):
        the rest in later windows (`CopyPace`)."""
        short = next_need - self.kv_slots.num_free
        if self.host is None or short <= 0:
            return 0
        queued = self.tree.write_ahead(short, most)
        self.tier_moves.written_ahead += queued
        return queued

    def evict_ahead(self, next_need: int) -> int:
        """In the processing window, after `write_ahead`: free slots until the next plan's
        `next_need` are free, evicting only cold prefixes whose host copies exist (no copy is
        queued), so that the plan allocates without walking eviction. Returns the slots freed.
        Ordering: the freed slots' write-backs were queued before, and the forward that reuses
        them waits for every queued copy (`KVTierCopier.fence`), as for the plan's own evictions."""
        short = next_need - self.kv_slots.num_free
        if self.host is None or short <= 0:
            return 0
        return self.tree.evict_copied(short)

    # ---- a request's prefix ----
    def match_length(self, req: Request) -> int:
        """Tokens of the request's input that admission would reuse (no state changes)."""
        if not self.enabled:
            return 0
        return min(self.tree.match_length(req.fill_ids), req.max_cached_prefix)

    def admit(self, req: Request) -> int:
        """Give a newly (re)admitted request the longest cached prefix of its input and lock
        it. At least the last input token is always recomputed: its logits are needed; so is
        every row whose logits owe a prompt logprob (`Request.max_cached_prefix`: a request
        asking for prompt logprobs takes no hit on its first admission). Returns the matched
        length."""
        req.kv_slots, req.cached_len, req.cache_node, req.duplicate_slots, req.host_hit_nodes = [], 0, None, [], []
        self.queried_tokens += req.fill_len
        if not self.enabled:
            return 0
        tokens, end = _input(req), req.max_cached_prefix
        slots, node = self.tree.match(tokens, req.host_match_walk, end)
        if self.host is not None:
            loaded, node = self._load_host_part(node, tokens, end, len(slots), self._load_tokens_left)
            self._load_tokens_left -= len(loaded)
            if loaded:
                self.tier_moves.admission_loaded_by[admission_load_reason(req, len(loaded))] += len(loaded)
            slots += loaded  # match() gave a list of its own: no copy of a long match
        if slots:
            self.tree.lock(node)
            req.kv_slots, req.cached_len, req.cache_node = slots, len(slots), node
            self.hit_tokens += len(slots)
            if self.host is not None:
                req.host_hit_nodes = self.tree.take_loaded(node)  # now or prefetched, first use
                # Its first forward reads them: it waits for their loads (a later reader is
                # ordered after that forward on the forward stream).
                self.host.require(max((n.copy_seq for n in req.host_hit_nodes), default=0))
                self.host_hit_tokens += sum(len(n.key) for n in req.host_hit_nodes)
        return len(slots)

    @property
    def prefetch_requests(self) -> int:
        """How many waiting requests at the queue's head prefetch loads for (0: no host tier)."""
        return self.host.prefetch_requests if self.host is not None else 0

    def prefetch_hold(self, req: Request, prefetched: bool) -> Hold | None:
        """Should admission hold back `req` (`prefetched`: among the `prefetch_requests` at the
        queue's head, whose host parts prefetch loads in the processing windows) while requests
        run, rather than admit it now, when its step's forward would wait on the device for its
        match's KV to load? Only while MIN_LOAD_TOKENS or more of it are on the host only, or a
        load it would read first is still running (`_loads_running`). SKIP a prefetched request,
        for at most MAX_PREFETCH_WAITS plans (then admission loads the rest and its forward
        waits). A plan counts a wait for the first request it holds only: prefetch loads the
        queue's head first, so the ones behind it wait for the head's loads before their own
        start (counted for each of the PREFETCH_REQUESTS, the fourth of four 9k-token histories
        used its waits behind the first three's loads: H100, a48dbb5, 8k tokens loaded at
        admission, none with one count a plan). With `fifo_beyond_prefetch`, STOP at one
        prefetch has not reached (first come, first served), else SKIP it too, uncounted: its
        wait starts when prefetch reaches it (counted from the queue's tail, the long queue's
        late turns had used up their waits before prefetch began theirs, and their admissions
        loaded 4-9k tokens while the GPU waited: H100, 6fa100a). FIFO cut the TTFT p99 tail on the H200 at dfb50b0 (9.0 -> 7.5
        s: without it, requests whose prefixes stayed on the GPU keep passing) but cost a
        quarter of the throughput (the batch drains while the head loads), so it is an
        experiment (`Experiments.host_kv_fifo_beyond_prefetch`). The caller asks only while
        requests run: an idle GPU gains nothing by waiting."""
        host = self.host
        if host is None or not host.admit_after_prefetch or req.prefetch_waits >= MAX_PREFETCH_WAITS:
            return None
        if self._host_only_tokens(req) < MIN_LOAD_TOKENS and not self._loads_running(req):
            return None
        if not prefetched:
            return Hold.STOP if host.fifo_beyond_prefetch else Hold.SKIP
        if not self._wait_counted:  # the first held in this plan: prefetch loads its part first
            req.prefetch_waits += 1
            self._wait_counted = True
        return Hold.SKIP

    def _loads_running(self, req: Request) -> bool:
        """A load the request's admission would read first (its match's unread loads, on the
        kept walk of `_host_only_tokens`) has not completed: its forward would wait for it."""
        seq = 0
        for node, _, on_gpu in req.host_match_walk.path:  # a loop, not max(genexpr): asked ~17 times a plan
            if on_gpu and node.loaded and node.copy_seq > seq:
                seq = node.copy_seq
        return seq > 0 and not self.host.copy_done(seq)

    def _host_only_tokens(self, req: Request) -> int:
        """Tokens of its match that live on the host only. Asked of the waiting prompts at every
        plan (admission) and window (prefetch): the walk is kept on the request and checked,
        not redone, while its path stands (H200, 64 waiting ~10k-token histories: the walks
        were 1.07 ms of a prefill step's plan)."""
        req.host_match_walk = walk = self.tree.match_lengths_again(_input(req), req.max_cached_prefix,
                                                                   req.host_match_walk)
        return walk.cached - walk.gpu

    def _load_host_part(self, node: Node, tokens: list[int], end: int, start: int,
                        most: int) -> tuple[list[int], Node]:
        """Load the host-resident continuation within tokens[:end] of a match (tokens[:start]
        ending at `node`) into GPU slots (evicting colder prefixes for them), at most `most`
        tokens (a node that does not fit is split: `_fitting`).
        Returns the loaded slots and the node where the match now ends. The loaded nodes stay
        cached (in both tiers) even if the admission they were loaded for does not go ahead."""
        path = self.tree.host_continuation(node, tokens, start, end)
        if not path:
            return [], node
        self.tree.lock(node)  # the GPU part of the match stays while eviction makes room
        take = self._fitting(path, min(most, self.available()))
        gpu_slots = self._load(take) if take else []
        self.tree.unlock(node)
        return gpu_slots, (take[-1] if take else node)

    def _load(self, nodes: list[Node]) -> list[int]:
        """Queue the load of consecutive host-only nodes into fresh GPU slots; they are in both
        tiers afterwards (evicting them again costs no copy)."""
        total = sum(len(n.key) for n in nodes)
        self.tree.lock(nodes[-1])  # eviction's write-backs must not drop what is being loaded
        gpu_slots = self.alloc(total, by_copy=True)
        copy_seq = self.host.load([h for n in nodes for h in n.host_slots], gpu_slots)
        at = 0
        for host_node in nodes:
            self.tree.mark_loaded(host_node, gpu_slots[at:at + len(host_node.key)], copy_seq)
            at += len(host_node.key)
        self.tree.unlock(nodes[-1])
        return gpu_slots

    def prefetch(self, waiting: Iterable[Request], keep: int, most: int, evict: bool = True) -> int:
        """In the processing window: load the host part of the matches of the first
        `prefetch_requests` `waiting` requests (the queue's head, in order), at most
        `most` tokens, into slots beyond the `keep` the next plan may need, so that admission
        finds them on the GPU and the forward reading them has had a step's head start. Returns
        the tokens queued.
        `evict`: the slots may come from evicting colder cached prefixes (LRU, written back in
        this window unless written ahead). With a full pool (the steady state of a cache: every
        released request's tokens stay cached) free slots alone left prefetch nothing to load,
        and every load waited for the admission that needed it. Off: free slots only (at
        11407aa, evicting for requests not admitted yet, in a pool too small for the running
        set, made room the running requests then took back; `keep` now reserves their need)."""
        queued = 0
        for req in itertools.islice(waiting, self.prefetch_requests):
            if not self._host_only_tokens(req):
                continue  # nothing to load: no match, which would mark its path as used
            room = (self.available() if evict else self.kv_slots.num_free) - keep
            tokens, end = _input(req), req.max_cached_prefix
            slots, node = self.tree.match(tokens, req.host_match_walk, end)
            loaded, _ = self._load_host_part(node, tokens, end, len(slots), min(most - queued, room))
            queued += len(loaded)
            if loaded:  # walked again here, beside the forward, not by the next plan's admission scan
                self._host_only_tokens(req)
        self.tier_moves.prefetched += queued
        return queued

    def _fitting(self, path: list[Node], room: int) -> list[Node]:
        """The leading nodes of `path` whose tokens fit in `room`; a node that does not fit
        is split and its head taken if that is at least MIN_LOAD_TOKENS (a history's node is
        often larger than a window's budget: it then loads over several windows)."""
        take, total = [], 0
        for node in path:
            if total + len(node.key) > room:
                if room - total >= MIN_LOAD_TOKENS:
                    take.append(self.tree.split(node, room - total))
                break
            take.append(node)
            total += len(node.key)
        return take

    def undo_admit(self, req: Request) -> None:
        """Admission did not go ahead (no room): drop the lock, keep the tree as it was."""
        if req.cache_node is not None:
            self.tree.give_back_loaded(req.host_hit_nodes)  # before the unlock: still on the GPU
            self.host_hit_tokens -= sum(len(n.key) for n in req.host_hit_nodes)
            self.tree.unlock(req.cache_node)
            self.hit_tokens -= req.cached_len
        self.queried_tokens -= req.fill_len
        req.kv_slots, req.cached_len, req.cache_node, req.host_hit_nodes = [], 0, None, []

    def cache_prefill(self, req: Request) -> None:
        """Cache the prompt tokens whose KV writes were launched, so that requests sharing
        them (and this one, if preempted) reuse them. Decode tokens wait for `cache_and_free`."""
        upto = min(req.num_computed, req.prefill_target)
        if self.enabled and upto > req.cached_len:
            self._insert(req, upto)

    def cache_and_free(self, req: Request) -> None:
        """The request is done with its KV (no launched step can touch it): cache every token
        whose KV exists and whose id is known, and free the rest."""
        known = min(req.num_computed, len(req.prompt_token_ids) + len(req.output_token_ids))
        if self.enabled and known > req.cached_len:
            self._insert(req, known)
        if req.cache_node is not None:
            self.tree.unlock(req.cache_node)
        self.kv_slots.free(req.kv_slots[req.cached_len:] + req.duplicate_slots)
        req.kv_slots, req.cached_len, req.cache_node, req.duplicate_slots, req.host_hit_nodes = [], 0, None, [], []

    def _insert(self, req: Request, upto: int) -> None:
        present, node = self.tree.insert(req.fill_ids[:upto], req.kv_slots[:upto])
        # Tokens [cached_len, present) were cached by someone else meanwhile: ours duplicate them.
        req.duplicate_slots += req.kv_slots[req.cached_len:present]
        self.tree.lock(node)
        if req.cache_node is not None:
            self.tree.unlock(req.cache_node)
        req.cache_node, req.cached_len = node, upto

    def reset(self) -> int:
        """Drop every cached prefix no request uses, in both tiers. Returns the GPU slots freed."""
        freed = self.tree.evict(self.tree.evictable_tokens, to_host=False)
        if self.host is not None:
            self.tree.evict_host(self.tree.host_tokens)
        return freed

    # ---- debug checks ----
    def check(self, requests: list[Request]) -> None:
        """Locks equal the requests holding them, no slot has two owners, and every slot is
        free, in the tree or held by a request (called after each step in debug mode)."""
        expected: dict[int, int] = {}
        for req in requests:
            node = req.cache_node
            while node is not None and node is not self.tree.root:
                expected[id(node)] = expected.get(id(node), 0) + 1
                node = node.parent
        self.tree.check(expected)
        tree_slots = self.tree.all_slots()
        owned: set[int] = set()
        for req in requests:
            own = req.kv_slots[req.cached_len:] + req.duplicate_slots
            assert not tree_slots.intersection(own), f"request {req.rid} owns a slot the tree owns"
            assert not owned.intersection(own), f"request {req.rid} shares a slot with another"
            owned.update(own)
            cached = set(req.kv_slots[:req.cached_len]).difference(req.duplicate_slots)
            assert cached <= tree_slots, f"request {req.rid} reads a slot that was evicted"
        total = self.kv_slots.num_free + len(tree_slots) + len(owned)
        assert total == self.kv_slots.count, \
            f"KV slots leaked: {self.kv_slots.num_free} free + {len(tree_slots)} cached + " \
            f"{len(owned)} held != {self.kv_slots.count}"
        if self.host is not None:
            pool, held = self.host.host_slots, len(self.tree.all_host_slots())
            assert pool.num_free + held == pool.count, \
                f"host slots leaked: {pool.num_free} free + {held} cached != {pool.count}"
