"""The KV pool: one K and one V tensor per layer, indexed by token slot."""
import torch


class KVCache:
    """k[layer], v[layer]: [num_slots, num_kv_heads, head_dim]. Slot 0 is a dummy slot
    (never allocated) that padding rows may write to harmlessly.

    All of them are views of one buffer [2, num_layers, num_slots, num_kv_heads, head_dim]
    (K of every layer, then V): `per_pool` indexes every layer's K and V by slot at once, so
    moving a set of slots to or from the host tier is one indexed copy, not one per layer."""

    def __init__(self, num_layers: int, num_slots: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device):
        self.num_slots = num_slots
        self.buffer = torch.zeros((2, num_layers, num_slots, num_kv_heads, head_dim), dtype=dtype, device=device)
        self.k = list(self.buffer[0].unbind(0))
        self.v = list(self.buffer[1].unbind(0))

    def per_pool(self) -> torch.Tensor:
        """[2 * num_layers, num_slots, num_kv_heads * head_dim]: every layer's K, then every
        layer's V, a row per slot (a view: writes land in the cache)."""
        two, layers, slots, heads, dim = self.buffer.shape
        return self.buffer.view(two * layers, slots, heads * dim)

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * num_kv_heads * head_dim * torch.finfo(dtype).bits // 8
