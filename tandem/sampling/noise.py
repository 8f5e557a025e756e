"""Counter-based sampling noise: a hash of (seed, output index, token id), then Gumbel-max."""
from __future__ import annotations

import functools
import os

import numpy as np
import torch
from torch import Tensor

# As in tandem.kernels: with no GPU, Triton kernels can only run interpreted, and the
# switch must be set before Triton is first imported. The CPU sampler uses the torch
# path anyway; this lets the tests check the fused kernel against it on the CPU.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Triton is imported on first use of the fused kernel (`gumbel_kernel`), not here: the CPU
# path never needs it, and importing it costs ~0.6 s plus a nanobind leak report at exit.
triton = tl = None


_M32 = 0xFFFF_FFFF


def _mix32(x: Tensor) -> Tensor:
    """lowbias32 (Wellons) on 32-bit values held in int64 (or Python ints, or numpy uint64:
    the host's `row_keys_host`).

    Every product is a 32-bit value times a constant below 2**31, so it fits in
    int64 without overflow: the bits are defined and equal on CPU and CUDA. The
    second constant, 0x846ca68b, is above 2**31, so it is applied as the
    negation of a multiply by 2**32 - 0x846ca68b (the same thing mod 2**32).
    """
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _M32
    x = x ^ (x >> 15)
    x = (-(x * 0x7B935975)) & _M32
    return x ^ (x >> 16)


def row_keys(seed: Tensor, output_index: Tensor) -> Tensor:
    """[B] int64 32-bit key per (seed, output_index): all 64 seed bits matter. Plain operators
    only, so Python ints work too (the host's: `seed_key`, then `row_keys_host`)."""
    k = _mix32(seed & _M32)
    k = _mix32(k ^ ((seed >> 32) & _M32))
    return _mix32(k ^ (output_index & _M32))


def seed_key(seed: int) -> int:
    """The seed's half of `row_keys` (a Python int, < 2**32): fixed per request, so the host
    hashes it once and each step mixes in only the output index (`row_keys_host`)."""
    k = _mix32(seed & _M32)
    return _mix32(k ^ ((seed >> 32) & _M32))


def row_keys_host(seed_keys: np.ndarray, output_index: list[int]) -> np.ndarray:
    """`row_keys` on the host from each row's `seed_key` (any integer or float array of
    them) and output index: `_mix32` once, in numpy uint64 (products of two 32-bit values
    cannot wrap there); the same bits, as int64."""
    index = np.array(output_index, dtype=np.int64).astype(np.uint64) & np.uint64(_M32)
    return _mix32(np.asarray(seed_keys).astype(np.uint64) ^ index).astype(np.int64)


def gumbel_noise(keys: Tensor, token_hash: Tensor) -> Tensor:
    """[B, V] float32 standard Gumbel noise, a pure function of (row key, token)."""
    h = _mix32(keys[:, None] ^ token_hash[None, :])
    # (h + 0.5) / 2**32 lies strictly inside (0, 1). The logs run in float64 and are
    # rounded to float32 so CPU and CUDA libm differences (<= 1 ulp in float64)
    # almost never reach the float32 result.
    u = (h.to(torch.float64) + 0.5) * (1.0 / 4294967296.0)
    return (-torch.log(-torch.log(u))).to(torch.float32)


def gumbel_argmax_torch(scores: Tensor, keys: Tensor, token_hash: Tensor) -> Tensor:
    """Reference: argmax(scores + Gumbel noise) per row; ~20 passes over [B, V]."""
    return (scores + gumbel_noise(keys, token_hash)).argmax(dim=-1)


def _gumbel_argmax_body(
    scores_ptr, stride, keys_ptr, hash_ptr, best_val_ptr, best_idx_ptr, V, M32,
    CHUNK: tl.constexpr, BLOCK: tl.constexpr,  # a string under `from __future__ import annotations`
):
    """One program per (row, chunk of CHUNK tokens): the same noise as `gumbel_noise`
    (same hash, same float64 logs), fused with a running argmax, so scores are read once."""
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    key = tl.load(keys_ptr + row)
    best_val = tl.full([], float("-inf"), tl.float32)
    best_idx = tl.full([], 0, tl.int64)
    for off in range(0, CHUNK, BLOCK):
        start = chunk * CHUNK + off
        cols = start + tl.arange(0, BLOCK)
        live = cols < V
        s = tl.load(scores_ptr + row * stride + cols, mask=live, other=float("-inf"))
        x = key ^ tl.load(hash_ptr + cols, mask=live, other=0)
        x = x ^ (x >> 16)
        x = (x * 0x7FEB352D) & M32
        x = x ^ (x >> 15)
        x = (-(x * 0x7B935975)) & M32
        x = x ^ (x >> 16)
        u = (x.to(tl.float64) + 0.5) * (1.0 / 4294967296.0)
        g = (-tl.log(-tl.log(u))).to(tl.float32)
        v = tl.where(live, s + g, float("-inf"))
        # Ties go to the lowest index, as torch.argmax: left within a block, strict > across.
        bv, bi = tl.max(v, axis=0, return_indices=True, return_indices_tie_break_left=True)
        take = bv > best_val
        best_idx = tl.where(take, start + bi.to(tl.int64), best_idx)
        best_val = tl.where(take, bv, best_val)
    tl.store(best_val_ptr + row * tl.num_programs(1) + chunk, best_val)
    tl.store(best_idx_ptr + row * tl.num_programs(1) + chunk, best_idx)


@functools.cache
def gumbel_kernel():
    """The fused kernel (interpreted without a GPU), or None where Triton is not installed."""
    global triton, tl  # the kernel body resolves `tl` in this module's globals when compiled
    try:  # CUDA builds of torch ship Triton; without it the torch path runs everywhere.
        import triton
        import triton.language as tl
    except ImportError:  # pragma: no cover
        return None
    return triton.jit(_gumbel_argmax_body)

_CHUNK = 4096
_BLOCK = 1024


def gumbel_argmax_triton(scores: Tensor, keys: Tensor, token_hash: Tensor, kernel=None) -> Tensor:
    """Fused `gumbel_argmax_torch`: per (row, chunk) maxima in one kernel, then a tiny
    torch argmax over chunks (first chunk wins ties, so the lowest index overall)."""
    kernel = kernel or gumbel_kernel()
    scores = scores.contiguous()
    B, V = scores.shape
    n_chunks = -(-V // _CHUNK)
    best_val = torch.empty((B, n_chunks), dtype=torch.float32, device=scores.device)
    best_idx = torch.empty((B, n_chunks), dtype=torch.int64, device=scores.device)
    if B > 0:
        kernel[(B, n_chunks)](
            scores, scores.stride(0), keys, token_hash, best_val, best_idx, V, _M32, CHUNK=_CHUNK, BLOCK=_BLOCK
        )
    return best_idx.gather(1, best_val.argmax(dim=1, keepdim=True)).squeeze(1)


def gumbel_argmax(scores: Tensor, keys: Tensor, token_hash: Tensor) -> Tensor:
    if scores.is_cuda and gumbel_kernel() is not None:
        return gumbel_argmax_triton(scores, keys, token_hash)
    return gumbel_argmax_torch(scores, keys, token_hash)


