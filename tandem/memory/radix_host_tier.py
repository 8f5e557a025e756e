"""The radix tree's host-tier moves: which copies live where, and which go when room is short.

`RadixCache` inherits these; they change only its own books (`slots`, `host_slots`, the token
counters) and queue copies through `HostTierHooks`. Node states: GPU only, host only, or both
(written ahead, or loaded back). A GPU node's parent is on the GPU, so every move keeps that:
the GPU side shrinks from the leaves (`_gpu_evictable`) and a host node only ever gains a GPU
copy from its caller's own slots or a load along a match.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Callable

from tandem.memory.allocator import SlotAllocator


@dataclass
class HostTierHooks:
    """What the tree needs of a host tier: its slot allocator and a way to queue a copy of GPU
    slots to host slots (the copy's ordering rules live with the copier)."""

    host_slots: SlotAllocator
    write_back: Callable[[list[int], list[int]], None]


class HostTierOps:
    """Mixed into RadixCache (its `host`, counters, `_nodes`, `free_slots`); `node` arguments are
    radix_cache.Node (not imported here: that module imports this one)."""

    @staticmethod
    def _gpu_evictable(node) -> bool:
        return node.lock_ref == 0 and bool(node.slots) and not any(c.slots for c in node.children.values())

    def _promote(self, node, slots: list[int]) -> None:
        """A host-resident node takes GPU slots that hold its KV (handed over by an inserting
        request); its host slots go back. Below a host node every node is on the host, so
        the GPU part stays closed under parents."""
        self.host.host_slots.free(node.host_slots)
        self.host_tokens -= len(node.key)
        node.slots, node.host_slots = slots, None
        if node.lock_ref:
            self.locked_tokens += len(node.key)
        else:
            self.evictable_tokens += len(node.key)

    def _copy_to_host(self, node, colder_than: int | None = None) -> bool:
        """Queue a copy of a GPU node's KV to fresh host slots (it is then in both tiers).
        False when the host tier has no room for it (dropping only host copies last used
        before `colder_than`, if given)."""
        host_slots = self._host_room(len(node.key), colder_than)
        if host_slots is None:
            return False
        self.host.write_back(node.slots, host_slots)
        node.host_slots = host_slots
        self.host_tokens += len(node.key)
        return True

    def _drop_subtree(self, node) -> None:
        """Unlink `node`; its descendants are host-only (and unreferenced). Every host copy
        among them goes back. The caller accounts for `node`'s own GPU slots."""
        del node.parent.children[node.key[0]]
        stack = [node]
        while stack:
            below = stack.pop()
            stack.extend(below.children.values())
            if below.host_slots is not None:
                self.host.host_slots.free(below.host_slots)
                self.host_tokens -= len(below.key)

    def write_ahead(self, num_tokens: int) -> int:
        """Make about `num_tokens` GPU tokens evictable without a copy: copy the nodes eviction
        would take first (unreferenced, no GPU child, least recently used) to the host tier,
        keeping their GPU copies, until that many have host copies. Takes host room only from
        colder host-only nodes. Returns the tokens queued for copying."""
        unreferenced = [n for n in self._nodes() if self._gpu_evictable(n)]
        ready = sum(len(n.key) for n in unreferenced if n.host_slots is not None)
        queued = 0
        for node in sorted((n for n in unreferenced if n.host_slots is None), key=lambda n: n.last_access):
            if ready + queued >= num_tokens or not self._copy_to_host(node, colder_than=node.last_access):
                break
            queued += len(node.key)
        return queued

    def _host_room(self, n: int, colder_than: int | None = None) -> list[int] | None:
        """n host slots, dropping the coldest host copies for them; None if the host tier
        cannot hold n (too small, or what it holds is in use or not colder than asked)."""
        pool = self.host.host_slots
        if n > pool.count:
            return None
        if n > pool.num_free:
            self.evict_host(n - pool.num_free, colder_than)
        return pool.alloc(n) if n <= pool.num_free else None

    def evict_host(self, num_tokens: int, colder_than: int | None = None) -> int:
        """Drop at least `num_tokens` host copies, least recently used first: a host-only leaf
        leaves the tree, a node in both tiers keeps its GPU copy. With `colder_than` (writing
        ahead), only host-only nodes used before then. Returns how many host slots were freed."""
        heap = [n for n in self._nodes() if self._host_droppable(n)]
        heapq.heapify(heap)
        freed = 0
        while freed < num_tokens and heap:
            node = heapq.heappop(heap)
            if not self._host_droppable(node):
                continue  # pushed twice
            if colder_than is not None and (node.slots or node.last_access >= colder_than):
                if node.last_access >= colder_than:
                    break
                continue
            parent = node.parent
            if not node.slots:
                del parent.children[node.key[0]]
            self.host.host_slots.free(node.host_slots)  # later copies into them: same copy stream
            node.host_slots = None
            self.host_tokens -= len(node.key)
            freed += len(node.key)
            if parent is not self.root and self._host_droppable(parent):
                heapq.heappush(heap, parent)
        return freed

    @staticmethod
    def _host_droppable(node) -> bool:
        if node.host_slots is None:
            return False
        return bool(node.slots) or (node.lock_ref == 0 and not node.children)
