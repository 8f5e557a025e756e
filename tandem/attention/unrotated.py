"""The attention's input before its RoPE (Experiments.fused_rope_attention, issue 21).

A decoder layer normally (norms and) rotates q and k in one launch, stores the new K/V in the
cache (in that launch or another), then attends. With the experiment on, a backend that can
(`rope_in_attention`: the Triton backend, decode-only batches) takes this record instead and
does all of it inside its decode kernel: one launch a layer fewer. `norm_rope_rows` is the
same preparation in torch: the reference, and the fallback of any other batch.
"""
from dataclasses import dataclass

import torch


@dataclass
class UnrotatedQKV:
    """The packed qkv projection output [T, (Hq + 2 Hk) * D] (rows contiguous in the last dim),
    the RoPE tables cos/sin [max_positions, D] (float32), the tokens' positions [T], and
    Qwen3's per-head q/k RMSNorm weights [D] (None for Llama-style models)."""

    qkv: torch.Tensor
    num_heads: int
    num_kv_heads: int
    head_dim: int
    positions: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    q_weight: torch.Tensor | None = None
    k_weight: torch.Tensor | None = None
    eps: float = 1e-6

    def _view(self, first_head: int, heads: int) -> torch.Tensor:
        d = self.head_dim
        return self.qkv.as_strided((self.qkv.shape[0], heads, d), (self.qkv.stride(0), d, 1),
                                   self.qkv.storage_offset() + first_head * d)

    @property
    def q(self) -> torch.Tensor:
        """[T, Hq, D], a view of qkv (not rotated)."""
        return self._view(0, self.num_heads)

    @property
    def k(self) -> torch.Tensor:
        """[T, Hk, D], a view of qkv (not normed, not rotated)."""
        return self._view(self.num_heads, self.num_kv_heads)

    @property
    def v(self) -> torch.Tensor:
        """[T, Hk, D], a view of qkv."""
        return self._view(self.num_heads + self.num_kv_heads, self.num_kv_heads)

    @property
    def has_norm(self) -> bool:
        return self.q_weight is not None


def norm_rope_rows(u: UnrotatedQKV) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k (per-head RMSNorm when u has weights, then RoPE) and v, new tensors; qkv is left
    unrotated. The torch path: `qkv_norm_rope_torch` (the model's CPU reference); on CUDA
    the RoPE kernel, out of place."""
    if u.qkv.is_cuda:
        from tandem.kernels.rope import rope
        q, k = rope(u.q, u.k, u.positions, u.cos, u.sin, u.q_weight, u.k_weight, u.eps)
        return q, k, u.v
    from tandem.models.layers import qkv_norm_rope_torch
    norm = (u.q_weight, u.k_weight, u.eps) if u.has_norm else ()
    return qkv_norm_rope_torch(u.qkv, u.positions, u.cos, u.sin, u.num_heads, u.num_kv_heads, u.head_dim, *norm)
