"""Attention backends: a torch reference (any device) and Triton kernels (CUDA)."""
from typing import Protocol

import torch

from tandem.attention.torch_backend import TorchAttention
from tandem.config import Experiments
from tandem.forward_batch import ForwardBatch

__all__ = ["AttentionBackend", "TorchAttention", "make_attention_backend"]


class AttentionBackend(Protocol):
    """Writes the new tokens' K/V into the cache (unless its caller did), then attends over
    each request's cache."""

    name: str
    # Whether the model stores the new K/V itself (in its RoPE kernel) and passes kv_written=True.
    fused_kv_write: bool

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, batch: ForwardBatch, scale: float,
                kv_written: bool = False) -> torch.Tensor: ...


def make_attention_backend(name: str, device: torch.device,
                           experiments: Experiments | None = None) -> AttentionBackend:
    """`auto` picks Triton on CUDA when it is importable, the torch reference otherwise.
    The attention switches of `experiments` (default: `Experiments()`) apply to Triton only
    (the reference always writes its own cache, and has no split-K kernel)."""
    exp = experiments if experiments is not None else Experiments()
    if name == "torch" or (name == "auto" and device.type != "cuda"):
        return TorchAttention()
    if name in ("auto", "triton"):
        try:
            from tandem.attention.triton_backend import TritonAttention
        except ImportError:
            if name == "triton":
                raise
            return TorchAttention()
        return TritonAttention(exp.attention_split_by_context, exp.fused_kv_write, exp.fused_decode_merge,
                               exp.fp8_v_f16_where_loaded)
    raise ValueError(f"attention backend must be one of auto, torch, triton; got {name!r}")
