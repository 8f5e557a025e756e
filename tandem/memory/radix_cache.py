"""A radix tree from token sequences to KV-pool slots, at token granularity (page size 1).

Each edge holds a run of token ids (`key`) and the KV slots of those tokens (`slots`); a path
from the root spells a cached prefix. Nodes are reference-counted by the requests that use
them (`lock`/`unlock`, counted on the whole path to the root), and only unreferenced leaves are
evicted, least recently used first. Host-only bookkeeping: it never touches device memory.

The tree owns the slots of its nodes: whoever inserts hands them over, eviction frees them.

With a host tier (`HostTierHooks`), a node lives on the GPU (`slots`), on the host
(`host_slots`, its `slots` empty), or in both (written ahead of pressure, or loaded back).
GPU eviction moves an unreferenced node with no GPU child to the host (a copy unless it is
there already) instead of dropping it; the host tier's own eviction drops the coldest host
copies (a host-only leaf goes, a node in both tiers keeps its GPU copy). A GPU node's parent
is always on the GPU (the root counts), so a match is a GPU part followed by a host part, which
the caller loads back (`host_continuation`, `mark_loaded`). LRU order is shared by both tiers
(one clock). The host side's moves and books live in a `HostTierMoves` (radix_host_tier) the
tree holds and calls; the tree keeps the GPU side and the links between nodes.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Callable, Iterator

from tandem.memory.lru_heap import LruHeap, attached
from tandem.memory.radix_host_tier import HostTierHooks, HostTierMoves

_clock = itertools.count()  # access order for LRU; a counter, so ties cannot happen


class Node:
    __slots__ = ("key", "slots", "host_slots", "children", "parent", "lock_ref", "last_access", "loaded",
                 "copy_seq", "epoch")

    # key, slots and host_slots are tuples: the collector stops tracking a tuple of ints once a
    # pass has seen it, and these are most of what a full pass would walk otherwise (the tree's
    # lists were 857k of 930k entries of the old generation on the host-tier replay: 15-33 ms a
    # full pass on an H100 host, session 49). Never edited in place; a split slices them.
    def __init__(self, key: tuple[int, ...], slots: tuple[int, ...], parent: "Node | None"):
        self.key, self.slots, self.parent = key, slots, parent
        self.host_slots: tuple[int, ...] | None = None  # set while the node lives on the host
        self.children: dict[int, Node] = {}  # by first token of the child's key
        self.lock_ref = 0
        self.last_access = next(_clock)
        self.loaded = False  # loaded back from the host and not yet read by an admission (a host hit then)
        # The last host-tier copy that reads or writes its GPU slots (its number on the copy
        # stream; 0: none): a reader of a load, or a writer of the slots once evicted, waits for it.
        self.copy_seq = 0
        # Of a child of the root: changes in its subtree so far (`changed`); a kept walk through
        # it holds without a check while this stays (`RadixCache._path_stands`).
        self.epoch = 0

    def changed(self) -> None:
        """Its key, its tier (GPU slots) or its children are about to change, or it is about to
        leave the tree: kept walks through it, and any under the same child of the root, are
        checked again. The caller calls it before relinking (a split moves a node down)."""
        node = self
        while node.parent is not None and node.parent.parent is not None:  # up to the root's child
            node = node.parent
        node.epoch += 1


@dataclass
class MatchWalk:
    """A `match_lengths` answer and the path that gave it (`RadixCache.match_lengths_again`):
    it still holds while every node on the path is where it was, as long and in the same tier,
    and no child continues the match where it stopped. Only `epoch` changes once made."""

    end: int  # the prefix length asked about
    gpu: int  # matched on the GPU
    cached: int  # matched in either tier
    path: tuple  # (node, len(node.key), on the GPU) from the root down
    stop_token: int | None  # the token no child matched (None: the walk ended inside a node or at `end`)
    # The first path node's `epoch` when the path was last seen to stand (-1: no path). Every
    # change a walk depends on is in that node's subtree (its path, or a new child where it stopped).
    epoch: int = -1


class RadixCache:
    def __init__(self, free_slots: Callable[[list[int], int], None], host: HostTierHooks | None = None):
        self.free_slots = free_slots  # gives evicted slots back to the KV allocator (slots, after_copy)
        self.root = Node((), (), None)
        self.root.lock_ref = 1  # never evicted
        self.evictable_tokens = 0  # GPU tokens in nodes no request references
        self.locked_tokens = 0  # GPU tokens in nodes some request references
        self.host_tier = HostTierMoves(host, self._nodes) if host is not None else None
        self.lru = LruHeap(self._nodes, self._gpu_evictable)  # GPU eviction's order
        self._evictions = 0  # GPU nodes evicted so far
        # Splits so far: a split puts a new node above an existing one (`_split`), the only change
        # to a node's ancestors; a path read from a request's `cache_node` holds while this stays.
        self.splits = 0
        # (evictions then, tokens): the last write-ahead left that many of eviction's first tokens
        # with host copies. Until a node is evicted they stay first: what is used since is no
        # longer the coldest, and new nodes are the warmest.
        self._covered = (-1, 0)

    @property
    def total_tokens(self) -> int:
        return self.evictable_tokens + self.locked_tokens

    @property
    def host_tokens(self) -> int:
        """Tokens of host-resident nodes (0 without a host tier)."""
        return self.host_tier.tokens if self.host_tier is not None else 0

    # ---- lookup ----
    def match(self, tokens: list[int], walk: "MatchWalk | None" = None,
              end: int | None = None) -> tuple[list[int], Node]:
        """The slots of the longest cached prefix of tokens[:end] and the node where it ends (a
        node boundary: a match ending inside an edge splits it). Marks the path as used.
        `end`: no copy of a long prompt to cut it. `walk`: a kept `match_lengths_again` answer
        for these tokens; followed without token compares while its path stands."""
        end = len(tokens) if end is None else min(end, len(tokens))
        if self._holds(walk, end):
            return self._follow(walk)
        known = _matched_spans(walk) if walk is not None and walk.end == end else {}
        node, i, taken = self.root, 0, []
        while i < end:
            child = node.children.get(tokens[i])
            if child is None or not child.slots:  # the rest lives on the host: host_continuation
                break
            n = _known_length(known, child, i) if known else None
            n = common_length(child.key, tokens, i, end) if n is None else n
            taken.append((child, n))
            if n < len(child.key):  # the match ends inside it: nothing below continues it
                break
            node, i = child, i + n
        return self._use_path(taken)

    def _follow(self, walk: "MatchWalk") -> tuple[list[int], Node]:
        """`match` along a walk whose path stands: the same splits, touches and slots."""
        taken, i = [], 0
        for child, key_len, on_gpu in walk.path:
            if not on_gpu:
                break
            n = min(key_len, walk.cached - i)
            taken.append((child, n))
            i += n
        return self._use_path(taken)

    def _use_path(self, taken: list[tuple[Node, int]]) -> tuple[list[int], Node]:
        """Use a match's GPU path, given as (node, tokens matched in it) from the root down: split
        the last node where the match ends inside it, mark every node as used at one time, and
        join their slots. Returns the slots and the last node (the root if none).
        The LRU heaps hear only of nodes that can be eligible: each node but the last has the
        next as a GPU child, so only the last can be GPU-evictable (`_gpu_evictable`); each is
        attached and on the GPU, so it is droppable iff it has a host copy (`_droppable`). The
        ~8 calls a node of touching each in both heaps were two thirds of a long-match
        admission's match under cProfile (CPU replay of issue 23)."""
        node, slots = self.root, []
        now = next(_clock)  # before a split's new node reads the clock: the same values as node by node
        host_lru = self.host_tier.lru if self.host_tier is not None else None
        for child, n in taken:
            if n < len(child.key):
                child = self._split(child, n)
            child.last_access = now
            if host_lru is not None and child.host_slots is not None:
                host_lru.push(child)
            slots += child.slots
            node = child
        if node is not self.root:
            self.lru.touch(node)
        return slots, node

    def _use(self, child: Node, n: int, now: int) -> Node:
        """The node of a match's first n tokens of `child` (split there if n is short of its
        key), marked as used at `now`."""
        if n < len(child.key):
            child = self._split(child, n)
        child.last_access = now
        self._touch(child)
        return child

    def match_length(self, tokens: list[int]) -> int:
        """Length of the longest cached prefix; changes nothing (for ordering the queue)."""
        return self.match_lengths(tokens)[1]

    def match_lengths(self, tokens: list[int], end: int | None = None) -> tuple[int, int]:
        """(on the GPU, in either tier): lengths of the longest cached prefix of tokens[:end]
        (`end`: no copy of a long prompt to cut it); changes nothing."""
        walk = self._walk(tokens, len(tokens) if end is None else min(end, len(tokens)))
        return walk.gpu, walk.cached

    def match_lengths_again(self, tokens: list[int], end: int, last: MatchWalk | None) -> MatchWalk:
        """`match_lengths` of tokens[:end] for a caller that asks about the same tokens again
        and again (a waiting prompt, every plan): `last` is the previous answer, returned as it
        is when its path still stands (O(1) while nothing under its first node changed, else
        O(nodes on the path); no token compares), else walked anew, comparing only the tokens
        of nodes that are new or shorter since (`_matched_spans`). Exact: a match changes only through its path's nodes (split, dropped, moved
        between tiers) or a new child where it stopped, and each of those is checked. A node's
        key never changes but by a split, which shortens it."""
        end = min(end, len(tokens))
        if last is None or last.end != end:
            return self._walk(tokens, end)
        return last if self._path_stands(last) else self._walk(tokens, end, _matched_spans(last))

    def _holds(self, walk: MatchWalk | None, end: int) -> bool:
        """A kept walk answers for tokens[:end] still: asked about as many tokens (a request's
        tokens only grow, so the same `end` is the same tokens), and its path stands."""
        return walk is not None and walk.end == end and self._path_stands(walk)

    def _path_stands(self, walk: MatchWalk) -> bool:
        """O(1) while nothing under the walk's first node changed (`Node.changed`): the waiting
        prompts' checks, every plan, read one node each, not their paths (the CPU replay of
        issue 23: ~27 paths of ~11 cold nodes a prefill plan, a fifth of its time)."""
        path = walk.path
        if path and path[0][0].epoch == walk.epoch:
            return True
        if not self._path_checked(walk):
            return False
        if path:
            walk.epoch = path[0][0].epoch  # it stands now: until the next change under its first node
        return True

    def _path_checked(self, walk: MatchWalk) -> bool:
        """Every node of the path where it was, as long and in the same tier, and no child
        continuing the match where it stopped."""
        parent = self.root
        for node, key_len, on_gpu in walk.path:
            if (node.parent is not parent or len(node.key) != key_len or bool(node.slots) != on_gpu
                    or parent.children.get(node.key[0]) is not node):
                return False
            parent = node
        return walk.stop_token is None or walk.stop_token not in parent.children

    def _walk(self, tokens: list[int], end: int, known: dict | None = None) -> MatchWalk:
        """`known`: `_matched_spans` of an earlier walk of the same tokens[:end]; a node met
        again where it was met then, as long as then, matches as many tokens as then, without
        comparing them (the re-walk of a waiting prompt whose path changed: ~9k-token compares
        a walk on the CPU replay of issue 23, where only a node's tier had changed)."""
        node, i, gpu, path, stop = self.root, 0, 0, [], None
        while i < end:
            child = node.children.get(tokens[i])
            if child is None:
                stop = tokens[i]
                break
            n = _known_length(known, child, i) if known else None
            n = common_length(child.key, tokens, i, end) if n is None else n
            i += n
            gpu = i if child.slots and gpu == i - n else gpu  # a GPU node's parent is on the GPU
            path.append((child, len(child.key), bool(child.slots)))
            if n < len(child.key):
                break
            node = child
        return MatchWalk(end, gpu, i, tuple(path), stop, path[0][0].epoch if path else -1)

    # ---- insertion ----
    def insert(self, tokens: list[int], slots: list[int]) -> tuple[int, Node]:
        """Cache `tokens` with their KV `slots`. Returns (present, node): the first `present`
        tokens were already cached (their slots in `slots` stay the caller's: duplicates), the
        rest now belong to the tree; `node` is where `tokens` ends."""
        assert len(tokens) == len(slots)
        node, i, present = self.root, 0, None
        now = next(_clock)
        while i < len(tokens):
            child = node.children.get(tokens[i])
            if child is None:
                new = Node(tuple(tokens[i:]), tuple(slots[i:]), node)
                node.changed()  # a new child: a walk that stopped at `node` goes further now
                node.children[tokens[i]] = new
                self.evictable_tokens += len(new.key)
                self._touch(new)
                return (i if present is None else present), new
            n = common_length(child.key, tokens, i)
            if n < len(child.key):
                child = self._split(child, n)
            child.last_access = now
            if not child.slots:  # on the host: the caller's fresh copy makes it GPU-resident again
                present = i if present is None else present
                self._promote(child, tuple(slots[i:i + n]))
            self._touch(child)
            node, i = child, i + n
        return (i if present is None else present), node

    def split(self, node: Node, n: int) -> Node:
        """Cut a host-resident node after its first n tokens (0 < n < its length); returns the
        head, which a load can take alone."""
        assert not node.slots and 0 < n < len(node.key)
        return self._split(node, n)

    def _split(self, child: Node, n: int) -> Node:
        """Cut `child`'s edge after n tokens; returns the new upper node (same locks)."""
        self.splits += 1
        child.changed()
        upper = Node(child.key[:n], child.slots[:n], child.parent)
        upper.lock_ref, upper.last_access, upper.loaded = child.lock_ref, child.last_access, child.loaded
        upper.copy_seq = child.copy_seq
        if child.host_slots is not None:
            upper.host_slots, child.host_slots = child.host_slots[:n], child.host_slots[n:]
        child.parent.children[upper.key[0]] = upper
        child.key, child.slots, child.parent = child.key[n:], child.slots[n:], upper
        upper.children[child.key[0]] = child
        self._touch(upper)
        return upper

    def _promote(self, node: Node, slots: tuple[int, ...]) -> None:
        """A host-resident node takes GPU slots that hold its KV (handed over by an inserting
        request); its host slots go back. Below a host node every node is on the host, so
        the GPU part stays closed under parents."""
        self.host_tier.forget(node)
        node.changed()
        node.slots, node.host_slots, node.loaded = slots, None, False  # the caller's own KV: no host hit
        node.copy_seq = 0
        if node.lock_ref:
            self.locked_tokens += len(node.key)
        else:
            self.evictable_tokens += len(node.key)

    # ---- references ----
    def lock(self, node: Node) -> None:
        """A request uses the path root..node: none of it may be evicted."""
        while node is not self.root:
            if node.lock_ref == 0 and node.slots:  # the counters count GPU tokens
                self.evictable_tokens -= len(node.key)
                self.locked_tokens += len(node.key)
            node.lock_ref += 1
            node = node.parent

    def unlock(self, node: Node) -> None:
        while node is not self.root:
            node.lock_ref -= 1
            assert node.lock_ref >= 0, "prefix cache: unlock without lock"
            if node.lock_ref == 0 and node.slots:
                self.evictable_tokens += len(node.key)
                self.locked_tokens -= len(node.key)
            if node.lock_ref == 0:
                self._touch(node)  # evictable (GPU) or droppable (host) again
            node = node.parent

    # ---- eviction ----
    def _touch(self, node: Node) -> None:
        """`node` was used, or may have become evictable (GPU) or droppable (host): both tiers'
        LRU heaps hear of it."""
        self.lru.touch(node)
        if self.host_tier is not None:
            self.host_tier.lru.touch(node)

    @staticmethod
    def _gpu_evictable(node: Node) -> bool:
        if node.lock_ref or not node.slots or not attached(node):
            return False
        for child in node.children.values():  # a loop, not any(genexpr): asked for each node a match uses
            if child.slots:
                return False
        return True

    def evict(self, num_tokens: int, to_host: bool = True) -> int:
        """Free at least `num_tokens` GPU slots from unreferenced nodes without GPU children,
        least recently used first (fewer if not that many are evictable). With a host tier
        (and `to_host`) each one's KV is written back to host slots first; without room
        there, it is dropped with its host-resident subtree. Returns the GPU slots freed."""
        freed = self._evict_in_order(num_tokens, to_host)
        if freed < num_tokens and self.evictable_tokens > 0:
            self.lru.rebuild()  # never expected (the debug check asserts no entry is missing)
            freed += self._evict_in_order(num_tokens - freed, to_host)
        return freed

    def evict_copied(self, num_tokens: int) -> int:
        """`evict` of the coldest nodes that have host copies already (written ahead), stopping
        at the first that has none (LRU order kept): frees up to `num_tokens` GPU slots and
        queues no copy. Returns the GPU slots freed (0 without a host tier)."""
        if self.host_tier is None:
            return 0
        return self._evict_in_order(num_tokens, to_host=True, copied_only=True)

    def _evict_in_order(self, num_tokens: int, to_host: bool, copied_only: bool = False) -> int:
        freed, order = 0, self.lru.take()
        while freed < num_tokens:
            node = next(order, None)  # only when one is needed: a node taken leaves the heap
            if node is None:
                break
            if copied_only and node.host_slots is None:
                self.lru.touch(node)  # taken but kept: back in the heap
                break
            gpu_slots = node.slots
            self.evictable_tokens -= len(node.key)
            if to_host and self.host_tier is not None and node.host_slots is None:
                self.host_tier.copy_to_host(node)
            node.changed()  # to the host, or out of the tree
            if to_host and node.host_slots is not None:
                node.slots, node.loaded = (), False  # it lives on in the host tier; an unread load goes unhit
            else:
                self._drop_subtree(node)
            self._touch(node)  # host-only now: the host tier may drop it
            self._touch(node.parent)  # its last GPU child may be gone: evictable now
            self._evictions += 1
            self.free_slots(gpu_slots, node.copy_seq)  # reuse waits for its last copy: SlotAllocator
            freed += len(gpu_slots)
        return freed

    def _drop_subtree(self, node: Node) -> None:
        """Unlink `node`; its descendants are host-only (and unreferenced). Every host copy
        among them goes back. The caller accounts for `node`'s own GPU slots (and called
        `node.changed()`)."""
        del node.parent.children[node.key[0]]
        stack = [node]
        while stack:
            below = stack.pop()
            stack.extend(below.children.values())
            if below.host_slots is not None:  # only ever set with a host tier
                self.host_tier.forget(below)
                # The host heap's entries for `below` must read as dead: the subtree keeps its
                # own links, so `attached` holds for every node under `node`.
                below.host_slots = None

    def write_ahead(self, num_tokens: int, most: int | None = None) -> int:
        """Copy the nodes GPU eviction would take first to the host tier until about
        `num_tokens` GPU tokens are evictable without a copy, queueing about `most` at most
        (`HostTierMoves.write_ahead`). Returns the tokens queued (0 without a host tier)."""
        if self.host_tier is None:
            return 0
        if self._covered[0] == self._evictions and num_tokens <= self._covered[1]:
            return 0  # covered by the last call and nothing evicted since: skip the walk
        queued, covered = self.host_tier.write_ahead(self._eviction_order(), num_tokens, most)
        self._covered = (self._evictions, num_tokens) if covered else (-1, 0)
        return queued

    def _eviction_order(self) -> Iterator[Node]:
        """The nodes `evict` would take, in its order, taking none: once the caller asks for the
        next, the one given counts as gone (its parent may follow)."""
        passed: set[int] = set()

        def evictable(node: Node) -> bool:
            return (node.lock_ref == 0 and bool(node.slots) and id(node) not in passed and attached(node)
                    and not any(c.slots and id(c) not in passed for c in node.children.values()))

        for node in self.lru.preview(evictable):
            passed.add(id(node))
            yield node

    def evict_host(self, num_tokens: int, colder_than: int | None = None) -> int:
        """Drop at least `num_tokens` host copies, least recently used first (only host-only
        nodes used before `colder_than`, if given: `HostTierMoves.evict`). Returns the host
        slots freed (0 without a host tier)."""
        if self.host_tier is None:
            return 0
        return self.host_tier.evict(num_tokens, colder_than)

    # ---- load-back ----
    def host_continuation(self, node: Node, tokens: list[int], start: int, end: int | None = None) -> list[Node]:
        """The host-resident nodes that continue a match ending at `node` (which matched
        tokens[:start]) within tokens[:end], the last one split where the match ends. Marks
        them as used."""
        end = len(tokens) if end is None else min(end, len(tokens))
        path, i = [], start
        now = next(_clock)
        while i < end:
            child = node.children.get(tokens[i])
            if child is None:
                break
            assert not child.slots, "a GPU node under the end of a GPU match"
            child = self._use(child, common_length(child.key, tokens, i, end), now)
            n = len(child.key)
            path.append(child)
            node, i = child, i + n
        return path

    def mark_loaded(self, node: Node, gpu_slots: list[int], copy_seq: int) -> None:
        """A host-only node's KV was queued for copying into `gpu_slots` (copy `copy_seq`): it
        lives in both tiers from now on (its first reader waits for the copy on the device:
        `take_loaded`; evicting it again needs no copy)."""
        assert node.host_slots is not None and not node.slots and len(gpu_slots) == len(node.key)
        node.changed()
        node.slots, node.loaded, node.copy_seq = tuple(gpu_slots), True, copy_seq
        self._touch(node)
        if node.lock_ref:
            self.locked_tokens += len(node.key)
        else:
            self.evictable_tokens += len(node.key)

    def take_loaded(self, node: Node) -> list[Node]:
        """The nodes on the path root..node loaded back from the host and read for the first
        time now (host hits): each counts once (`give_back_loaded` undoes a read that did not
        go ahead)."""
        taken = []
        while node is not self.root:
            if node.loaded:
                taken.append(node)
                node.loaded = False
            node = node.parent
        return taken

    @staticmethod
    def give_back_loaded(nodes: list[Node]) -> None:
        """An admission that read these loads did not go ahead: the next reader counts them.
        They are still on the GPU (the admission's lock kept them there)."""
        for node in nodes:
            node.loaded = True

    def _nodes(self) -> Iterator[Node]:
        stack = [self.root]
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            if node is not self.root:
                yield node

    # ---- checks (debug mode and tests) ----
    def all_slots(self) -> set[int]:
        return {s for n in self._nodes() for s in n.slots}

    def all_host_slots(self) -> set[int]:
        return {s for n in self._nodes() if n.host_slots is not None for s in n.host_slots}

    def check(self, expected_locks: dict[int, int]) -> None:
        """Reference counts equal the locks the callers hold (`id(node) -> count` of paths
        through it), each node lives in a tier, a GPU node's parent is on the GPU,
        and the token counters add up."""
        evictable = locked = host = 0
        for node in self._nodes():
            want = expected_locks.get(id(node), 0)
            assert node.lock_ref == want, f"prefix cache: node lock_ref {node.lock_ref}, expected {want}"
            if node.host_slots is not None:
                assert len(node.key) == len(node.host_slots) > 0
                host += len(node.key)
            if not node.slots:
                assert node.host_slots is not None, "prefix cache: a node in neither tier"
                continue
            assert len(node.key) == len(node.slots) > 0
            assert node.parent is self.root or node.parent.slots, "prefix cache: GPU node under a host node"
            if node.lock_ref:
                locked += len(node.key)
            else:
                evictable += len(node.key)
        assert (evictable, locked, host) == (self.evictable_tokens, self.locked_tokens, self.host_tokens), \
            "prefix cache: token counters out of step with the tree"
        assert not self.lru.missing(), "prefix cache: an evictable node is missing from the LRU heap"
        assert self.host_tier is None or not self.host_tier.lru.missing(), \
            "prefix cache: a droppable host copy is missing from the host tier's LRU heap"


def _matched_spans(walk: MatchWalk) -> dict[int, tuple[int, int, int]]:
    """id(node) -> (the token it starts at, its key length, tokens matched in it) along a
    walk's path. A node whose key is as long as then still holds the same tokens (a key
    changes only by a split, which shortens it), and its start cannot move (a split keeps the
    tokens above a node), so the same tokens[:end] match it as far as they did. The walk keeps
    its nodes alive: an id here is never a new node's."""
    spans, start = {}, 0
    for node, key_len, _ in walk.path:
        spans[id(node)] = (start, key_len, key_len)
        start += key_len
    if walk.path:
        node, key_len, _ = walk.path[-1]
        spans[id(node)] = (start - key_len, key_len, walk.cached - (start - key_len))  # the last may end inside
    return spans


def _known_length(known: dict, node: Node, start: int) -> int | None:
    """Tokens `node` matched in the walk `known` came from (`_matched_spans`), if it is met
    again where it was then and is as long as then; None: compare its tokens."""
    seen = known.get(id(node))
    return seen[2] if seen is not None and seen[0] == start and seen[1] == len(node.key) else None


def common_length(key: tuple[int, ...], tokens: list[int], start: int, end: int | None = None) -> int:
    """How many leading tokens of `key` (a node's: a tuple) equal tokens[start:end]; the span
    is made a tuple once (a tuple never equals a list) and the compares run in C."""
    n = min(len(key), (len(tokens) if end is None else end) - start)
    span = tuple(tokens[start:start + n])
    if (key if n == len(key) else key[:n]) == span:  # a whole node: one copy, not two
        return n
    lo, hi = 0, n  # binary search for the first mismatch: O(log n) slice compares
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if key[:mid] == span[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo
