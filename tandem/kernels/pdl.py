"""Programmatic dependent launch (PDL, compute capability 9.0+) for the decode path's kernels.

At batch 1 a decode step is ~200 small dependent kernels, and each boundary costs the next
kernel's launch and ramp-up (docs/benchmarks.md: the step is bound by kernel count). A kernel
launched with PDL may be scheduled while the kernel before it in the stream still runs: each
of ours first lets its own dependents launch (griddepcontrol.launch_dependents), then waits
(griddepcontrol.wait) until the previous grid has completed and its writes are visible, so the
next kernel's launch hides under this one's work.

Ordering rule: `pdl_prologue` runs before a PDL kernel's first load or store. The wait returns
only after the previous grid completed, and that grid waited for its own predecessor before it
touched memory, so every earlier kernel in the stream is complete: no read of unfinished
results, no overwrite of memory an earlier kernel still reads. Work that is not a PDL kernel
(cuBLAS, torch ops, copies, event waits) keeps the plain stream order. CUDA graphs capture the
launch attribute as programmatic edges.

On by default since session 13's H200 A/B (docs/benchmarks.md): the Qwen3-0.6B shape's
batch-1 decode step 0.952 -> 0.893 ms (+6.6% tok/s), batch 16 and 64 within noise. The fused
decode merge (Experiments.fused_decode_merge) takes the gain back (0.943 ms with both), so it
stays off. TANDEM_PDL=0 (read once per process) launches every kernel the plain way and
USE_PDL=False compiles the prologue away: a debug switch, for bisecting an ordering bug.
"""
import functools
import os

import torch
import triton
import triton.language as tl

PDL_ENV = "TANDEM_PDL"


@functools.lru_cache(maxsize=None)
def _enabled() -> bool:
    return os.environ.get(PDL_ENV, "1") != "0"


@functools.lru_cache(maxsize=None)
def _capable(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index)[0] >= 9


def uses_pdl(device: torch.device) -> bool:
    """Kernels on `device` launch with PDL: CUDA, compute capability >= 9.0, switched on."""
    if device.type != "cuda" or not _enabled():
        return False
    return _capable(device.index if device.index is not None else torch.cuda.current_device())


def pdl_options(device: torch.device) -> dict:
    """A PDL kernel's launch keywords on `device`: its USE_PDL constexpr, and Triton's
    `launch_pdl` option where it is on (the interpreter and the CPU never see it)."""
    return {"USE_PDL": True, "launch_pdl": True} if uses_pdl(device) else {"USE_PDL": False}


@triton.jit
def pdl_prologue(USE_PDL: tl.constexpr):
    """First statement of a PDL kernel (the ordering rule in the module docstring)."""
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
