"""The host tier of the KV pool: pinned CPU memory that holds evicted prefixes' KV.

One tensor [num_host_slots, 2 * layers, kv_heads, head_dim] (every layer's K then V of one
token side by side), so a run of consecutive host slots is one contiguous block: a copy
between the tiers is a few large transfers, not one per layer and token. Indexed by
`host_slot` (0-based), handed out by its own allocator; the radix tree owns the host slots
of its host-resident nodes as it owns the GPU slots of the others.
"""
import torch

from tandem.memory.allocator import SlotAllocator
from tandem.memory.kv_cache import KVCache


class HostKVPool:
    def __init__(self, kv: KVCache, num_host_slots: int, pin: bool):
        layers, (_, heads, dim) = len(kv.k), kv.k[0].shape
        self.num_layers = layers
        self.data = torch.empty((num_host_slots, 2 * layers, heads, dim), dtype=kv.k[0].dtype,
                                pin_memory=pin)
        self.host_slots = SlotAllocator(num_host_slots, first=0)
        self.token_bytes = self.data[0].nbytes

    @staticmethod
    def bytes_per_token(kv: KVCache) -> int:
        """Host bytes per token: this rank's K and V of every layer."""
        return 2 * len(kv.k) * kv.k[0][0].nbytes

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
