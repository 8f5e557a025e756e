"""The layout cascade attention reads: groups of rows, and work items over their shared prefixes.

Host planning (`tandem.scheduler.cascade`) fills it from the radix tree; the kernels and the
torch reference read it. Every size is bounded by host ints so a CUDA graph can capture one
layout per batch bucket: padding groups are empty, padding work items have no keys.
"""
from dataclasses import dataclass

import torch

MAX_GROUP_QUERIES = 64  # the shared pass's M tile: a group's rows x query heads per KV head
MAX_PARTS = 32  # work items (sequence chunks) per group prefix
MIN_PART_TOKENS = 256  # below this a chunk's fixed cost outweighs the parallelism (as decode's splits)
PART_ALIGN = 64  # chunks start on key-tile boundaries
WORK_INTS = 4  # a work item: group, first key, end key, part index
WORK_WAVES = 2  # a step's prefix chunks: about this many waves of (chunk, KV head) programs per SM


def target_work_items(num_sms: int, num_kv_heads: int, waves: int = WORK_WAVES) -> int:
    """Prefix chunks a step aims for: `waves` programs per SM over the KV heads."""
    return -(-waves * num_sms // num_kv_heads)


def max_group_rows(num_heads: int, num_kv_heads: int) -> int:
    """Most rows a group may hold: its queries must fit one M tile. Larger groups are cut
    into several (each still reads the prefix once)."""
    return max(1, MAX_GROUP_QUERIES // (num_heads // num_kv_heads))


def split_prefixes(lens: list[int], target_items: int, min_part: int = MIN_PART_TOKENS
                   ) -> tuple[list[int], list[int]]:
    """Cut each group's prefix (`lens`) into chunks so that ~`target_items` work items
    (`target_work_items`) share the total; no chunk under `min_part` tokens unless the prefix
    is, at most MAX_PARTS a group. Returns the flat work items and parts per group."""
    chunk = max(min_part, -(-sum(lens) // max(target_items, 1)))
    work, parts = [], []
    for g, n in enumerate(lens):
        k = min(MAX_PARTS, max(1, -(-n // chunk)))
        part_len = -(-(-(-n // k)) // PART_ALIGN) * PART_ALIGN
        k = -(-n // part_len)
        for p in range(k):
            work += [g, p * part_len, min(n, (p + 1) * part_len), p]
        parts.append(k)
    return work, parts


@dataclass
class CascadeInputs:
    """Decode rows grouped by a shared KV prefix: row b reads keys [0, shared_lens[b]) as its
    group's shared part; group g is rows group_rows[group_indptr[g]:group_indptr[g + 1]]; work
    item w covers keys [work[4w + 1], work[4w + 2]) of group work[4w] as part work[4w + 3] of
    the row's `shared_parts[b]`. Device tensors plus host bounds."""

    shared_lens: torch.Tensor  # [B] tokens of the row's shared prefix (0: no group)
    shared_parts: torch.Tensor  # [B] work items of the row's group (0: no group)
    shared_src: torch.Tensor  # [B] request slot whose table row holds it (the torch reference reads it)
    group_rows: torch.Tensor  # [>= 1] batch rows, groups back to back
    group_indptr: torch.Tensor  # [groups + 1]; an empty group is padding
    work: torch.Tensor  # [WORK_INTS x items]
    max_group_size: int  # host bound: the M tile (the mid buffers hold MAX_PARTS shared splits)
