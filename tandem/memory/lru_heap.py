"""Radix-tree nodes by last access, for least-recently-used eviction without walking the tree
(one heap for GPU eviction, one for the host tier's).

A full walk per eviction (heapify every eligible node) cost ~4 ms a call on the CPU's multi-turn
run with a host tier, and the host tier's windows evict and write ahead every step. Here every
eligible node has an entry keyed by its current `last_access`: the tree `touch`es a node when it
may have become eligible or was used. Entries go stale (the node was used since, is no longer
eligible, or left the tree) and are skipped when they surface; a rebuild from a walk drops them
once they outnumber the live ones. A node missing its entry would never be evicted: the tree's
debug check asserts that none is (`missing`), and eviction rebuilds before giving up.
"""
from __future__ import annotations

import heapq
import itertools
from typing import Callable, Iterable, Iterator

REBUILD_MIN = 4096  # entries below which stale ones are left to surface


class LruHeap:
    def __init__(self, nodes: Callable[[], Iterable], eligible: Callable[[object], bool]):
        self.nodes, self.eligible = nodes, eligible
        self._heap: list[tuple[int, int, object]] = []
        self._seq = itertools.count()  # ties: equal last_access, first pushed first
        self._rebuild_above = REBUILD_MIN

    def touch(self, node) -> None:
        """`node` may have become eligible, or was used (its last_access changed)."""
        if self.eligible(node):
            heapq.heappush(self._heap, (node.last_access, next(self._seq), node))

    def push(self, node) -> None:
        """`touch` of a node the caller knows to be eligible: the entry without the check."""
        heapq.heappush(self._heap, (node.last_access, next(self._seq), node))

    def rebuild(self) -> None:
        self._heap = [(n.last_access, next(self._seq), n) for n in self.nodes() if self.eligible(n)]
        heapq.heapify(self._heap)
        self._rebuild_above = max(REBUILD_MIN, 4 * len(self._heap))

    def take(self) -> Iterator:
        """Eligible nodes, least recently used first, popped for good (ask for one only when it
        will be evicted): the caller evicts each one it is given and touches its parent."""
        if len(self._heap) > self._rebuild_above:
            self.rebuild()
        return self._walk(self._heap, self.eligible)

    def preview(self, eligible: Callable[[object], bool]) -> Iterator:
        """The same order over a copy of the entries, with the caller's `eligible` (which may
        pretend the nodes given so far are gone): the heap itself does not change."""
        return self._walk(list(self._heap), eligible)

    def missing(self) -> list:
        """Eligible nodes without a live entry (the debug check's: should be none)."""
        live = {id(n) for key, _, n in self._heap if key == n.last_access}
        return [n for n in self.nodes() if self.eligible(n) and id(n) not in live]

    def _walk(self, heap: list, eligible: Callable[[object], bool]) -> Iterator:
        while heap:
            key, _, node = heapq.heappop(heap)
            if key != node.last_access or not eligible(node):
                continue  # stale: used since (a newer entry exists), or no longer eligible
            parent = node.parent
            yield node
            if parent is not None and eligible(parent):
                heapq.heappush(heap, (parent.last_access, next(self._seq), parent))


def attached(node) -> bool:
    """Still in the tree: a dropped subtree's nodes keep their fields, so their heap entries
    would look live without this."""
    parent = node.parent
    return parent is not None and parent.children.get(node.key[0]) is node
