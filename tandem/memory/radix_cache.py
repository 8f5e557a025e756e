"""A radix tree from token sequences to KV-pool slots, at token granularity (page size 1).

Each edge holds a run of token ids (`key`) and the KV slots of those tokens (`slots`); a path
from the root spells a cached prefix. Nodes are reference-counted by the requests that use
them (`lock`/`unlock`, counted on the whole path to the root), and only unreferenced leaves are
evicted, least recently used first. Host-only bookkeeping: it never touches device memory.

The tree owns the slots of its nodes: whoever inserts hands them over, eviction frees them.
"""
from __future__ import annotations

import heapq
import itertools
from typing import Callable

_clock = itertools.count()  # access order for LRU; a counter, so ties cannot happen


class Node:
    __slots__ = ("key", "slots", "children", "parent", "lock_ref", "last_access")

    def __init__(self, key: list[int], slots: list[int], parent: "Node | None"):
        self.key, self.slots, self.parent = key, slots, parent
        self.children: dict[int, Node] = {}  # by first token of the child's key
        self.lock_ref = 0
        self.last_access = next(_clock)

    def __lt__(self, other: "Node") -> bool:  # heap order: least recently used first
        return self.last_access < other.last_access


class RadixCache:
    def __init__(self, free_slots: Callable[[list[int]], None]):
        self.free_slots = free_slots  # gives evicted slots back to the KV allocator
        self.root = Node([], [], None)
        self.root.lock_ref = 1  # never evicted
        self.evictable_tokens = 0  # tokens in nodes no request references
        self.locked_tokens = 0  # tokens in nodes some request references

    @property
    def total_tokens(self) -> int:
        return self.evictable_tokens + self.locked_tokens

    # ---- lookup ----
    def match(self, tokens: list[int]) -> tuple[list[int], Node]:
        """The slots of the longest cached prefix of `tokens` and the node where it ends (a
        node boundary: a match ending inside an edge splits it). Marks the path as used."""
        node, slots, i = self.root, [], 0
        now = next(_clock)
        while i < len(tokens):
            child = node.children.get(tokens[i])
            if child is None:
                break
            n = common_length(child.key, tokens, i)
            if n < len(child.key):
                child = self._split(child, n)
            child.last_access = now
            slots += child.slots
            node, i = child, i + n
        return slots, node

    def match_length(self, tokens: list[int]) -> int:
        """Length of the longest cached prefix; changes nothing (for ordering the queue)."""
        node, i = self.root, 0
        while i < len(tokens):
            child = node.children.get(tokens[i])
            if child is None:
                break
            n = common_length(child.key, tokens, i)
            i += n
            if n < len(child.key):
                break
            node = child
        return i

    # ---- insertion ----
    def insert(self, tokens: list[int], slots: list[int]) -> tuple[int, Node]:
        """Cache `tokens` with their KV `slots`. Returns (present, node): the first `present`
        tokens were already cached (their slots in `slots` stay the caller's: duplicates), the
        rest now belong to the tree; `node` is where `tokens` ends."""
        assert len(tokens) == len(slots)
        node, i = self.root, 0
        now = next(_clock)
        while i < len(tokens):
            child = node.children.get(tokens[i])
            if child is None:
                new = Node(list(tokens[i:]), list(slots[i:]), node)
                node.children[tokens[i]] = new
                self.evictable_tokens += len(new.key)
                return i, new
            n = common_length(child.key, tokens, i)
            if n < len(child.key):
                child = self._split(child, n)
            child.last_access = now
            node, i = child, i + n
        return i, node

    def _split(self, child: Node, n: int) -> Node:
        """Cut `child`'s edge after n tokens; returns the new upper node (same locks)."""
        upper = Node(child.key[:n], child.slots[:n], child.parent)
        upper.lock_ref, upper.last_access = child.lock_ref, child.last_access
        child.parent.children[upper.key[0]] = upper
        child.key, child.slots, child.parent = child.key[n:], child.slots[n:], upper
        upper.children[child.key[0]] = child
        return upper

    # ---- references ----
    def lock(self, node: Node) -> None:
        """A request uses the path root..node: none of it may be evicted."""
        while node is not self.root:
            if node.lock_ref == 0:
                self.evictable_tokens -= len(node.key)
                self.locked_tokens += len(node.key)
            node.lock_ref += 1
            node = node.parent

    def unlock(self, node: Node) -> None:
        while node is not self.root:
            node.lock_ref -= 1
            assert node.lock_ref >= 0, "prefix cache: unlock without lock"
            if node.lock_ref == 0:
                self.evictable_tokens += len(node.key)
                self.locked_tokens -= len(node.key)
            node = node.parent

    # ---- eviction ----
    def evict(self, num_tokens: int) -> int:
        """Free at least `num_tokens` slots from unreferenced leaves, least recently used
        first (fewer if not that many are evictable). Returns how many were freed."""
        heap = [n for n in self._nodes() if not n.children and n.lock_ref == 0]
        heapq.heapify(heap)
        freed = 0
        while freed < num_tokens and heap:
            leaf = heapq.heappop(heap)
            self.free_slots(leaf.slots)
            freed += len(leaf.slots)
            self.evictable_tokens -= len(leaf.key)
            parent = leaf.parent
            del parent.children[leaf.key[0]]
            if parent is not self.root and not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, parent)
        return freed

    def _nodes(self):
        stack = [self.root]
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            if node is not self.root:
                yield node

    # ---- checks (debug mode and tests) ----
    def all_slots(self) -> set[int]:
        return {s for n in self._nodes() for s in n.slots}

    def check(self, expected_locks: dict[int, int]) -> None:
        """Reference counts equal the locks the callers hold (`id(node) -> count` of paths
        through it) and the token counters add up."""
        evictable = locked = 0
        for node in self._nodes():
            want = expected_locks.get(id(node), 0)
            assert node.lock_ref == want, f"prefix cache: node lock_ref {node.lock_ref}, expected {want}"
            assert len(node.key) == len(node.slots) > 0
            if node.lock_ref:
                locked += len(node.key)
            else:
                evictable += len(node.key)
        assert (evictable, locked) == (self.evictable_tokens, self.locked_tokens), \
            "prefix cache: token counters out of step with the tree"


def common_length(key: list[int], tokens: list[int], start: int) -> int:
    """How many leading tokens of `key` equal tokens[start:]; list compares run in C."""
    n = min(len(key), len(tokens) - start)
    if key[:n] == tokens[start:start + n]:
        return n
    lo, hi = 0, n  # binary search for the first mismatch: O(log n) slice compares
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if key[:mid] == tokens[start:start + mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo
