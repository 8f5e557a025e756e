"""The KV pool's element type inside the kernels: how a store casts to it and in what type the
attention dots read it.

Every writer of the pool casts with `to_cache` (kv_write, RoPE's fused store) and every
attention kernel dots with `dot_kv` over tiles loaded straight from the pool. The branches
are on the pool's element type, a compile-time value, so a 16- or 32-bit pool compiles to
the code it did before these helpers (a cast to a tensor's own type emits nothing).

An e4m3 pool (`kv_cache_dtype="fp8"`, scale 1.0):
- stores saturate at +-FP8_MAX: e4m3fn has no inf, an unclamped cast of a larger value is NaN;
- dots run in float16 with fp32 accumulation: e4m3 -> f16 is one conversion a value on
  Hopper, e4m3 -> bf16 goes through f16 (three). q and the probabilities p are cast to f16
  too (q once per program, before the key loop: `dot_operand`).
"""
import os

import triton
import triton.language as tl

from tandem.memory.kv_cache import FP8_MAX

_FP8_MAX = tl.constexpr(FP8_MAX)  # a constexpr global: the only kind a kernel may read
# Compiled, not interpreted: the interpreter cannot run inline PTX (`f16_where_loaded`).
_COMPILED = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0") != "1")


@triton.jit
def to_cache(x, dtype: tl.constexpr):
    """x cast to the pool's element type `dtype`, saturated at +-FP8_MAX for an e4m3 pool."""
    if dtype.is_fp8():
        x = tl.clamp(x.to(tl.float32), -_FP8_MAX, _FP8_MAX)
    return x.to(dtype)


@triton.jit
def f16_where_loaded(x):
    """An e4m3 tile as float16, converted in the layout it was loaded in (16 values an asm call,
    `cvt.rn.f16x2.e4m3x2`). A plain `.to` is moved by Triton past the tile's trip through shared
    memory, so a tile the dot reads transposed (V: keys are its reduction axis, not its
    contiguous one) is read back a byte at a time (sm_90 has no 8-bit `ldmatrix.trans`); an
    asm call with side effects (`is_pure=False`) stays where it is written, and the f16 tile then
    takes `ldmatrix.trans` like a bf16 pool's. Same values as `.to(tl.float16)`."""
    if _COMPILED:
        y = tl.inline_asm_elementwise(
            "{ .reg .b16 a<8>; mov.b32 {a0, a1}, $8; mov.b32 {a2, a3}, $9; mov.b32 {a4, a5}, $10; "
            "mov.b32 {a6, a7}, $11; cvt.rn.f16x2.e4m3x2 $0, a0; cvt.rn.f16x2.e4m3x2 $1, a1; "
            "cvt.rn.f16x2.e4m3x2 $2, a2; cvt.rn.f16x2.e4m3x2 $3, a3; cvt.rn.f16x2.e4m3x2 $4, a4; "
            "cvt.rn.f16x2.e4m3x2 $5, a5; cvt.rn.f16x2.e4m3x2 $6, a6; cvt.rn.f16x2.e4m3x2 $7, a7; }",
            "=r,=r,=r,=r,=r,=r,=r,=r,r,r,r,r", [x.to(tl.uint8, bitcast=True)], dtype=tl.float16,
            is_pure=False, pack=16)
    else:
        y = x.to(tl.float16)
    return y


@triton.jit
def dot_operand(x, CACHE_DTYPE: tl.constexpr):
    """x in the type the attention dots take over a pool of CACHE_DTYPE: the pool's own
    type, or float16 over an e4m3 pool."""
    if CACHE_DTYPE.is_fp8():
        y = x.to(tl.float16)
    else:
        y = x.to(CACHE_DTYPE)
    return y


@triton.jit
def dot_kv(a, kv, acc, DOT_PRECISION: tl.constexpr):
    """tl.dot(a, kv, acc) with `kv` a tile loaded from the pool (K^T for QK, V for PV): both
    operands in `dot_operand`'s type, fp32 accumulation (acc None: a fresh fp32 result)."""
    return tl.dot(dot_operand(a, kv.dtype), dot_operand(kv, kv.dtype), acc, input_precision=DOT_PRECISION)
