"""Triton kernels vs the torch reference (`tandem.attention.torch_backend`).

Without CUDA the kernels run in Triton's interpreter on the CPU (float32/float16
only: the interpreter's bfloat16 `tl.dot` is wrong); with CUDA they run compiled,
bfloat16 included. References are computed in float32 from the same (rounded) inputs.
"""
import pytest
import torch

from kernel_setup import DEVICE, DTYPES, HAS_CUDA  # first: it sets up Triton's interpreter

triton = pytest.importorskip("triton")

from tandem.attention import torch_backend as ref  # noqa: E402
from tandem.attention.triton_backend import TritonAttention  # noqa: E402
from tandem.forward_batch import ForwardBatch  # noqa: E402
from tandem.kernels import decode_attention, decode_num_splits, extend_attention, write_kv  # noqa: E402
from tandem.kernels.decode_attention import SplitCounters  # noqa: E402
from tandem.memory.kv_cache import to_cache_dtype  # noqa: E402

TOL = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 2e-2}
FP8 = torch.float8_e4m3fn  # kv_cache_dtype="fp8"
# (query heads, kv heads, head_dim): GQA ratios 1, 3, 8, a single KV head, a group
# wider than one head block (80 > 64), and head dims that are not 64 or 128.
HEADS = [(4, 4, 64), (6, 2, 128), (16, 2, 64), (8, 1, 128), (80, 1, 64), (3, 1, 96),
         (4, 2, 256)]
# Extend maps heads to KV heads the same way; ratio 8 is covered by the single-KV-head case.
EXTEND_HEADS = [h for h in HEADS if h not in ((16, 2, 64), (80, 1, 64))]


def _paged(seq_lens: list[int], num_kv_heads: int, head_dim: int, dtype: torch.dtype,
           seed: int = 0):
    """Random caches with each request's tokens scattered over shuffled slots.

    Returns k_cache, v_cache, req_to_token, req_slots (rows deliberately not 0..B-1).
    """
    g = torch.Generator().manual_seed(seed)
    num_slots = sum(seq_lens) + 8
    k_cache = torch.randn(num_slots, num_kv_heads, head_dim, generator=g).to(dtype)
    v_cache = torch.randn(num_slots, num_kv_heads, head_dim, generator=g).to(dtype)
    free = (torch.randperm(num_slots - 1, generator=g) + 1).int()  # slot 0 is the dummy
    req_slots = torch.arange(len(seq_lens)) * 2 + 1
    req_to_token = torch.zeros(2 * len(seq_lens) + 1, max(seq_lens) + 5, dtype=torch.int32)
    start = 0
    for row, n in zip(req_slots.tolist(), seq_lens):
        req_to_token[row, :n] = free[start:start + n]
        start += n
    to = lambda t: t.to(DEVICE)  # noqa: E731
    return to(k_cache), to(v_cache), to(req_to_token), to(req_slots)


def _close(out: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, cache_dtype: torch.dtype | None = None) -> None:
    """Within the tolerance of the dots' inputs: q's dtype, at least float16's over an e4m3 pool
    (its dots take q and p in float16: kernels.kv_dtype)."""
    tol = max(TOL[dtype], TOL[torch.float16]) if cache_dtype == FP8 else TOL[dtype]
    torch.testing.assert_close(out.float(), expected, atol=tol, rtol=tol)


def _decode_case(heads, dtype, seq_lens, cache_dtype=None, **kwargs):
    """decode_attention against the reference over the same cache (of `cache_dtype`, default q's)."""
    num_heads, num_kv_heads, head_dim = heads
    k_cache, v_cache, r2t, req_slots = _paged(seq_lens, num_kv_heads, head_dim, cache_dtype or dtype)
    q = torch.randn(len(seq_lens), num_heads, head_dim, device=DEVICE).to(dtype)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    scale = head_dim ** -0.5
    out = decode_attention(q, k_cache, v_cache, r2t, req_slots, lens, scale, max(seq_lens),
                           **kwargs)
    expected = ref.decode_attention(q.float(), k_cache.float(), v_cache.float(), r2t, req_slots,
                                    lens, scale, max(seq_lens))
    _close(out, expected, dtype, cache_dtype)
    return out


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", HEADS, ids=lambda h: "h{}kv{}d{}".format(*h))
def test_decode_matches_reference(heads, dtype):
    # Lengths include 1 and non-multiples of the key block; small block so several run.
    _decode_case(heads, dtype, [1, 17, 100, 45], block_n=16)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_splits", [2, 5, 12])
@pytest.mark.parametrize("min_split", [1, 100])
def test_decode_splits(num_splits, min_split, dtype):
    # 12 splits over a 3-token sequence leaves most splits empty; the merge must skip them.
    # With a minimum split length each row uses only the splits it needs (700 tokens: 7 at
    # most, rounded to key blocks) and the rest of the grid writes nothing.
    _decode_case((8, 2, 64), dtype, [700, 1, 3], num_splits=num_splits, block_n=32,
                 min_split_tokens=min_split)


def test_decode_auto_splits_long_context():
    seq_lens = [1500, 2]
    num_splits = decode_num_splits(2, 1, 4, max(seq_lens), torch.device(DEVICE))
    assert num_splits > 1  # the case must exercise the split-and-merge path
    _decode_case((4, 1, 64), torch.float16, seq_lens)


def test_decode_out_buffer_and_strided_q():
    # q sliced out of a fused qkv projection: strided rows, written into a caller's buffer.
    seq_lens = [5, 40]
    k_cache, v_cache, r2t, req_slots = _paged(seq_lens, 2, 64, torch.float16)
    qkv = torch.randn(2, 8, 64, device=DEVICE).half()
    q = qkv[:, :4]
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    out = torch.empty(2, 4, 64, device=DEVICE, dtype=torch.float16)
    for splits in (1, 3):
        result = decode_attention(q, k_cache, v_cache, r2t, req_slots, lens, 0.125, 40,
                                  out=out, num_splits=splits)
        assert result is out
        expected = ref.decode_attention(q.float(), k_cache.float(), v_cache.float(), r2t,
                                        req_slots, lens, 0.125, 40)
        _close(out, expected, torch.float16)


def test_decode_zero_length_row_gives_zeros():
    # CUDA-graph padding rows may carry seq_len 0; they must not produce NaN.
    k_cache, v_cache, r2t, req_slots = _paged([4, 9], 1, 64, torch.float32)
    lens = torch.tensor([0, 9], dtype=torch.int32, device=DEVICE)
    q = torch.randn(2, 2, 64, device=DEVICE)
    for splits in (1, 4):
        out = decode_attention(q, k_cache, v_cache, r2t, req_slots, lens, 0.125, 9,
                               num_splits=splits)
        assert torch.equal(out[0], torch.zeros_like(out[0]))
        assert torch.isfinite(out[1]).all()


# Fused merge (the last split program of each row and head group merges) against the merge
# launch: batches 1, 3, 9; GQA groups 1, 2, 8 (one KV head); 2, 5, 32 splits; contexts around the
# 64-key block; padding rows (0). min_split 1 spreads rows over every split, 64 over a few.
NINE_ROWS = [1, 63, 64, 65, 700, 0, 17, 130, 300]
FUSED_CASES = [  # (heads, seq_lens, num_splits, min_split, dtype)
    ((2, 2, 64), [700], 2, 1, torch.float32),
    ((4, 2, 64), [700], 32, 1, torch.float32),
    ((8, 1, 64), [65], 5, 1, torch.float16),
    ((2, 2, 64), [0, 63, 65], 5, 1, torch.float32),
    ((4, 2, 64), [0, 64, 700], 32, 1, torch.float16),
    ((8, 1, 64), [1, 63, 0], 2, 1, torch.float32),
    ((2, 2, 64), NINE_ROWS, 32, 64, torch.float32),
    ((4, 2, 64), NINE_ROWS, 5, 64, torch.float32),
    ((8, 1, 64), NINE_ROWS, 2, 1, torch.float32),
]


def _fused_vs_merge_launch(heads, seq_lens, num_splits, min_split, dtype, counters: SplitCounters, seed=0):
    """Decode twice with `counters` (the second call counts from the zeros the first left)
    into NaN-filled outputs: each must equal the merge launch's exactly and leave the
    counters zero. Returns the output."""
    num_heads, num_kv_heads, head_dim = heads
    k_cache, v_cache, r2t, req_slots = _paged(seq_lens, num_kv_heads, head_dim, dtype, seed)
    q = torch.randn(len(seq_lens), num_heads, head_dim, device=DEVICE).to(dtype)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    args = (q, k_cache, v_cache, r2t, req_slots, lens, head_dim ** -0.5, max(seq_lens))
    kwargs = dict(num_splits=num_splits, min_split_tokens=min_split)
    launched = decode_attention(*args, **kwargs)
    for _ in range(2):
        out = decode_attention(*args, out=torch.full_like(q, float("nan")), counters=counters, **kwargs)
        assert torch.equal(out, launched)  # NaN left anywhere: a group was never merged
        assert not counters.get(q.device, 1).any(), "a counter was left non-zero"
    expected = ref.decode_attention(q.float(), k_cache.float(), v_cache.float(), r2t, req_slots, lens,
                                    head_dim ** -0.5, max(seq_lens))
    _close(out, expected, dtype)
    for row in (i for i, n in enumerate(seq_lens) if n == 0):  # padding rows: zeros, not NaN
        assert torch.equal(out[row], torch.zeros_like(out[row]))
    return out


@pytest.mark.parametrize("heads,seq_lens,num_splits,min_split,dtype", FUSED_CASES,
                         ids=lambda v: "x".join(map(str, v)) if isinstance(v, (list, tuple)) else str(v))
def test_decode_fused_merge_equals_merge_launch(heads, seq_lens, num_splits, min_split, dtype):
    _fused_vs_merge_launch(heads, seq_lens, num_splits, min_split, dtype, SplitCounters())


def test_decode_fused_merge_counters_grow_and_stay_zero():
    # One pool for grids of 1, 3 and 9 rows (4 counters to start: it grows twice), and back:
    # the smaller grid reuses the grown buffer, whose counters the larger launches left at zero.
    counters = SplitCounters(min_size=4)
    for seq_lens in ([700], [0, 63, 65], NINE_ROWS, [64, 1]):
        _fused_vs_merge_launch((4, 2, 64), seq_lens, 5, 1, torch.float32, counters)
    assert counters.get(torch.device(DEVICE), 1).numel() >= 9 * 2


def test_decode_fused_merge_needs_counters_reset():
    # A counter left at 1 (as if a merge had not reset it) shifts who counts last: its group
    # is then merged before all of its splits arrived (on the GPU that may still read right by
    # luck), and the count stays off by one after the launch (always). The reset prevents both.
    counters = SplitCounters()
    counters.get(torch.device(DEVICE), 8)[0] = 1
    with pytest.raises(AssertionError):
        _fused_vs_merge_launch((4, 2, 64), [700], 5, 1, torch.float32, counters)


def test_decode_fused_merge_single_split_is_direct():
    # One split: the split kernel writes the output itself and never reads the counters, so
    # even a poisoned pool (a counter left at 1) gives the right output.
    counters = SplitCounters()
    counters.get(torch.device(DEVICE), 8)[0] = 1
    q = torch.randn(3, 4, 64, device=DEVICE)
    k_cache, v_cache, r2t, req_slots = _paged([0, 40, 3], 2, 64, torch.float32)
    lens = torch.tensor([0, 40, 3], dtype=torch.int32, device=DEVICE)
    args = (q, k_cache, v_cache, r2t, req_slots, lens, 0.125, 40)
    out = decode_attention(*args, num_splits=1, counters=counters)
    assert torch.equal(out, decode_attention(*args, num_splits=1))
    assert torch.equal(out[0], torch.zeros_like(out[0]))


def _as_int32(xs: list[int]) -> torch.Tensor:
    return torch.tensor(xs, dtype=torch.int32, device=DEVICE)


def _extend_inputs(heads, dtype, prefix_lens, extend_lens, cache_dtype=None) -> tuple:
    """extend_attention's positional arguments for random paged caches (of `cache_dtype`,
    default q's) and queries."""
    num_heads, num_kv_heads, head_dim = heads
    seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens)]
    k_cache, v_cache, r2t, req_slots = _paged(seq_lens, num_kv_heads, head_dim, cache_dtype or dtype)
    q = torch.randn(sum(extend_lens), num_heads, head_dim, device=DEVICE).to(dtype)
    qo_indptr = _as_int32([0] + torch.tensor(extend_lens).cumsum(0).tolist())
    return (q, k_cache, v_cache, r2t, req_slots, _as_int32(seq_lens), _as_int32(prefix_lens), qo_indptr,
            head_dim ** -0.5, max(extend_lens))


def _extend_case(heads, dtype, prefix_lens, extend_lens, cache_dtype=None, **kwargs):
    args = _extend_inputs(heads, dtype, prefix_lens, extend_lens, cache_dtype)
    q, k_cache, v_cache, r2t, req_slots, seq_lens = args[:6]
    out = extend_attention(*args, **kwargs)
    expected = ref.extend_attention(q.float(), k_cache.float(), v_cache.float(), r2t,
                                    req_slots.tolist(), seq_lens.tolist(), extend_lens, args[8])
    _close(out, expected, dtype, cache_dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", EXTEND_HEADS, ids=lambda h: "h{}kv{}d{}".format(*h))
def test_extend_matches_reference(heads, dtype):
    # Fresh prefill, single-token extends with and without prefix, a chunk whose prefix
    # is not block-aligned, and lengths spanning several 16-row query blocks.
    _extend_case(heads, dtype, prefix_lens=[0, 0, 45, 13], extend_lens=[1, 37, 1, 20],
                 block_m=16, block_n=32)


@pytest.mark.parametrize("dtype", DTYPES)
def test_extend_default_blocks(dtype):
    _extend_case((4, 2, 128), dtype, prefix_lens=[70, 0], extend_lens=[40, 130])


def _block_table(extend_lens: list[int], block: int, entries: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, query block) of every block of every row, then unused entries past every row's end."""
    rows = [i for i, n in enumerate(extend_lens) for _ in range(-(-n // block))]
    index = [j for n in extend_lens for j in range(-(-n // block))]
    unused = entries - len(rows)
    as_int64 = lambda xs: torch.tensor(xs, dtype=torch.int64, device=DEVICE)  # noqa: E731
    return as_int64(rows + [0] * unused), as_int64(index + [max(extend_lens) // block + 1] * unused)


@pytest.mark.parametrize("dtype", DTYPES)
def test_extend_block_table_matches_dense_grid(dtype):
    """A host-planned block table (a graphed prefill step's grid, with unused entries) gives the
    dense grid's output; a row of length 0 holding tokens (the graph's padding row) writes zeros."""
    prefix_lens, extend_lens = [0, 45, 0, 13], [20, 1, 5, 37]
    args = _extend_inputs((6, 2, 64), dtype, prefix_lens, extend_lens)
    seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens)]
    dense = extend_attention(*args, block_m=16, block_n=32)
    table = extend_attention(*args, block_m=16, block_n=32, blocks=_block_table(extend_lens, 16, 12))
    assert torch.equal(dense, table)
    # The last row as padding: length 0, prefix 0, 3 query blocks; its tokens' outputs are
    # zeros (no key read: its table row may be shorter than its token count).
    seq_lens[-1] = prefix_lens[-1] = 0
    args = args[:5] + (_as_int32(seq_lens), _as_int32(prefix_lens)) + args[7:]
    padded = extend_attention(*args, block_m=16, block_n=32, blocks=_block_table(extend_lens, 16, 12))
    assert torch.equal(padded[:-37], dense[:-37]) and not padded[-37:].any()


@pytest.mark.parametrize("dtype", DTYPES)
def test_write_kv_matches_reference(dtype):
    num_slots, kvh, d, t = 32, 3, 96, 7
    k_cache = torch.randn(num_slots, kvh, d, device=DEVICE).to(dtype)
    v_cache = torch.randn(num_slots, kvh, d, device=DEVICE).to(dtype)
    # Float32 source sliced from a fused projection: strided, and cast on write.
    qkv = torch.randn(t, 4 + 2 * kvh, d, device=DEVICE)
    k, v = qkv[:, 4:4 + kvh], qkv[:, 4 + kvh:]
    loc = torch.tensor([3, 0, 31, 8, 9, 1, 20], device=DEVICE)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    ref.write_kv(k_ref, v_ref, loc, k, v)
    write_kv(k_cache, v_cache, loc, k, v)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)


# ---- an e4m3 pool (kv_cache_dtype="fp8"): saturating stores, f16 dots over upcast tiles ----

def _e4m3_grid_kv(t: int, kvh: int, d: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 k, v whose values e4m3 holds exactly, except a few beyond +-448 (saturated).
    On the grid because Triton 3.9's interpreter rounds float -> e4m3 wrongly (1.99 -> 1.0: its
    carry into the exponent is lost), which the hardware's conversion does not: the interpreter
    checks the clamp and the cast, a GPU run (below) the rounding of arbitrary values."""
    g = torch.Generator().manual_seed(seed)
    k, v = ((torch.randn(t, kvh, d, generator=g) * 40).to(FP8).float() for _ in range(2))
    k[0, 0, :4] = torch.tensor([449.0, -1000.0, 1e6, -464.0])
    v[-1, -1, -3:] = torch.tensor([-449.0, 3e4, 448.0])
    return k.to(DEVICE), v.to(DEVICE)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.cpu().view(torch.uint8)  # torch.equal has no float8 kernel on the CPU


@pytest.mark.parametrize("kernel", ["write_kv", "reference"])
def test_fp8_store_saturates_at_448(kernel):
    """Values beyond e4m3's range are stored as +-448 (an unclamped cast gives NaN: e4m3fn has
    no inf), the others exactly; the kernel's bytes are the reference's."""
    num_slots, kvh, d = 16, 2, 64
    k, v = _e4m3_grid_kv(5, kvh, d, seed=1)
    loc = torch.tensor([3, 0, 15, 8, 9], device=DEVICE)
    caches = [torch.zeros(num_slots, kvh, d, dtype=FP8, device=DEVICE) for _ in range(2)]
    expected = [c.clone() for c in caches]
    (write_kv if kernel == "write_kv" else ref.write_kv)(*caches, loc, k, v)
    for cache, src in zip(caches, (k, v)):
        stored = cache.float()[loc]
        assert not stored.isnan().any()
        torch.testing.assert_close(stored, src.clamp(-448, 448), atol=0, rtol=0)
    assert _bytes(caches[0])[3, 0, :4].tolist() == _bytes(torch.tensor([448.0, -448, 448, -448]).to(FP8)).tolist()
    ref.write_kv(*expected, loc, k, v)
    for got, want in zip(caches, expected):
        assert torch.equal(_bytes(got), _bytes(want))


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA (the interpreter's e4m3 rounding is wrong)")
@pytest.mark.parametrize("src_dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_fp8_store_rounds_as_torch_on_cuda(src_dtype):
    """Arbitrary values, out-of-range ones among them: the compiled store's bytes are torch's."""
    kvh, d, t = 8, 128, 64
    g = torch.Generator().manual_seed(7)
    k, v = ((torch.randn(t, kvh, d, generator=g) * 100).to(DEVICE, src_dtype) for _ in range(2))
    loc = torch.randperm(t, device=DEVICE) + 1
    caches = [torch.zeros(t + 1, kvh, d, dtype=FP8, device=DEVICE) for _ in range(4)]
    write_kv(caches[0], caches[1], loc, k, v)
    ref.write_kv(caches[2], caches[3], loc, k, v)
    assert torch.equal(_bytes(caches[0]), _bytes(caches[2])) and torch.equal(_bytes(caches[1]), _bytes(caches[3]))
    assert not caches[0].float().isnan().any() and caches[0].float().abs().max() == 448


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", [(6, 2, 128), (8, 1, 128), (3, 1, 96)], ids=lambda h: "h{}kv{}d{}".format(*h))
def test_decode_over_an_fp8_pool(heads, dtype):
    """The values an e4m3 pool holds, read upcast: the reference's output over the same values,
    one split or several (the merge is the pool type's business no more than the dots are)."""
    _decode_case(heads, dtype, [1, 17, 100, 45], cache_dtype=FP8, block_n=16)
    _decode_case(heads, dtype, [300, 2, 64], cache_dtype=FP8, num_splits=5, block_n=32)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", [(6, 2, 128), (16, 8, 128), (4, 2, 64)], ids=lambda h: "h{}kv{}d{}".format(*h))
def test_decode_over_an_fp8_pool_with_v_converted_where_loaded(heads, dtype):
    """Experiments.fp8_v_f16_where_loaded: the V tiles' f16 conversion in inline PTX (compiled;
    the interpreter runs `.to`) gives the reference's output, and the default path's within a
    rounding of the f32 accumulation (the same f16 values, perhaps in another MMA order). Head
    dim 64 with 16-key tiles: 8 values a thread, fewer than one asm call's 16."""
    _decode_case(heads, dtype, [1, 17, 100, 45], cache_dtype=FP8, block_n=16, v_f16_where_loaded=True)
    _decode_case(heads, dtype, [300, 2, 64], cache_dtype=FP8, num_splits=5, block_n=64, v_f16_where_loaded=True)
    q_heads, kv_heads, d = heads
    k_cache, v_cache, r2t, req_slots = _paged([300, 2, 64], kv_heads, d, torch.float32, seed=3)
    k_cache, v_cache = to_cache_dtype(k_cache, FP8), to_cache_dtype(v_cache, FP8)
    q = torch.randn(3, q_heads, d, generator=torch.Generator().manual_seed(4)).to(dtype).to(DEVICE)
    lens = torch.tensor([300, 2, 64], dtype=torch.int32, device=DEVICE)
    outs = [decode_attention(q, k_cache, v_cache, r2t, req_slots, lens, d ** -0.5, 300, num_splits=5,
                             v_f16_where_loaded=flag) for flag in (False, True)]
    torch.testing.assert_close(outs[1].float(), outs[0].float(), atol=1e-3, rtol=1e-3)


def test_the_v_conversion_experiment_reaches_the_triton_backend():
    from tandem.attention import make_attention_backend
    from tandem.config import Experiments
    for flag in (False, True):
        backend = make_attention_backend("triton", torch.device(DEVICE), Experiments(fp8_v_f16_where_loaded=flag))
        assert backend.fp8_v_f16_where_loaded is flag


@pytest.mark.parametrize("dtype", DTYPES)
def test_extend_over_an_fp8_pool(dtype):
    _extend_case((6, 2, 64), dtype, prefix_lens=[0, 0, 45, 13], extend_lens=[1, 37, 1, 20],
                 cache_dtype=FP8, block_m=16, block_n=32)


def _within_e4m3(out: torch.Tensor, expected: torch.Tensor) -> None:
    """What e4m3 costs an attention output over unit-variance K/V: 3 mantissa bits, a rounding
    of up to 1/16 of each value (measured here, 3 seeds: mean 0.009, worst 0.13)."""
    err = (out.float() - expected.float()).abs()
    assert err.max() < 0.25 and err.mean() < 0.02, (err.max(), err.mean())


@pytest.mark.parametrize("dtype", [pytest.param(torch.float16, marks=[pytest.mark.gpu] if HAS_CUDA else []),
                                   pytest.param(torch.bfloat16, marks=[pytest.mark.gpu] if HAS_CUDA else [
                                       pytest.mark.skip(reason="bfloat16 needs CUDA")])])
def test_fp8_pool_attention_is_close_to_the_model_dtype_pool(dtype):
    """The same K/V stored in the model's dtype and in e4m3 (the engine's two pools): decode and
    extend outputs within e4m3's precision of each other."""
    seq_lens, prefix_lens, extend_lens = [70, 33, 5], [50, 0, 4], [20, 33, 1]
    pools = _paged(seq_lens, 2, 64, torch.float32, seed=3)
    model_pools = [c.to(dtype) for c in pools[:2]]
    fp8_pools = [to_cache_dtype(c, FP8) for c in pools[:2]]
    r2t, req_slots = pools[2:]
    lens = _as_int32(seq_lens)
    q = torch.randn(3, 6, 64, device=DEVICE).to(dtype)
    outs = [decode_attention(q, *p, r2t, req_slots, lens, 0.125, 70, num_splits=2) for p in (model_pools, fp8_pools)]
    _within_e4m3(outs[1], outs[0])
    assert not torch.equal(outs[1], outs[0])  # the pools do differ
    qx = torch.randn(sum(extend_lens), 6, 64, device=DEVICE).to(dtype)
    indptr = _as_int32([0] + torch.tensor(extend_lens).cumsum(0).tolist())
    outs = [extend_attention(qx, *p, r2t, req_slots, lens, _as_int32(prefix_lens), indptr, 0.125, 33,
                             block_m=16, block_n=32) for p in (model_pools, fp8_pools)]
    _within_e4m3(outs[1], outs[0])


def _batch(prefix_lens, extend_lens, r2t, req_slots) -> ForwardBatch:
    seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens)]
    as_int32 = lambda xs: torch.tensor(xs, dtype=torch.int32, device=DEVICE)  # noqa: E731
    loc = torch.cat([r2t[s, p:p + e].long() for s, p, e in
                     zip(req_slots.tolist(), prefix_lens, extend_lens)])
    positions = torch.cat([torch.arange(p, p + e) for p, e in zip(prefix_lens, extend_lens)])
    return ForwardBatch(
        input_ids=torch.zeros(sum(extend_lens), dtype=torch.long, device=DEVICE),
        positions=positions.to(DEVICE), out_cache_loc=loc, req_slots=req_slots,
        seq_lens=as_int32(seq_lens), prefix_lens=as_int32(prefix_lens),
        qo_indptr=as_int32([0] + torch.tensor(extend_lens).cumsum(0).tolist()),
        req_to_token=r2t, host_req_slots=req_slots.tolist(), host_seq_lens=seq_lens,
        host_extend_lens=list(extend_lens), is_decode=all(e == 1 for e in extend_lens),
        max_seq_len=max(seq_lens))


@pytest.mark.parametrize("prefix_lens,extend_lens", [([0, 12], [20, 3]), ([30, 0, 7], [1, 1, 1])],
                         ids=["extend", "decode"])
def test_backend_matches_torch_backend(prefix_lens, extend_lens):
    heads, kvh, d = 6, 2, 64
    seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens)]
    k_cache, v_cache, r2t, req_slots = _paged(seq_lens, kvh, d, torch.float32)
    batch = _batch(prefix_lens, extend_lens, r2t, req_slots)
    t = sum(extend_lens)
    q = torch.randn(t, heads, d, device=DEVICE)
    k, v = torch.randn(t, kvh, d, device=DEVICE), torch.randn(t, kvh, d, device=DEVICE)
    caches = (k_cache.clone(), v_cache.clone())
    out = TritonAttention().forward(q, k, v, k_cache, v_cache, batch, d ** -0.5)
    expected = ref.TorchAttention().forward(q, k, v, *caches, batch, d ** -0.5)
    assert torch.equal(k_cache, caches[0]) and torch.equal(v_cache, caches[1])
    _close(out, expected, torch.float32)


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_verify_layouts_give_the_same_attention(backend):
    """A verify step's queries (k + 1 a row after its cache) as one decode row per query and
    in the fixed extend layout (lengths on the device only) attend alike: rows of different
    contexts, a padding row (slot 0, first position 0) and a row at the table's end, whose
    queries past it are dead (lengths clamped to the width; only its live queries compared)."""
    from tandem.forward_batch import fixed_extend_batch, query_rows_batch
    queries, heads, kvh, d = 5, 6, 2, 64
    width = 48
    prefixes = [30, 7, width - 2]  # the last row: queries 0 and 1 live, 2..4 past the table
    k_cache, v_cache, r2t, slots = _paged([min(p + queries, width) for p in prefixes], kvh, d, torch.float32)
    r2t = r2t[:, :width].contiguous()  # the table's width: the engine's max_model_len
    slots = torch.cat([slots, torch.zeros(1, dtype=slots.dtype, device=DEVICE)])  # + a padding row
    prefixes.append(0)
    b, t = len(prefixes), len(prefixes) * queries
    positions = (torch.tensor(prefixes)[:, None] + torch.arange(queries)).flatten().to(DEVICE)
    live = positions < width
    rows = torch.arange(b, device=DEVICE).repeat_interleave(queries)
    locs = torch.where(live, r2t[slots[rows], positions.clamp(max=width - 1)].long(), 0)
    q = torch.randn(t, heads, d, device=DEVICE)
    k, v = torch.randn(t, kvh, d, device=DEVICE), torch.randn(t, kvh, d, device=DEVICE)
    ids = torch.zeros(t, dtype=torch.long, device=DEVICE)
    attn = TritonAttention() if backend == "triton" else ref.TorchAttention()
    outs = []
    for fb in (query_rows_batch(ids, positions, locs, slots[rows], r2t, width),
               fixed_extend_batch(ids, positions, locs, slots, queries, r2t, width)):
        caches = (k_cache.clone(), v_cache.clone())
        outs.append(attn.forward(q, k, v, *caches, fb, d ** -0.5))
    assert outs[1].isfinite().all()
    _close(outs[1][live], outs[0][live].float(), torch.float32)


@pytest.mark.parametrize("fused", [True, False], ids=["fused_merge", "merge_launch"])
def test_backend_fused_decode_merge(fused):
    # Rows long enough for split-K (3 splits at this batch): the backend's counters, or none.
    prefix_lens, extend_lens, heads, kvh, d = [699, 0, 300], [1, 1, 1], 6, 2, 64
    k_cache, v_cache, r2t, req_slots = _paged([p + e for p, e in zip(prefix_lens, extend_lens)], kvh, d,
                                              torch.float32)
    batch = _batch(prefix_lens, extend_lens, r2t, req_slots)
    assert decode_num_splits(3, kvh, heads // kvh, batch.max_seq_len, torch.device(DEVICE)) > 1
    q = torch.randn(3, heads, d, device=DEVICE)
    k, v = torch.randn(3, kvh, d, device=DEVICE), torch.randn(3, kvh, d, device=DEVICE)
    expected = ref.TorchAttention().forward(q, k, v, k_cache.clone(), v_cache.clone(), batch, d ** -0.5)
    attn = TritonAttention(fused_decode_merge=fused)
    assert (attn.split_counters is not None) == fused
    out = attn.forward(q, k, v, k_cache, v_cache, batch, d ** -0.5)
    _close(out, expected, torch.float32)
    if fused:
        assert not attn.split_counters.get(q.device, 1).any()


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_backend_kv_written_leaves_the_cache_alone(backend):
    """With kv_written=True the caller has stored k/v (the fused RoPE launch): the backend
    neither writes again nor reads k/v. Poisoned k/v give the right decode output from a
    cache that already holds the right values, and the cache is left as it was."""
    prefix_lens, extend_lens, heads, kvh, d = [30, 0, 7], [1, 1, 1], 6, 2, 64
    k_cache, v_cache, r2t, req_slots = _paged([p + e for p, e in zip(prefix_lens, extend_lens)], kvh, d,
                                              torch.float32)
    batch = _batch(prefix_lens, extend_lens, r2t, req_slots)
    q = torch.randn(3, heads, d, device=DEVICE)
    k, v = torch.randn(3, kvh, d, device=DEVICE), torch.randn(3, kvh, d, device=DEVICE)
    expected = ref.TorchAttention().forward(q, k, v, k_cache, v_cache, batch, d ** -0.5)  # writes k, v
    written = (k_cache.clone(), v_cache.clone())
    attn = TritonAttention() if backend == "triton" else ref.TorchAttention()
    poison = torch.full_like(k, float("nan"))
    out = attn.forward(q, poison, poison, k_cache, v_cache, batch, d ** -0.5, kv_written=True)
    assert torch.equal(k_cache, written[0]) and torch.equal(v_cache, written[1])
    _close(out, expected, torch.float32)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_decode_cuda_graph_replay_follows_device_inputs():
    # Captured once with a fixed split count, then replayed after the lengths and the
    # slot table change in place: the kernel must read them on the device each time.
    seq_lens = [300, 5, 64]
    k_cache, v_cache, r2t, req_slots = _paged(seq_lens, 2, 128, torch.bfloat16)
    q = torch.randn(3, 8, 128, device=DEVICE).bfloat16()
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    out = torch.empty_like(q)
    run = lambda: decode_attention(q, k_cache, v_cache, r2t, req_slots, lens, 0.1, 300,  # noqa: E731
                                   out=out, num_splits=4)
    run()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    lens.copy_(torch.tensor([7, 299, 1], dtype=torch.int32))
    r2t[req_slots[0], :7] = r2t[req_slots[1], :7].clone()
    graph.replay()
    expected = ref.decode_attention(q.float(), k_cache.float(), v_cache.float(), r2t, req_slots,
                                    lens, 0.1, 300)
    _close(out, expected, torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("prefix_lens,extend_lens", [([0, 12], [20, 3]), ([30, 7], [1, 1])],
                         ids=["extend", "decode"])
def test_backend_never_syncs(prefix_lens, extend_lens):
    seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens)]
    k_cache, v_cache, r2t, req_slots = _paged(seq_lens, 2, 64, torch.float16)
    batch = _batch(prefix_lens, extend_lens, r2t, req_slots)
    t = sum(extend_lens)
    q = torch.randn(t, 6, 64, device=DEVICE).half()
    k, v = torch.randn(t, 2, 64, device=DEVICE).half(), torch.randn(t, 2, 64, device=DEVICE).half()
    backend = TritonAttention(fused_decode_merge=True)  # its counter pool's host code too
    backend.forward(q, k, v, k_cache, v_cache, batch, 0.125)  # compile first
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        backend.forward(q, k, v, k_cache, v_cache, batch, 0.125)
    finally:
        torch.cuda.set_sync_debug_mode("default")


# ---- prompt lookup in one launch ------------------------------------------------------------
@pytest.mark.parametrize("seed", [pytest.param(s, marks=[pytest.mark.gpu] if HAS_CUDA else []) for s in range(4)])
def test_ngram_match_kernel_is_the_proposer_rule(seed):
    """The fused n-gram search equals the rule (propose_ngram_reference) over each row's last
    `window` tokens: rows read by slot from a wider history, garbage past each length, rows
    shorter than the window and longer, padding rows of length 0."""
    import random

    from tandem.kernels.ngram_match import ngram_match
    from tandem.speculative.ngram import propose_ngram_reference
    rng = random.Random(seed)
    k, min_n, max_n, window = rng.randint(1, 5), rng.randint(1, 2), rng.randint(2, 4), rng.choice([8, 24, 64])
    rows = [[rng.randrange(4) for _ in range(rng.randint(0, 90))] for _ in range(9)] + [[]]
    history = torch.full((len(rows) + 3, 100), 3, dtype=torch.int32)  # 3 past each length: must not match
    slots = torch.randperm(len(rows) + 3)[:len(rows)]
    for slot, r in zip(slots.tolist(), rows):
        history[slot, :len(r)] = torch.tensor(r, dtype=torch.int32)
    lengths = torch.tensor([len(r) for r in rows])
    tokens, count = ngram_match(history.to(DEVICE), slots.to(DEVICE), lengths.to(DEVICE), k, min_n, max_n, window)
    tokens, count = tokens.cpu(), count.cpu()
    for i, r in enumerate(rows):
        want = propose_ngram_reference(r[max(0, len(r) - window):], k, min_n, max_n)
        n = int(count[i])
        assert tokens[i, :n].tolist() == want, (r, k, min_n, max_n, window)
        assert tokens[i, n:].eq(0).all()


@pytest.mark.parametrize("seed", [pytest.param(s, marks=[pytest.mark.gpu] if HAS_CUDA else []) for s in range(3)])
def test_append_sampled_kernel_is_the_torch_record(seed):
    """A plain step's history append in one launch equals the indexed stores it replaced:
    history[slot, input + 1] = token, length[slot] = input + 2; other rows and columns untouched."""
    from tandem.kernels.token_history import append_sampled
    g = torch.Generator().manual_seed(seed)
    history = torch.randint(0, 1000, (12, 40), generator=g, dtype=torch.int32)
    length = torch.randint(0, 40, (12,), generator=g)
    slots = torch.randperm(11, generator=g)[:5] + 1
    inputs = torch.randint(0, 38, (5,), generator=g)
    tokens = torch.randint(0, 50_000, (5,), generator=g)
    want_h, want_l = history.clone(), length.clone()
    want_h[slots, inputs + 1] = tokens.to(torch.int32)
    want_l[slots] = inputs + 2
    h, lens = history.to(DEVICE), length.to(DEVICE)
    append_sampled(h, lens, slots.to(DEVICE), inputs.to(DEVICE), tokens.to(DEVICE))
    assert torch.equal(h.cpu(), want_h) and torch.equal(lens.cpu(), want_l)


# The merge reads MERGE_TILE splits at a time (one compiled variant for any count): split counts
# below, at, just above and well past the tile, for the merge launch and the fused merge.
@pytest.mark.parametrize("num_splits", [1, 3, 8, 9, 17, 64])
def test_decode_merge_tiles_any_split_count(num_splits):
    seq_lens = [700, 1, 0, 130]
    heads = (4, 2, 64)
    out = _decode_case(heads, torch.float32, seq_lens, num_splits=num_splits, block_n=16, min_split_tokens=1)
    assert torch.equal(out[2], torch.zeros_like(out[2]))
    if num_splits > 1:  # the fused merge equals the merge launch exactly, and the reference
        _fused_vs_merge_launch(heads, seq_lens, num_splits, 1, torch.float32, SplitCounters())
