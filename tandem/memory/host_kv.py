"""The host tier of the KV pool: pinned CPU memory that holds evicted prefixes' KV.

The tier holds every KV cache that is indexed by the pool's token slots: the target's, and a
draft model's when there is one (its KV shares the target's slots, so a prefix moved to the
host and back must move in both, or the draft's proposals after a load-back read stale KV).
One tensor [num_host_slots, token_elems]: a host slot's row is each cache's K then V of every
layer ([2 * layers, kv_heads, head_dim], flattened), cache after cache (`token_parts`). So a
run of consecutive host slots is one contiguous block: a copy between the tiers is a few large
transfers for all caches together, not one per cache, layer and token. Indexed by `host_slot`
(0-based), handed out by its own allocator; the radix tree owns the host slots of its
host-resident nodes as it owns the GPU slots of the others.
"""
import torch

from tandem.memory.allocator import SlotAllocator
from tandem.memory.kv_cache import KVCache


class HostKVPool:
    def __init__(self, caches: list[KVCache], num_host_slots: int, pin: bool):
        if not caches:
            raise ValueError("a host KV tier needs at least one KV cache")
        dtypes = {kv.k[0].dtype for kv in caches}
        if len(dtypes) != 1:
            raise ValueError(f"the host KV tier's caches must share one dtype; got {sorted(map(str, dtypes))}")
        # Per cache: (layers, kv_heads, head_dim) of one token.
        self.shapes = [(len(kv.k),) + tuple(kv.k[0].shape[1:]) for kv in caches]
        elems = [2 * layers * heads * dim for layers, heads, dim in self.shapes]
        self.offsets = [sum(elems[:i]) for i in range(len(elems))]  # each cache's first element in a row
        self.data = torch.empty((num_host_slots, sum(elems)), dtype=dtypes.pop(), pin_memory=pin)
        self.host_slots = SlotAllocator(num_host_slots, first=0)
        self.token_parts = [n * self.data.element_size() for n in elems]  # bytes per token, per cache
        self.token_bytes = sum(self.token_parts)

    def part(self, rows: torch.Tensor, cache: int) -> torch.Tensor:
        """Cache `cache`'s share of `rows` (host rows, or device staging of the same layout):
        a view [n, 2 * layers, kv_heads, head_dim], K of every layer then V."""
        layers, heads, dim = self.shapes[cache]
        first = self.offsets[cache]
        return rows[:, first:first + 2 * layers * heads * dim].view(rows.shape[0], 2 * layers, heads, dim)

    @staticmethod
    def bytes_per_token(caches: list[KVCache]) -> int:
        """Host bytes per token: this rank's K and V of every layer of every cache."""
        return sum(2 * len(kv.k) * kv.k[0][0].nbytes for kv in caches)

    @staticmethod
    def num_slots_for(gib: float, bytes_per_token: int) -> int:
        """Host slots that `gib` GiB of pinned memory holds (this rank's shard per token)."""
        return int(gib * 2**30) // bytes_per_token


def contiguous_runs(host_slots: list[int]) -> list[tuple[int, int, int]]:
    """(offset in the list, first host slot, length) of each run of consecutive host slots:
    one transfer per run (the allocator hands out low slots first, so runs are long)."""
    runs, start = [], 0
    for i in range(1, len(host_slots) + 1):
        if i == len(host_slots) or host_slots[i] != host_slots[i - 1] + 1:
            runs.append((start, host_slots[start], i - start))
            start = i
    return runs
