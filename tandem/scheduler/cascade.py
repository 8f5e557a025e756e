"""Which decode rows attend a shared prefix once per group (cascade attention), from host facts.

A request reads the radix-tree nodes on its path root..`cache_node` up to the first node whose
slots are not its own table's (it computed a duplicate copy there; `PrefixCache._insert`).
Duplicate runs begin and end at node boundaries (the tree splits edges where a match or an
insert stops), so comparing each node's first slot decides the whole node. Rows reading the
same node read the same KV slots below its end: that is a group's shared prefix.

Lifetime: every node on a request's path is locked by it until it is released, and release
waits for the request's last launched step (the one-step lag), so the shared slots cannot be
freed or reused while a queued step reads them.
"""
import operator
from collections import Counter
from dataclasses import dataclass, field

import torch

from tandem.cascade_layout import WORK_INTS, CascadeInputs, split_prefixes
from tandem.request import Request

# A cascade step's fixed cost (two more kernels a layer), as KV bytes its groups must save (CascadeRule).
STEP_COST_BYTES = 5 << 30

# Staged in this order; CascadeInputs takes the tensors in the same order.
FIELDS = ("cascade_shared_lens", "cascade_shared_parts", "cascade_shared_src", "cascade_group_rows",
          "cascade_group_indptr", "cascade_work")


@dataclass(frozen=True)
class CascadeRule:
    """When grouping pays, per group and per step: the measured crossover.

    On the H100 (session 40, `python -m tandem.bench.cascade_kernels`, graph replays, Qwen3-0.6B
    heads, 256-token suffixes) the cascade path beat the single-level kernel for groups of 8-16
    rows over >= 512 shared tokens once the step's groups saved ~50k token reads, and lost
    everywhere with 2 rows a group (0.49-0.74x) and with 4 below 2,048 tokens (0.55-0.96x):
    the single-level kernel already reads a prefix its adjacent rows share mostly from L2, and
    the cascade path runs two more kernels a layer (the shared part, the merge). So a group
    needs `min_group_rows` 8 and `min_shared_len` 512 (511: below), and a step groups only when its groups
    save >= `min_saved_tokens` token reads ((rows - 1) x prefix length, summed): 5 GiB of KV
    (STEP_COST_BYTES) in the model's bytes a token (`for_model`; 47k tokens of Qwen3-0.6B's
    112 KiB: among such groups the sweep's winners saved >= 57k, its losers <= 31k). A model
    whose group of query heads per KV head is 16 or more fits fewer than 8 rows in the shared
    pass's tile and never groups. `forced()` groups any shared prefix (tests, A/B).
    The length bound is 511, not the 512 measured: copies of an N-token prompt (`n` samples,
    best-of, a repeated prompt) share N - 1 tokens, as each request computes the last prompt
    token itself for its logits; with 512, 512-token prompts never grouped (session 41, H100:
    the samples workload ran 0 cascade steps).
    """

    min_shared_len: int = 511
    min_group_rows: int = 8
    min_saved_tokens: int = 48 << 10
    max_group_rows: int = 16  # the kernel's M tile: set from the model's heads per KV head
    work_items: int = 32  # prefix chunks a step aims for: ~2 waves of SMs per KV head (the engine sets it)

    @classmethod
    def for_model(cls, max_group_rows: int, work_items: int, kv_bytes_per_token: int) -> "CascadeRule":
        """The cost rule for a model whose KV takes `kv_bytes_per_token` over all layers."""
        return cls(min_saved_tokens=-(-STEP_COST_BYTES // kv_bytes_per_token), max_group_rows=max_group_rows,
                   work_items=work_items)

    @classmethod
    def forced(cls, max_group_rows: int, work_items: int = 32) -> "CascadeRule":
        return cls(min_shared_len=1, min_group_rows=2, min_saved_tokens=0, max_group_rows=max_group_rows,
                   work_items=work_items)

    def graph_capacity(self, bucket: int) -> tuple[int, int]:
        """(groups, work items) a `bucket`-row step can need: groups have >= min_group_rows
        rows; chunks are >= total / work_items tokens, so items <= work_items + groups."""
        groups = bucket // self.min_group_rows
        return groups, groups + self.work_items

    def worth(self, shared_len: int, rows: int) -> bool:
        return shared_len >= self.min_shared_len and rows >= self.min_group_rows


@dataclass
class CascadePlan:
    """Host lists staged with the step's metadata (`fields`); see `CascadeInputs`."""

    shared_lens: list[int]  # per row: tokens read from its group's prefix (0: no group)
    shared_parts: list[int]  # per row: work items of its group (0: no group)
    shared_src: list[int]  # per row: request slot whose table row holds the prefix (own slot if none)
    group_rows: list[int]  # batch rows of each group, groups back to back
    group_indptr: list[int]  # [groups + 1] offsets into group_rows
    work: list[int]  # WORK_INTS per item: group, first key, end key, part

    def fields(self) -> dict[str, list[int]]:
        return dict(zip(FIELDS, (self.shared_lens, self.shared_parts, self.shared_src, self.group_rows,
                                 self.group_indptr, self.work)))

    def padded_fields(self, bucket: int, groups: int, items: int) -> dict[str, list[int]]:
        """The CUDA-graph layout: fixed sizes for a `bucket`-row graph. Padding rows have no
        group, padding groups no rows, padding work items no keys."""
        rows = bucket - len(self.shared_lens)
        assert len(self.group_indptr) - 1 <= groups and len(self.work) <= WORK_INTS * items
        return dict(zip(FIELDS, (
            self.shared_lens + [0] * rows, self.shared_parts + [0] * rows, self.shared_src + [0] * rows,
            self.group_rows + [0] * (bucket - len(self.group_rows)),
            self.group_indptr + [self.group_indptr[-1]] * (groups + 1 - len(self.group_indptr)),
            self.work + [0] * (WORK_INTS * items - len(self.work)))))


@dataclass
class CascadeMemo:
    """What `plan_cascade` keeps between steps (the runner's): each row's read path while its
    request keeps the same `cache_node`, and the last plan with the requests and cache nodes it
    was made for. The same requests in the same order at the same nodes make the same plan, so
    steady decode reuses it after two C-level identity scans (256 rows: ~0.02 ms on the CPU,
    where checking each row's path took ~0.1-0.2; 512 grouped rows: ~1 ms to plan again).
    Both hold while the tree's split count (`RadixCache.splits`) stays the one they were read at:
    a split puts a new node above a request's `cache_node` without changing it, so a path read
    before it lacks that node (before session 41 the request that had computed a group's prefix
    read its path before its group arrived and split the node, and never grouped: 32 of 512
    rows attended all their ~2,300 keys in the suffix part)."""

    paths: dict = field(default_factory=dict)  # id(request) -> (request, cache_node, min end, path)
    reqs: list = field(default_factory=list)  # each row's request, in order, of the last plan
    nodes: list = field(default_factory=list)  # their cache_node then
    plan: "CascadePlan | None" = None
    tree_splits: int = -1  # the tree's split count when `paths` and `plan` were read


def plan_cascade(reqs: list[Request], rule: CascadeRule, memo: CascadeMemo | None = None,
                 tree_splits: int = 0) -> CascadePlan | None:
    """Groups of decode rows (`reqs`: each row's request, in row order) sharing a prefix the
    rule finds worth it; None when there are none.
    Each row joins the node on its read path that saves most (prefix length x (1 - 1/rows)).
    `memo` (the caller's, kept between steps, always with the same rule) is left holding only
    this step's rows; `tree_splits`: the tree's split count now (`ScheduledBatch.tree_splits`)."""
    memo = memo if memo is not None else CascadeMemo()
    if memo.tree_splits != tree_splits:  # a node moved under a new one: every path is read again
        memo.paths.clear()
        memo.reqs, memo.nodes, memo.tree_splits = [], [], tree_splits
    nodes = [req.cache_node for req in reqs]
    if (len(reqs) == len(memo.reqs) and all(map(operator.is_, reqs, memo.reqs))
            and all(map(operator.is_, nodes, memo.nodes))):
        return memo.plan
    paths = _read_paths(reqs, memo.paths, rule.min_shared_len)
    memo.reqs, memo.nodes, memo.plan = reqs, nodes, _plan(reqs, paths, rule)
    return memo.plan


def _plan(reqs: list[Request], paths: list[list[tuple[int, int]]], rule: CascadeRule) -> CascadePlan | None:
    # A node's rows all read its ancestors too, so each row's first (shallowest) node is its
    # most shared one: when no first node is shared, nothing is. The common case without
    # sharing ends here, after one count a row (256 rows on the CPU: ~0.1 ms, not the ~0.4 of a
    # full count when two rows' prompts share a first token).
    firsts = Counter(path[0][0] for path in paths if path)
    if not firsts or max(firsts.values()) < rule.min_group_rows:
        return None
    counts = Counter(node for path in paths for node, _ in path)
    ends = {node: end for path in paths for node, end in path}
    score = {node: ends[node] * (1 - 1 / n) for node, n in counts.items() if rule.worth(ends[node], n)}
    chosen: dict[int, list[int]] = {}  # node -> rows
    for b, path in enumerate(paths):
        best = max(((score[node], node) for node, _ in path if node in score), default=None)
        if best is not None:
            chosen.setdefault(best[1], []).append(b)
    groups = [(ends[node], members[i:i + rule.max_group_rows]) for node, members in chosen.items()
              for i in range(0, len(members), rule.max_group_rows)]
    groups = [(end, members) for end, members in groups if rule.worth(end, len(members))]
    if not groups or sum((len(members) - 1) * end for end, members in groups) < rule.min_saved_tokens:
        return None
    work, parts = split_prefixes([end for end, _ in groups], rule.work_items)
    shared_lens, shared_parts = [0] * len(reqs), [0] * len(reqs)
    shared_src = [req.slot for req in reqs]
    group_rows, indptr = [], [0]
    for (end, members), k in zip(groups, parts):
        for b in members:
            shared_lens[b], shared_parts[b], shared_src[b] = end, k, reqs[members[0]].slot
        group_rows += members
        indptr.append(len(group_rows))
    return CascadePlan(shared_lens, shared_parts, shared_src, group_rows, indptr, work)


def _read_paths(reqs: list[Request], memo: dict, min_end: int) -> list[list[tuple[int, int]]]:
    """Each row's (request's) read path, without the nodes ending before `min_end` (too short to group:
    `CascadeRule.worth`), reused from `memo` while its request keeps the same `cache_node`.
    A reused path stays true: the request's slots below a node it read change only through
    release, and a readmission at the same node reads the whole path; a split since it was read
    clears `memo` (`plan_cascade`). Its node ids stay unique: the entry holds `cache_node`, whose
    parent links keep every node of the path alive."""
    old, paths = dict(memo), []
    memo.clear()
    for req in reqs:
        hit = old.get(id(req))
        if hit is None or hit[0] is not req or hit[1] is not req.cache_node or hit[2] != min_end:
            hit = (req, req.cache_node, min_end, [(node, end) for node, end in _read_path(req) if end >= min_end])
        memo[id(req)] = hit
        paths.append(hit[3])
    return paths


def _read_path(req) -> list[tuple[int, int]]:
    """(id of the node, its end position) for each tree node, from the root, whose slots the
    request reads."""
    nodes, node = [], req.cache_node
    while node is not None and node.parent is not None:  # the root has no parent and no tokens
        nodes.append(node)
        node = node.parent
    path, end = [], 0
    for node in reversed(nodes):
        if end >= len(req.kv_slots) or req.kv_slots[end] != node.slots[0]:
            break  # the request computed its own copy from here on
        end += len(node.slots)
        path.append((id(node), end))
    return path


def staged_inputs(fields: dict[str, list[int]], dev: dict[str, torch.Tensor],
                  rule: CascadeRule) -> CascadeInputs | None:
    """The eager forward's view of a plan staged with the step's metadata; None: it has none.
    The M tile is the rule's bound, as in graphs: one kernel specialization, compiled at
    warm-up, not one per group size met while serving."""
    if FIELDS[0] not in fields:
        return None
    return CascadeInputs(*(dev[name] for name in FIELDS), max_group_size=rule.max_group_rows)


def graph_inputs(views: dict[str, torch.Tensor], rule: CascadeRule) -> CascadeInputs:
    """A CUDA graph's view of its padded layout: fixed host bounds for every replay."""
    return CascadeInputs(*(views[name] for name in FIELDS), max_group_size=rule.max_group_rows)


def graph_sizes(bucket: int, rule: CascadeRule) -> dict[str, int]:
    groups, items = rule.graph_capacity(bucket)
    return dict(zip(FIELDS, (bucket, bucket, bucket, bucket, groups + 1, WORK_INTS * items)))
