"""Building blocks of the decoder: RMSNorm, rotary embedding, gated MLP.

On CUDA tensors each block runs one fused Triton kernel (`tandem.kernels.norm`,
`.rope`, `.activation`: the torch versions launch 8-16 elementwise kernels each); on
the CPU the torch functions below run (they are the reference, match transformers, and
are what the kernels are tested and benchmarked against). The choice is made per call
from the input's device. The kernel modules are imported on first CUDA use, so
CPU-only installs never import Triton.
"""
import math

import torch
import torch.nn.functional as F
from torch import nn

from tandem.distributed.group import SINGLE, TPGroup
from tandem.models.linear import Linear


# ---- torch references (the CPU path) ----
def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Normalise in float32, scale in the input dtype: what transformers does.
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


def rope_torch(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_table: torch.Tensor,
               sin_table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    cos = cos_table[positions].unsqueeze(1).to(q.dtype)
    sin = sin_table[positions].unsqueeze(1).to(q.dtype)
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def qkv_norm_rope_torch(qkv: torch.Tensor, positions: torch.Tensor, cos_table: torch.Tensor,
                        sin_table: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int,
                        q_weight: torch.Tensor | None = None, k_weight: torch.Tensor | None = None,
                        eps: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Packed qkv [T, (H + 2*KVH) * D] -> q, k (per-head RMSNorm if weights given, then
    RoPE), v: the attention's input preparation."""
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
    q = q.view(-1, num_heads, head_dim)
    k = k.view(-1, num_kv_heads, head_dim)
    v = v.view(-1, num_kv_heads, head_dim)
    if q_weight is not None:
        q, k = rms_norm_torch(q, q_weight, eps), rms_norm_torch(k, k_weight, eps)
    q, k = rope_torch(positions, q, k, cos_table, sin_table)
    return q, k, v


def silu_mul_torch(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda:
            from tandem.kernels.norm import rms_norm
            return rms_norm(x, self.weight, self.eps)
        return rms_norm_torch(x, self.weight, self.eps)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Residual add then norm; returns (normed, new residual)."""
        if x.is_cuda:
            from tandem.kernels.norm import fused_add_rms_norm
            return fused_add_rms_norm(x, residual, self.weight, self.eps)
        residual = x + residual
        return self.forward(residual), residual


def llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    """Llama 3.1 frequency scaling: long wavelengths divided by `factor`, a smooth ramp between."""
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """Neox-style RoPE (rotate halves) with a cos/sin table indexed by absolute position."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict | None):
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        if scaling is not None:
            inv_freq = llama3_inv_freq(inv_freq, scaling)
        t = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """q [T, H, D], k [T, KVH, D] rotated by their token's position."""
        if q.is_cuda:
            from tandem.kernels.rope import rope
            return rope(q, k, positions, self.cos, self.sin)
        return rope_torch(positions, q, k, self.cos, self.sin)


class GatedMLP(nn.Module):
    """down(silu(gate(x)) * up(x)) with gate and up packed in one matmul; under tensor
    parallelism gate/up are this rank's rows and down all-reduces."""

    def __init__(self, hidden: int, intermediate: int, tp: TPGroup = SINGLE):
        super().__init__()
        self.gate_up_proj = Linear(hidden, 2 * intermediate, normed=True)  # post_attention_layernorm in front
        self.down_proj = Linear(intermediate, hidden, reduce=tp.all_reduce if tp.size > 1 else None, gated=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.gate_up_proj(x))

    def down(self, gate_up: torch.Tensor) -> torch.Tensor:
        """down(silu(gate) * up) of the packed gate_up rows (a decoder layer computes gate_up
        itself, with the norm in front fused where it can)."""
        if gate_up.is_cuda:
            fused = self.down_proj.silu_mul_forward(gate_up)  # small batch: one launch
            if fused is not None:
                return fused
            from tandem.kernels.activation import silu_mul
            return self.down_proj(silu_mul(gate_up))
        return self.down_proj(silu_mul_torch(gate_up))
