"""Triton kernels for paged attention and the KV-cache write.

Their torch references live in `tandem.attention.torch_backend`. With no CUDA device
the kernels run under Triton's interpreter: `triton.jit` decides compiled vs
interpreted when a kernel is defined, so the switch must be made here, before any
kernel module is imported. Compiled Triton cannot run without a GPU anyway, so this
only changes what would otherwise be a crash.
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from tandem.kernels.decode_attention import decode_attention, decode_num_splits  # noqa: E402
from tandem.kernels.extend_attention import extend_attention  # noqa: E402
from tandem.kernels.kv_write import write_kv  # noqa: E402

__all__ = ["decode_attention", "decode_num_splits", "extend_attention", "write_kv"]
