"""Attention backends: a torch reference (any device) and Triton kernels (CUDA)."""
import torch
from tandem.attention.torch_backend import TorchAttention

__all__ = ["TorchAttention", "make_attention_backend"]


def make_attention_backend(name: str, device: torch.device) -> "TorchAttention":  # noqa: F821
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
        return TritonAttention()
    raise ValueError(f"attention backend must be one of auto, torch, triton; got {name!r}")
