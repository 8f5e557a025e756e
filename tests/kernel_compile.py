"""Compile every Triton kernel of tandem for the H200 (sm_90) on a machine without a GPU.

Run as a script (`python tests/kernel_compile.py [NAME ...]`) with TRITON_INTERPRET=0: the
interpreter the CPU tests use checks what a kernel computes, not whether it compiles (a value
whose type changes across loop iterations, an op the backend lacks). Each kernel is compiled
in one representative configuration: Qwen3-0.6B's heads (16 query, 8 KV, dim 128), bf16.
Pointer types follow the argument names (`POINTERS`; a capitalized name is a pointer unless
its kernel's overrides say otherwise, as for sizes like M, N, K); other arguments are i32
unless listed as floats. Prints one line per kernel; exits 1 if any failed.
"""
import os
import sys
import time
import traceback

os.environ["TRITON_INTERPRET"] = "0"
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")

from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource, compile  # noqa: E402

import tandem.kernels  # noqa: E402,F401  (its submodules shadow names: read them from sys.modules)

TARGET = GPUTarget("cuda", 90, 32)
POINTERS = {  # by argument name; anything else in CamelCase or *_ptr is bf16
    "ReqToToken": "*i32", "History": "*i32", "Tokens": "*i32", "Count": "*i32", "hash_ptr": "*i64",
    "Counters": "*i32", "keys_ptr": "*i64", "best_idx_ptr": "*i64", "best_val_ptr": "*fp32", "scores_ptr": "*fp32",
    "MidO": "*fp32", "MidLse": "*fp32", "Partial": "*fp32", "SqPartial": "*fp32", "Scale": "*fp32", "S": "*fp32",
    "Q8": "*fp8e4nv",
    "Cos": "*fp32", "Sin": "*fp32",
}
INDEX_POINTERS = {"ReqSlots", "SeqLens", "StartLens", "PrefixLens", "QoIndptr", "GroupRows", "GroupIndptr",
                  "Work", "SharedLens", "SharedParts", "Loc", "Pos", "Slots", "Lengths", "BlockRows", "BlockIndex"}
FLOATS = {"qk_scale", "eps"}
FP8_KV = {"K": "*fp8e4nv", "V": "*fp8e4nv"}  # an attention kernel's pool arguments over an e4m3 pool
FP8_POOL = {"KCache": "*fp8e4nv", "VCache": "*fp8e4nv"}  # a store's
ATTN = dict(HEAD_DIM=128, BLOCK_D=128, DOT_PRECISION="tf32")


def _kernel(module: str, name: str):
    return getattr(sys.modules[module], name)


def kernels() -> dict:
    """name -> (kernel, constexprs, pointer overrides)."""
    ka, da, ca = "tandem.kernels.activation", "tandem.kernels.decode_attention", "tandem.kernels.cascade_attention"
    from tandem.sampling.noise import gumbel_kernel
    import tandem.kernels.activation  # noqa: F401
    import tandem.kernels.cascade_attention  # noqa: F401
    import tandem.kernels.fp8_quant  # noqa: F401
    import tandem.kernels.ngram_match  # noqa: F401
    import tandem.kernels.norm  # noqa: F401
    import tandem.kernels.rope  # noqa: F401
    import tandem.kernels.small_m_gemm  # noqa: F401
    import tandem.kernels.spec_settle  # noqa: F401
    import tandem.kernels.verify_inputs  # noqa: F401
    import tandem.kernels.token_history  # noqa: F401
    gemm = dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, SPLIT=False, HAS_SCALE=False, HAS_BIAS=False, EVEN_K=True,
                EVEN_N=True, SILU_MUL=False, NORM=False, HAS_RESIDUAL=False, DOT_PRECISION="tf32", PER_LANE=False)
    split = dict(GROUP=2, HEAD_BLOCKS=1, BLOCK_H=16, BLOCK_N=64, FUSED_MERGE=False, V_F16_WHERE_LOADED=False, **ATTN)
    sizes = {"M": "i32", "N": "i32", "K": "i32"}
    return {
        "silu_mul": (_kernel(ka, "_silu_mul_kernel"), dict(BLOCK=1024), {"I": "i32"}),
        "rms_norm": (_kernel("tandem.kernels.norm", "_rms_norm_kernel"),
                     dict(HAS_RESIDUAL=True, QUANT=False, BLOCK_N=1024, FP8_MAX=448.0), {"N": "i32"}),
        # The FP8 layers' input: e4m3 rows and their fp32 scales (Experiments.fp8_fused_input).
        "rms_norm_fp8": (_kernel("tandem.kernels.norm", "_rms_norm_kernel"),
                         dict(HAS_RESIDUAL=True, QUANT=True, BLOCK_N=1024, FP8_MAX=448.0),
                         {"N": "i32", "Out": "*fp8e4nv", "Scale": "*fp32"}),
        "qk_norm_rope": (_kernel("tandem.kernels.rope", "_qk_norm_rope_kernel"),
                         dict(HEAD_DIM=128, HALF=64, BLOCK_H=1, BLOCK_HALF=64, HAS_NORM=True, HAS_CACHE=True),
                         {}),
        "qk_norm_rope_uncached": (_kernel("tandem.kernels.rope", "_qk_norm_rope_kernel"),
                                  dict(HEAD_DIM=128, HALF=64, BLOCK_H=4, BLOCK_HALF=64, HAS_NORM=False,
                                       HAS_CACHE=False), {}),
        "write_kv": (_kernel("tandem.kernels.kv_write", "_write_kv_kernel"),
                     dict(NUM_KV_HEADS=8, HEAD_DIM=128, BLOCK_H=8, BLOCK_D=128), {}),
        "decode_split": (_kernel(da, "_decode_split_kernel"), dict(SPLIT=True, HAS_START=False, **split), {}),
        # The last split program of each (request, head group) merges: atomics with acq_rel.
        "decode_split_fused_merge": (_kernel(da, "_decode_split_kernel"),
                                     dict(SPLIT=True, HAS_START=False, **{**split, "FUSED_MERGE": True}), {}),
        "decode_suffix": (_kernel(da, "_decode_split_kernel"), dict(SPLIT=True, HAS_START=True, **split), {}),
        "decode_unsplit": (_kernel(da, "_decode_split_kernel"), dict(SPLIT=False, HAS_START=False, **split), {}),
        "decode_merge": (_kernel(da, "_decode_merge_kernel"), dict(HEAD_DIM=128, BLOCK_D=128, BLOCK_N=64), {}),
        "extend": (_kernel("tandem.kernels.extend_attention", "_extend_kernel"),
                   dict(GROUP=2, BLOCK_M=64, BLOCK_N=64, BLOCK_TABLE=False, **ATTN), {}),
        # A graphed prefill step's grid: (row, query block) per program from a host-planned table.
        "extend_block_table": (_kernel("tandem.kernels.extend_attention", "_extend_kernel"),
                               dict(GROUP=2, BLOCK_M=128, BLOCK_N=64, BLOCK_TABLE=True, **ATTN), {}),
        "cascade_shared": (_kernel(ca, "_shared_prefix_kernel"), dict(GROUP=2, BLOCK_M=64, BLOCK_N=64, **ATTN), {}),
        "cascade_merge": (_kernel(ca, "_cascade_merge_kernel"), dict(HEAD_DIM=128, BLOCK_D=128, BLOCK_N=64), {}),
        "small_m_gemm": (_kernel("tandem.kernels.small_m_gemm", "_small_m_gemm_kernel"), gemm, sizes),
        "small_m_gemm_fp8_split_silu": (_kernel("tandem.kernels.small_m_gemm", "_small_m_gemm_kernel"),
                                        {**gemm, "SPLIT": True, "HAS_SCALE": True, "SILU_MUL": True, "EVEN_N": False},
                                        {**sizes, "W": "*fp8e4nv"}),
        "small_m_gemm_per_lane": (_kernel("tandem.kernels.small_m_gemm", "_small_m_gemm_kernel"),
                                  {**gemm, "BLOCK_M": 8, "PER_LANE": True}, sizes),
        "small_m_gemm_per_lane_norm": (_kernel("tandem.kernels.small_m_gemm", "_small_m_gemm_kernel"),
                                       {**gemm, "BLOCK_M": 4, "BLOCK_N": 8, "BLOCK_K": 256, "PER_LANE": True,
                                        "NORM": True, "HAS_RESIDUAL": True}, sizes),
        # Residual add + RMSNorm in the prologue (Res, NormW, ResOut: bf16), FP8, split, ragged.
        "small_m_gemm_fp8_split_norm": (_kernel("tandem.kernels.small_m_gemm", "_small_m_gemm_kernel"),
                                        {**gemm, "SPLIT": True, "HAS_SCALE": True, "NORM": True, "HAS_RESIDUAL": True,
                                         "EVEN_K": False, "EVEN_N": False}, {**sizes, "W": "*fp8e4nv"}),
        "small_m_gemm_m1_norm": (_kernel("tandem.kernels.small_m_gemm", "_small_m_gemm_kernel"),
                                 {**gemm, "BLOCK_M": 1, "BLOCK_N": 8, "BLOCK_K": 512, "HAS_BIAS": True, "NORM": True},
                                 sizes),
        "split_reduce": (_kernel("tandem.kernels.small_m_gemm", "_split_reduce_kernel"),
                         dict(HAS_BIAS=True, NORM=False, BLOCK=1024), sizes),
        "split_reduce_norm": (_kernel("tandem.kernels.small_m_gemm", "_split_reduce_kernel"),
                              dict(HAS_BIAS=True, NORM=True, BLOCK=1024), sizes),
        "fp8_quantize_rows": (_kernel("tandem.kernels.fp8_quant", "_quantize_rows_kernel"),
                              dict(FP8_MAX=448.0, BLOCK=1024), {"Q": "*fp8e4nv", "K": "i32"}),
        "fp8_silu_mul_quantize_rows": (_kernel("tandem.kernels.fp8_quant", "_silu_mul_quantize_rows_kernel"),
                                       dict(FP8_MAX=448.0, BLOCK=4096), {"Q": "*fp8e4nv", "S": "*fp32", "I": "i32"}),
        # Over an e4m3 KV pool (kv_cache_dtype="fp8"): saturating stores, f16 dots (tandem.kernels.kv_dtype).
        "write_kv_fp8": (_kernel("tandem.kernels.kv_write", "_write_kv_kernel"),
                         dict(NUM_KV_HEADS=8, HEAD_DIM=128, BLOCK_H=8, BLOCK_D=128), FP8_POOL),
        "qk_norm_rope_fp8": (_kernel("tandem.kernels.rope", "_qk_norm_rope_kernel"),
                             dict(HEAD_DIM=128, HALF=64, BLOCK_H=1, BLOCK_HALF=64, HAS_NORM=True, HAS_CACHE=True),
                             FP8_POOL),
        "decode_split_fused_merge_fp8": (_kernel(da, "_decode_split_kernel"),
                                         dict(SPLIT=True, HAS_START=False, **{**split, "FUSED_MERGE": True}), FP8_KV),
        # V converted to f16 where loaded (Experiments.fp8_v_f16_where_loaded): the inline PTX assembles.
        "decode_split_fused_merge_fp8_v_f16": (_kernel(da, "_decode_split_kernel"),
                                               dict(SPLIT=True, HAS_START=False,
                                                    **{**split, "FUSED_MERGE": True, "V_F16_WHERE_LOADED": True}),
                                               FP8_KV),
        "extend_fp8": (_kernel("tandem.kernels.extend_attention", "_extend_kernel"),
                       dict(GROUP=2, BLOCK_M=64, BLOCK_N=64, BLOCK_TABLE=False, **ATTN), FP8_KV),
        "cascade_shared_fp8": (_kernel(ca, "_shared_prefix_kernel"), dict(GROUP=2, BLOCK_M=64, BLOCK_N=64, **ATTN),
                               FP8_KV),
        # Speculative decoding's greedy verify step: its settling and its query inputs, one launch each.
        "settle_greedy": (_kernel("tandem.kernels.spec_settle", "_settle_greedy_kernel"), dict(BLOCK=16),
                          {**{n: "*i64" for n in ("Sampled", "Proposals", "Count", "Length", "Relay", "RelayCopy",
                                                  "Packed")}, "Q": "i32", "K": "i32"}),
        "verify_inputs": (_kernel("tandem.kernels.verify_inputs", "_verify_inputs_kernel"), dict(BLOCK=16),
                          {**{n: "*i64" for n in ("Proposals", "Last", "KRows", "InputIds", "Positions", "Locs")},
                           "Table": "*i32", "WIDTH": "i32", "Q": "i32", "K": "i32"}),
        "ngram_match": (_kernel("tandem.kernels.ngram_match", "_ngram_match_kernel"),
                        dict(MIN_N=1, MAX_N=3, BLOCK=1024, BLOCK_K=4), {"WINDOW": "i32", "K": "i32"}),
        "append_sampled": (_kernel("tandem.kernels.token_history", "_append_sampled_kernel"), {},
                           {"Length": "*i64", "InputPositions": "*i64", "Tokens": "*i64", "stride_h": "i64"}),
        "gumbel_argmax": (gumbel_kernel(), dict(CHUNK=4096, BLOCK=1024), {"V": "i32", "M32": "i64"}),
    }


def signature(fn, constexprs: dict, overrides: dict) -> dict:
    sig = {}
    for name in fn.arg_names:
        if name in constexprs:
            sig[name] = "constexpr"
        elif name in overrides:
            sig[name] = overrides[name]
        elif name in POINTERS:
            sig[name] = POINTERS[name]
        elif name in INDEX_POINTERS:
            sig[name] = "*i64"
        elif name[:1].isupper() or name.endswith("_ptr"):  # sizes named in capitals: in overrides
            sig[name] = "*bf16"
        elif name in FLOATS:
            sig[name] = "fp32"
        else:
            sig[name] = "i32"
    return sig


def check_pdl_order(ptx: str) -> None:
    """A PDL kernel's griddepcontrol.wait comes before its first global memory access (the
    ordering rule of tandem.kernels.pdl), in the code the device runs."""
    wait = ptx.find("griddepcontrol.wait")
    accesses = [i for i in (ptx.find(op) for op in ("ld.global", "st.global", "cp.async", "atom.global", "red.global"))
                if i >= 0]
    if wait < 0 or (accesses and min(accesses) < wait):
        raise AssertionError("PDL kernel touches global memory before griddepcontrol.wait")


def check_v_not_read_by_the_byte(ptx: str) -> None:
    """Experiments.fp8_v_f16_where_loaded's point: the e4m3 V tile is converted before its trip
    through shared memory, so nothing reads it back a byte at a time (the default path: 64
    `ld.shared.b8` a thread a tile). A Triton that moves the conversion again fails here."""
    if "ld.shared.b8" in ptx:
        raise AssertionError(f"{ptx.count('ld.shared.b8')} ld.shared.b8: V is staged as bytes again")


# Checks of a kernel's PTX beyond compiling, by entry name.
PTX_CHECKS = {"decode_split_fused_merge_fp8_v_f16": check_v_not_read_by_the_byte}


def main(names: list[str]) -> int:
    failed = 0
    for name, (fn, constexprs, overrides) in kernels().items():
        if names and name not in names:
            continue
        start = time.perf_counter()
        pdl = "USE_PDL" in fn.arg_names  # the H200 launches these with PDL (tandem.kernels.pdl)
        if pdl:
            constexprs = {"USE_PDL": True, **constexprs}
        try:
            src = ASTSource(fn=fn, signature=signature(fn, constexprs, overrides),
                            constexprs={(fn.arg_names.index(k),): v for k, v in constexprs.items()})
            compiled = compile(src, target=TARGET, options={"launch_pdl": True} if pdl else None)
            if pdl:
                check_pdl_order(compiled.asm["ptx"])
            if name in PTX_CHECKS:
                PTX_CHECKS[name](compiled.asm["ptx"])
            print(f"ok      {name} ({time.perf_counter() - start:.1f} s){' pdl' if pdl else ''}", flush=True)
        except Exception:  # noqa: BLE001 - report every kernel, then fail
            failed += 1
            print(f"FAILED  {name}\n{traceback.format_exc()}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
