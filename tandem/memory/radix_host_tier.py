"""The radix tree's host-tier moves: which copies live where, and which go when room is short.

`RadixCache` holds a `HostTierMoves` when it has a host tier and calls it; it owns the host
side's books (the host slots through `HostTierHooks`, and the count of host-resident tokens)
and queues copies through the hooks, while the tree keeps its own (`slots`, the GPU token
counters, the links between nodes). Node states: GPU only, host only, or both (written ahead,
or loaded back). A GPU node's parent is on the GPU, so every move keeps that: the GPU side
shrinks from the leaves (the tree picks them: `RadixCache._gpu_evictable`) and a host node
only ever gains a GPU copy from its caller's own slots or a load along a match.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator

from tandem.memory.allocator import SlotAllocator
from tandem.memory.lru_heap import LruHeap, attached


@dataclass
class HostTierHooks:
    """What the tree needs of a host tier: its slot allocator and a way to queue a copy of GPU
    slots to host slots, which returns the copy's number (the copy's ordering rules live with
    the copier)."""

    host_slots: SlotAllocator
    write_back: Callable[[list[int], list[int]], int]


class HostTierMoves:
    """The host side of one RadixCache. `nodes` walks the tree's nodes (the root left out); the
    moves change a node's `host_slots` and this side's `tokens`, never its GPU books. Nodes are
    radix_cache.Node, left unannotated: that module imports this one, and naming it here (even
    for type checking only) would tie the two in a circle."""

    def __init__(self, hooks: HostTierHooks, nodes: Callable[[], Iterable]):
        self.hooks = hooks
        self.nodes = nodes
        self.tokens = 0  # tokens of host-resident nodes
        self.lru = LruHeap(nodes, self._droppable)  # the host tier's eviction order

    def forget(self, node) -> None:
        """Give `node`'s host slots back and stop counting them. The caller clears
        `node.host_slots` or has unlinked the node (then the stale list is never read as live)."""
        self.hooks.host_slots.free(node.host_slots)
        self.tokens -= len(node.key)

    def copy_to_host(self, node, colder_than: int | None = None) -> bool:
        """Queue a copy of a GPU node's KV to fresh host slots (it is then in both tiers).
        False when the host tier has no room for it (dropping only host copies last used
        before `colder_than`, if given)."""
        host_slots = self._room(len(node.key), colder_than)
        if host_slots is None:
            return False
        node.copy_seq = self.hooks.write_back(node.slots, host_slots)  # its slots' reuse waits for it
        node.host_slots = tuple(host_slots)  # untracked once seen: `Node`
        self.tokens += len(node.key)
        self.lru.touch(node)
        return True

    def write_ahead(self, eviction_order: Iterator, num_tokens: int, most: int | None = None) -> tuple[int, bool]:
        """Make about `num_tokens` GPU tokens evictable without a copy: walking the nodes GPU
        eviction would take, in its order (`eviction_order`: a parent after its last GPU child,
        as if that were gone; a multi-turn history is a chain whose leaf alone is evictable at
        first), copy those without a host copy to the host tier, keeping their GPU copies, until
        that many have host copies or about `most` were queued (whole nodes: the first one
        whatever its size). Takes host room only from colder host-only nodes. Returns the tokens
        queued and whether `num_tokens` are now covered."""
        ready = queued = 0
        for node in eviction_order:
            if ready + queued >= num_tokens or (most is not None and queued >= most):
                break
            if node.host_slots is not None:
                ready += len(node.key)
                continue
            if not self.copy_to_host(node, colder_than=node.last_access):
                break
            queued += len(node.key)
        return queued, ready + queued >= num_tokens

    def _room(self, n: int, colder_than: int | None = None) -> list[int] | None:
        """n host slots, dropping the coldest host copies for them; None if the host tier
        cannot hold n (too small, or what it holds is in use or not colder than asked)."""
        pool = self.hooks.host_slots
        if n > pool.count:
            return None
        if n > pool.num_free:
            self.evict(n - pool.num_free, colder_than)
        return pool.alloc(n) if n <= pool.num_free else None

    def evict(self, num_tokens: int, colder_than: int | None = None) -> int:
        """Drop at least `num_tokens` host copies, least recently used first: a host-only leaf
        leaves the tree, a node in both tiers keeps its GPU copy. With `colder_than` (writing
        ahead), only host-only nodes used before then. Returns how many host slots were freed."""
        freed = self._evict_in_order(num_tokens, colder_than)
        if freed < num_tokens and colder_than is None and self.tokens > 0:
            self.lru.rebuild()  # never expected (the tree's debug check asserts no entry is missing)
            freed += self._evict_in_order(num_tokens - freed, None)
        return freed

    def _evict_in_order(self, num_tokens: int, colder_than: int | None) -> int:
        freed, order, kept = 0, self.lru.take(), []
        while freed < num_tokens:
            node = next(order, None)  # only when one is needed: a node taken leaves the heap
            if node is None:
                break
            if colder_than is not None and (node.slots or node.last_access >= colder_than):
                kept.append(node)
                if node.last_access >= colder_than:
                    break
                continue
            parent = node.parent
            if not node.slots:
                node.changed()  # leaves the tree (a node in both tiers keeps its GPU copy: no change)
                del parent.children[node.key[0]]
            self.forget(node)  # later copies into its slots: same copy stream
            node.host_slots = None
            freed += len(node.key)
            self.lru.touch(parent)  # a host-only parent may be a droppable leaf now
        for node in kept:  # taken from the heap but not dropped: back in
            self.lru.touch(node)
        return freed

    @staticmethod
    def _droppable(node) -> bool:
        if node.host_slots is None or not attached(node):
            return False
        return bool(node.slots) or (node.lock_ref == 0 and not node.children)
