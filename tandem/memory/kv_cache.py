"""The KV pool: one K and one V tensor per layer, indexed by token slot.

The pool's element type is the model's, or e4m3 (`kv_cache_dtype="fp8"`): no scale, values
saturated at +-FP8_MAX when stored (`to_cache_dtype`; the kernels' `tandem.kernels.kv_dtype.to_cache`),
upcast by every reader as it loads."""
import torch

# e4m3fn's largest finite value. The format has no inf: a cast that does not saturate (Triton's;
# torch's on the CPU does since some version) gives NaN for anything larger, so every store
# clamps to it first, the reference's too (one rule whatever the torch version).
FP8_MAX = torch.finfo(torch.float8_e4m3fn).max


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype == torch.float8_e4m3fn


def to_cache_dtype(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x as the pool stores it: cast to `dtype`, saturated at +-FP8_MAX for an e4m3 pool."""
    if is_fp8(dtype):
        x = x.float().clamp(-FP8_MAX, FP8_MAX)
    return x.to(dtype)


def byte_view(t: torch.Tensor) -> torch.Tensor:
    """t itself, or its bytes (uint8, same shape) for e4m3: torch has no indexed copy
    (`index_copy_`) of float8 on the CPU, and a copy between tiers moves bytes either way."""
    return t.view(torch.uint8) if is_fp8(t.dtype) else t


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

    @property
    def dtype(self) -> torch.dtype:
        return self.buffer.dtype

    def per_pool(self) -> torch.Tensor:
        """[2 * num_layers, num_slots, num_kv_heads * head_dim]: every layer's K, then every
        layer's V, a row per slot (a view: writes land in the cache)."""
        two, layers, slots, heads, dim = self.buffer.shape
        return self.buffer.view(two * layers, slots, heads * dim)

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        """K and V of every layer: 1 byte an element for e4m3 (finfo knows float8's width)."""
        return 2 * num_layers * num_kv_heads * head_dim * torch.finfo(dtype).bits // 8
