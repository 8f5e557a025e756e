"""Attention backends: a torch reference (any device) and Triton kernels (CUDA)."""
from typing import Protocol

import torch

from tandem.attention.torch_backend import TorchAttention
from tandem.forward_batch import ForwardBatch

__all__ = ["AttentionBackend", "TorchAttention", "make_attention_backend"]


class AttentionBackend(Protocol):
    """Writes the new tokens' K/V into the cache, then attends over each request's cache."""

    name: str

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, batch: ForwardBatch, scale: float) -> torch.Tensor: ...


def make_attention_backend(name: str, device: torch.device,
                           split_by_context: bool = True) -> AttentionBackend:
    """`auto` picks Triton on CUDA when it is importable, the torch reference otherwise."""
    if name == "torch" or (name == "auto" and device.type != "cuda"):
        return TorchAttention()
    if name in ("auto", "triton"):
        try:
            from tandem.attention.triton_backend import TritonAttention
        except ImportError:
            if name == "triton":
                raise
            return TorchAttention()
        return TritonAttention(split_by_context)
    raise ValueError(f"attention backend must be one of auto, torch, triton; got {name!r}")
