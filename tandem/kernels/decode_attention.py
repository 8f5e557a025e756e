"""Paged decode attention (one query token per request), split along the sequence.

The split kernel, grid (request, kv head x head block, split): one program owns the query
heads that share a KV head, so each K/V tile is loaded once for the whole GQA group
and QK / PV are `tl.dot`s of [heads, D] x [D, keys] (heads padded to 16, the smallest
MMA tile). Each split covers one chunk of the sequence and writes its normalised
partial output and log-sum-exp; the splits are then merged (flash-decoding), either by
a second launch (`_decode_merge_kernel`, grid (request, head)) or, with a `SplitCounters`
pool, in the same launch: each program counts its arrival on its (request, head group)'s
counter and the last of them merges the group's heads (split-K semaphore fix-up). One
launch a layer fewer, which is what a batch-1 step, bound by kernel count, pays for.
Both merges, and cascade's, are one `_merge_head`: MERGE_TILE splits at a time with a running
max, so no kernel variant is compiled per split count.

The split count is a host int: the grid's upper bound, fixed for a given (batch,
num_splits), so the launch is safe to capture in a CUDA graph (a graph is captured
for the longest context). Each row then chooses on the device, from its own
`seq_lens`, how many of those splits it uses: no split shorter than `min_split_tokens`,
so a 512-token row in a graph sized for 40k tokens runs 8 splits, not 32, and the
unused programs load nothing. The counts are runtime arguments, not constexprs, so a
new value never triggers a compile mid-serving.
Softmax runs in base 2 with log2(e) folded into the scale (exp2 is the native op).
"""
import functools

import torch
import triton
import triton.language as tl

from tandem.kernels.grid import cdiv, next_power_of_2
from tandem.kernels.kv_dtype import dot_kv, dot_operand, f16_where_loaded
from tandem.kernels.pdl import pdl_options, pdl_prologue

LOG2E = 1.4426950408889634
MIN_TOKENS_PER_SPLIT = 256  # host choice: below this a split's fixed cost outweighs the parallelism
# Device choice per row. Measured on the H200 (batch 1 and 16, contexts 128-8192): 64 is as
# fast as using every split of the grid, 128-256 up to 1.8x slower at batch 1.
MIN_ROW_SPLIT_TOKENS = 64
MAX_SPLITS = 32
MAX_BLOCK_H = 64  # larger GQA groups are spread over several head blocks


@triton.jit
def _split_len(seq_len, num_splits, min_split_tokens, BLOCK_N: tl.constexpr):
    """Tokens per split for one row: whole key blocks (only a chunk's last block is
    ragged), at least `min_split_tokens`, so a short row uses fewer than `num_splits`."""
    split_len = tl.maximum(tl.cdiv(seq_len, num_splits), min_split_tokens)
    return tl.cdiv(split_len, BLOCK_N) * BLOCK_N


@triton.jit
def _used_splits(seq_len, num_splits, min_split_tokens, BLOCK_N: tl.constexpr):
    """How many splits a row of `seq_len` keys uses (split 0 always, even when empty)."""
    return tl.maximum(tl.cdiv(seq_len, _split_len(seq_len, num_splits, min_split_tokens, BLOCK_N)), 1)


# Splits a merge iteration reads (a constexpr global: Triton reads only those in kernels). Rows use
# a few; the merge loops over them, so no kernel variant is compiled per split count.
MERGE_TILE = tl.constexpr(8)


@triton.jit
def _merge_head(MidO, MidLse, Out, b, h, used, used_first, second_offset,
                stride_mb, stride_mh, stride_ms, stride_lb, stride_lh, stride_ob, stride_oh,
                HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    """Out[b, h] from a row's `used` partials, weighted by exp2(lse - max lse): the one merge
    of the merge launch, the fused merge (split kernel) and cascade's merge, so all three
    compute identically. The row's i-th used partial is split i for i < `used_first`, else
    split `second_offset + i - used_first` (cascade: suffix splits, then the group's shared
    parts; decode passes used_first = used). MERGE_TILE splits at a time with a running max
    (online softmax): one compiled variant for every split count, and a row reads only the
    splits it used (a tile as wide as cascade's buffer cost ~100 us a layer at 512 rows)."""
    offs_s = tl.arange(0, MERGE_TILE)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    lse_row = MidLse + b * stride_lb + h * stride_lh
    o_row = MidO + b * stride_mb + h * stride_mh
    # Scalars built from tensors: their type stays the same across loop iterations.
    m = tl.max(tl.full([MERGE_TILE], float("-inf"), tl.float32), 0)
    denom = tl.sum(tl.zeros([MERGE_TILE], tl.float32), 0)
    acc = tl.zeros([BLOCK_D], tl.float32)
    for start in range(0, used, MERGE_TILE):
        i = start + offs_s
        valid = i < used
        split = tl.where(i < used_first, i, second_offset + i - used_first)
        lse = tl.load(lse_row + split, mask=valid, other=float("-inf"))
        m_new = tl.maximum(m, tl.max(lse, 0))
        # A zero-length row (CUDA-graph padding) has no keys at all: zeros, not NaN.
        base = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m - base)
        w = tl.exp2(lse - base)
        o = tl.load(o_row + split[:, None] * stride_ms + offs_d[None, :], mask=valid[:, None] & mask_d[None, :],
                    other=0.0)
        acc = acc * alpha + tl.sum(w[:, None] * o, 0)
        denom = denom * alpha + tl.sum(w, 0)
        m = m_new
    out = acc / tl.where(denom > 0, denom, 1.0)
    tl.store(Out + b * stride_ob + h * stride_oh + offs_d, out.to(Out.dtype.element_ty), mask=mask_d)


@triton.jit
def _merge_if_last(Counters, MidO, MidLse, Out, b, first_head, num_group_heads, used, num_splits,
                   stride_mb, stride_mh, stride_ms, stride_lb, stride_lh, stride_ob, stride_oh,
                   HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    """Count this program's arrival on its (request, head group) counter; the last of the
    group's `num_splits` programs (used splits or not: all of them count) merges its heads."""
    counter = Counters + b * tl.num_programs(1) + tl.program_id(1)
    # All of this program's threads stored their partials before the one thread that increments.
    tl.debug_barrier()
    # acq_rel: the partial stores happen-before the increment (release), and the last
    # program's increment happens-before its reads of the other programs' partials (acquire).
    arrived = tl.atomic_add(counter, 1, sem="acq_rel")
    if arrived == num_splits - 1:
        for i in range(num_group_heads):
            _merge_head(MidO, MidLse, Out, b, first_head + i, used, used, 0, stride_mb, stride_mh,
                        stride_ms, stride_lb, stride_lh, stride_ob, stride_oh,
                        HEAD_DIM=HEAD_DIM, BLOCK_D=BLOCK_D)
        # Counters are zero between launches: every program of this launch has arrived, so
        # the next launch (or CUDA-graph replay) of the same stream counts from zero.
        tl.atomic_xchg(counter, 0, sem="relaxed")


@triton.jit
def _store_partials(MidO, MidLse, b, heads, offs_d, mask_h, mask_d, split, acc, m_i, l_i,
                    stride_mb, stride_mh, stride_ms, stride_lb, stride_lh):
    """A split's normalised output and base-2 log-sum-exp, for the heads in `mask_h`."""
    has_keys = l_i > 0  # false only for an empty row (CUDA-graph padding)
    out = acc / tl.where(has_keys, l_i, 1.0)[:, None]
    lse = tl.where(has_keys, m_i + tl.log2(tl.where(has_keys, l_i, 1.0)), float("-inf"))
    tl.store(MidO + b * stride_mb + heads[:, None] * stride_mh + split * stride_ms
             + offs_d[None, :], out, mask=mask_h[:, None] & mask_d[None, :])
    tl.store(MidLse + b * stride_lb + heads * stride_lh + split, lse, mask=mask_h)


# The split count and the log-sum-exp strides (which hold it) vary per eager step: not
# specialized on, so they do not compile a variant each (one kernel for every count).
@triton.jit(do_not_specialize=["stride_lb", "stride_lh", "num_splits"])
def _decode_split_kernel(
    Q, K, V, ReqToToken, ReqSlots, SeqLens, StartLens, MidO, MidLse, Out, Counters,
    stride_qb, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_r2t,
    stride_mb, stride_mh, stride_ms, stride_lb, stride_lh, stride_ob, stride_oh,
    qk_scale, num_splits, min_split_tokens,
    GROUP: tl.constexpr, HEAD_BLOCKS: tl.constexpr, HEAD_DIM: tl.constexpr,
    SPLIT: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, DOT_PRECISION: tl.constexpr, HAS_START: tl.constexpr,
    FUSED_MERGE: tl.constexpr, USE_PDL: tl.constexpr, V_F16_WHERE_LOADED: tl.constexpr,
):
    pdl_prologue(USE_PDL)
    b = tl.program_id(0)
    kv_head = tl.program_id(1) // HEAD_BLOCKS
    first_g = (tl.program_id(1) % HEAD_BLOCKS) * BLOCK_H
    offs_g = first_g + tl.arange(0, BLOCK_H)
    heads = kv_head * GROUP + offs_g
    mask_h = offs_g < GROUP
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    split = tl.program_id(2)

    seq_len = tl.load(SeqLens + b)
    # HAS_START (cascade's suffix part): the row attends keys [StartLens[b], seq_len) only.
    if HAS_START:
        first = tl.load(StartLens + b)
    else:
        first = 0
    split_len = _split_len(seq_len - first, num_splits, min_split_tokens, BLOCK_N)
    start = first + split * split_len
    end = tl.minimum(start + split_len, seq_len)
    slot_row = ReqToToken + tl.load(ReqSlots + b).to(tl.int64) * stride_r2t

    q = dot_operand(tl.load(Q + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                            mask=mask_h[:, None] & mask_d[None, :], other=0.0), K.dtype.element_ty)
    # Every executed iteration has >= 1 valid key, so -inf never meets -inf below.
    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
    for start_n in range(start, end, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        mask_n = offs_n < end
        slots = tl.load(slot_row + offs_n, mask=mask_n, other=0).to(tl.int64)
        k = tl.load(K + slots[None, :] * stride_kt + kv_head * stride_kh + offs_d[:, None],
                    mask=mask_n[None, :] & mask_d[:, None], other=0.0)  # [D, N]
        qk = dot_kv(q, k, None, DOT_PRECISION) * qk_scale
        qk = tl.where(mask_n[None, :], qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(V + slots[:, None] * stride_vt + kv_head * stride_vh + offs_d[None, :],
                    mask=mask_n[:, None] & mask_d[None, :], other=0.0)  # [N, D]
        if V_F16_WHERE_LOADED and V.dtype.element_ty.is_fp8():  # Experiments.fp8_v_f16_where_loaded
            v = f16_where_loaded(v)
        acc = dot_kv(p, v, acc * alpha[:, None], DOT_PRECISION)
        m_i = m_new

    if SPLIT:
        # Splits past this row's last one write nothing; the merge reads only used splits.
        used = (start < seq_len) | (split == 0)
        _store_partials(MidO, MidLse, b, heads, offs_d, offs_g < tl.where(used, GROUP, 0), mask_d, split,
                        acc, m_i, l_i, stride_mb, stride_mh, stride_ms, stride_lb, stride_lh)
        if FUSED_MERGE:  # never with HAS_START: the merge counts splits from key 0
            _merge_if_last(Counters, MidO, MidLse, Out, b, kv_head * GROUP + first_g,
                           tl.minimum(GROUP - first_g, BLOCK_H),
                           _used_splits(seq_len, num_splits, min_split_tokens, BLOCK_N), num_splits,
                           stride_mb, stride_mh, stride_ms, stride_lb, stride_lh, stride_ob, stride_oh,
                           HEAD_DIM=HEAD_DIM, BLOCK_D=BLOCK_D)
    else:
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # l_i 0: an empty row gives zeros
        tl.store(Out + b * stride_ob + heads[:, None] * stride_oh + offs_d[None, :],
                 out.to(Out.dtype.element_ty), mask=mask_h[:, None] & mask_d[None, :])


# Like the split kernel's: the split count and the strides holding it vary per eager step.
@triton.jit(do_not_specialize=["stride_mb", "stride_mh", "stride_lb", "stride_lh", "num_splits"])
def _decode_merge_kernel(
    MidO, MidLse, Out, SeqLens,
    stride_mb, stride_mh, stride_ms, stride_lb, stride_lh, stride_ob, stride_oh, num_splits,
    min_split_tokens,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl_prologue(USE_PDL)
    b = tl.program_id(0)
    seq_len = tl.load(SeqLens + b)
    used = _used_splits(seq_len, num_splits, min_split_tokens, BLOCK_N)
    _merge_head(MidO, MidLse, Out, b, tl.program_id(1), used, used, 0,
                stride_mb, stride_mh, stride_ms, stride_lb, stride_lh, stride_ob, stride_oh,
                HEAD_DIM=HEAD_DIM, BLOCK_D=BLOCK_D)


@functools.lru_cache(maxsize=None)
def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 8  # interpreter: few programs keep the CPU tests fast


def _head_block(group: int) -> tuple[int, int]:
    """(BLOCK_H, head blocks per KV head) for a GQA group size."""
    block_h = min(MAX_BLOCK_H, max(16, next_power_of_2(group)))
    return block_h, cdiv(group, block_h)


def default_block_n(head_dim: int) -> int:
    """Keys per tile: 64, or 32 for head dims above 128 (register pressure)."""
    return 64 if head_dim <= 128 else 32


def decode_num_splits(batch_size: int, num_kv_heads: int, group: int, max_seq_len: int,
                      device: torch.device) -> int:
    """Splits per sequence from host ints only: enough programs for ~2 waves of SMs,
    but no split shorter than MIN_TOKENS_PER_SPLIT."""
    programs = batch_size * num_kv_heads * _head_block(group)[1]
    by_occupancy = cdiv(2 * _num_sms(device), programs)
    by_length = cdiv(max(max_seq_len, 1), MIN_TOKENS_PER_SPLIT)
    return max(1, min(by_occupancy, by_length, MAX_SPLITS))


class SplitCounters:
    """The fused merge's arrival counters: int32, one per (request, kv head x head block)
    program group, one buffer per device, shared by every launch of the owner's forward
    stream (launches on one stream never overlap, so one buffer serves all layers).

    Lifetime rules: a counter is zero between launches (the merging program resets it), so
    the buffer is zeroed once, at allocation. A buffer that grows stays alive (`_retired`):
    CUDA graphs captured with it keep its address. It never grows during a capture: the
    capture's warm-up run, outside it, already sized it for that grid."""

    def __init__(self, min_size: int = 4096):
        self.min_size = min_size  # 16 KiB: 256 requests x 16 head groups without growing
        self._buffers: dict[torch.device, torch.Tensor] = {}
        self._retired: list[torch.Tensor] = []

    def get(self, device: torch.device, size: int) -> torch.Tensor:
        """At least `size` zero counters on `device`."""
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:  # one key per GPU: "cuda" is "cuda:N"
            device = torch.device("cuda", torch.cuda.current_device())
        buf = self._buffers.get(device)
        if buf is not None and buf.numel() >= size:
            return buf
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"SplitCounters: a grid of {size} program groups first seen during "
                               "CUDA-graph capture; run it once before capturing")
        if buf is not None:
            self._retired.append(buf)
        grown = max(size, self.min_size, 2 * buf.numel() if buf is not None else 0)
        self._buffers[device] = torch.zeros(grown, dtype=torch.int32, device=device)
        return self._buffers[device]


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     req_to_token: torch.Tensor, req_slots: torch.Tensor, seq_lens: torch.Tensor,
                     scale: float, max_seq_len: int, out: torch.Tensor | None = None, *,
                     num_splits: int | None = None, block_n: int | None = None,
                     min_split_tokens: int = MIN_ROW_SPLIT_TOKENS,
                     counters: SplitCounters | None = None, v_f16_where_loaded: bool = False) -> torch.Tensor:
    """q [B, H, D] -> [B, H, D]; matches `torch_backend.decode_attention`.

    `num_splits` fixes the grid (e.g. for a CUDA graph captured once and replayed at
    other lengths): the most splits any row uses; rows shorter than
    `num_splits * min_split_tokens` use fewer. Any values are correct for any `seq_lens`.
    `counters`: merge the splits in the split launch (the last program of each row and
    head group merges); None: a separate merge launch. Same arithmetic, same result.
    `v_f16_where_loaded`: over an e4m3 pool, convert V tiles to f16 before they are staged in
    shared memory (`kv_dtype.f16_where_loaded`); same values.
    """
    batch, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    assert num_heads % num_kv_heads == 0, "query heads must be a multiple of KV heads"
    assert q.stride(2) == 1 and k_cache.stride(2) == 1 and v_cache.stride(2) == 1
    if out is None:
        out = torch.empty_like(q)
    assert out.shape == q.shape and out.stride(2) == 1
    if batch == 0:
        return out
    if min_split_tokens < 1:
        raise ValueError(f"min_split_tokens must be >= 1, got {min_split_tokens}")
    if num_splits is None:
        num_splits = decode_num_splits(batch, num_kv_heads, num_heads // num_kv_heads, max_seq_len,
                                       q.device)
    if block_n is None:
        block_n = default_block_n(head_dim)
    if num_splits == 1:  # the split kernel writes `out` directly; no mid buffers
        _launch_split(q, k_cache, v_cache, req_to_token, req_slots, seq_lens, None, out, out, out,
                      scale, num_splits, min_split_tokens, block_n, v_f16_where_loaded=v_f16_where_loaded)
        return out
    mid_o = torch.empty(batch, num_heads, num_splits, head_dim, dtype=torch.float32, device=q.device)
    mid_lse = torch.empty(batch, num_heads, num_splits, dtype=torch.float32, device=q.device)
    groups = batch * num_kv_heads * _head_block(num_heads // num_kv_heads)[1]
    pool = counters.get(q.device, groups) if counters is not None else None
    _launch_split(q, k_cache, v_cache, req_to_token, req_slots, seq_lens, None, mid_o, mid_lse, out,
                  scale, num_splits, min_split_tokens, block_n, counters=pool,
                  v_f16_where_loaded=v_f16_where_loaded)
    if pool is not None:  # the split launch merged
        return out
    _decode_merge_kernel[(batch, num_heads)](
        mid_o, mid_lse, out, seq_lens,
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2), mid_lse.stride(0),
        mid_lse.stride(1), out.stride(0), out.stride(1), num_splits, min_split_tokens,
        HEAD_DIM=head_dim, BLOCK_D=next_power_of_2(head_dim),
        BLOCK_N=block_n, num_warps=4, **pdl_options(q.device),
    )
    return out


def decode_suffix_partials(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           req_to_token: torch.Tensor, req_slots: torch.Tensor, seq_lens: torch.Tensor,
                           start_lens: torch.Tensor, scale: float, mid_o: torch.Tensor,
                           mid_lse: torch.Tensor, num_splits: int, min_split_tokens: int,
                           block_n: int) -> None:
    """Cascade attention's per-row part: row b attends keys [start_lens[b], seq_lens[b]) and
    writes its normalised partial outputs and base-2 log-sum-exps into splits
    [0, num_splits) of `mid_o` [B, H, S, D] / `mid_lse` [B, H, S] (S >= num_splits).
    Splits a row does not use are left unwritten (`cascade_merge` reads only used ones)."""
    _launch_split(q, k_cache, v_cache, req_to_token, req_slots, seq_lens, start_lens, mid_o, mid_lse,
                  mid_o, scale, num_splits, min_split_tokens, block_n, force_split=True)


def _launch_split(q, k_cache, v_cache, req_to_token, req_slots, seq_lens, start_lens, mid_o, mid_lse,
                  out, scale: float, num_splits: int, min_split_tokens: int, block_n: int,
                  force_split: bool = False, counters: torch.Tensor | None = None,
                  v_f16_where_loaded: bool = False) -> None:
    """The split kernel. `start_lens` None: each row from key 0. `counters` (zeros, one per
    request x head group): its last program per group merges into `out` (no merge launch)."""
    batch, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    group = num_heads // num_kv_heads
    block_h, head_blocks = _head_block(group)
    split = force_split or num_splits > 1
    fused = counters is not None
    assert not (fused and start_lens is not None), "the fused merge counts a row's splits from key 0"
    precision = "ieee" if k_cache.dtype == torch.float32 else "tf32"
    _decode_split_kernel[(batch, num_kv_heads * head_blocks, num_splits)](
        q, k_cache, v_cache, req_to_token, req_slots, seq_lens,
        start_lens if start_lens is not None else seq_lens, mid_o, mid_lse, out,
        counters if fused else seq_lens,  # unread unless fused
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1),
        v_cache.stride(0), v_cache.stride(1), req_to_token.stride(0),
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2) if split else 0,
        mid_lse.stride(0), mid_lse.stride(1), out.stride(0), out.stride(1),
        scale * LOG2E, num_splits, min_split_tokens,
        GROUP=group, HEAD_BLOCKS=head_blocks, HEAD_DIM=head_dim, SPLIT=split,
        BLOCK_H=block_h, BLOCK_N=block_n, BLOCK_D=next_power_of_2(head_dim),
        DOT_PRECISION=precision, HAS_START=start_lens is not None, FUSED_MERGE=fused,
        num_warps=4, num_stages=2, V_F16_WHERE_LOADED=v_f16_where_loaded,
        **pdl_options(q.device),
    )
