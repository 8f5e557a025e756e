"""Set-up shared by the Triton kernel tests; import it before any `tandem.kernels` module.

Without CUDA the kernels run in Triton's interpreter on the CPU, float32 and float16 only
(the interpreter's bfloat16 is wrong); with CUDA they run compiled, bfloat16 included.
"""
import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:  # must precede the first kernel definition (tandem.kernels does it too)
    os.environ.setdefault("TRITON_INTERPRET", "1")

DEVICE = "cuda" if HAS_CUDA else "cpu"
_on_gpu = [pytest.mark.gpu] if HAS_CUDA else []
DTYPES = [
    pytest.param(torch.float32, id="fp32", marks=_on_gpu),
    pytest.param(torch.float16, id="fp16", marks=_on_gpu),
    pytest.param(torch.bfloat16, id="bf16", marks=_on_gpu or [pytest.mark.skip(reason="bfloat16 needs CUDA")]),
]
