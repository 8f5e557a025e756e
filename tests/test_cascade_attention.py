"""Cascade (two-level) decode attention equals single-level decode attention.

Rows of a group share the KV slots of their first `shared_len` tokens, as requests reading
one radix-tree prefix do. The torch reference and the Triton kernels (interpreted on the CPU,
float32/float16) must give what plain decode attention gives on the same table.
"""
import pytest
import torch

from kernel_setup import DEVICE, DTYPES  # first: it sets up Triton's interpreter

triton = pytest.importorskip("triton")

from tandem.attention import torch_backend as ref  # noqa: E402
from tandem.cascade_layout import CascadeInputs, max_group_rows, split_prefixes  # noqa: E402
from tandem.kernels.cascade_attention import cascade_attention  # noqa: E402

TOL = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def _work(lens: list[int], part_len: int | None) -> tuple[list[int], list[int]]:
    """Work items as the planner cuts them, or in chunks of `part_len` (aligned to nothing)."""
    if part_len is None:
        return split_prefixes(lens, target_items=8)
    work, parts = [], []
    for g, n in enumerate(lens):
        starts = list(range(0, n, part_len))
        for p, s in enumerate(starts):
            work += [g, s, min(n, s + part_len), p]
        parts.append(len(starts))
    return work, parts


def _shared_table(groups: list[tuple[int, list[int]]], lone: list[int], num_kv_heads: int,
                  head_dim: int, dtype: torch.dtype, seed: int = 0, part_len: int | None = None):
    """A paged cache where each group (shared_len, [seq_len per row]) reads the same slots
    below shared_len, plus ungrouped rows of lengths `lone`. Rows of different groups are
    interleaved, so a group's rows are not contiguous in the batch. Slot 0 is the dummy."""
    g = torch.Generator().manual_seed(seed)
    rows = [(gi, s, n) for gi, (s, lens) in enumerate(groups) for n in lens] + [(-1, 0, n) for n in lone]
    order = torch.randperm(len(rows), generator=g).tolist()
    rows = [rows[i] for i in order]
    total = sum(s for s, _ in groups) + sum(n - s for _, s, n in rows) + 8
    free = iter((torch.randperm(total - 1, generator=g) + 1).tolist())
    prefixes = [[next(free) for _ in range(s)] for s, _ in groups]
    width = max(n for _, _, n in rows) + 3
    req_slots = [2 * b + 1 for b in range(len(rows))]  # table rows deliberately not 0..B-1
    table = torch.zeros(2 * len(rows) + 1, width, dtype=torch.int32)
    for b, (gi, s, n) in enumerate(rows):
        own = prefixes[gi] if gi >= 0 else []
        table[req_slots[b], :n] = torch.tensor(own + [next(free) for _ in range(n - len(own))])
    members = [[b for b, r in enumerate(rows) if r[0] == gi] for gi in range(len(groups))]
    k_cache = torch.randn(total, num_kv_heads, head_dim, generator=g).to(dtype)
    v_cache = torch.randn(total, num_kv_heads, head_dim, generator=g).to(dtype)
    work, parts = _work([s for s, _ in groups], part_len)
    t = lambda x, dt=torch.int32: torch.tensor(x, dtype=dt, device=DEVICE)  # noqa: E731
    layout = CascadeInputs(
        shared_lens=t([s for _, s, _ in rows]), shared_parts=t([parts[gi] if gi >= 0 else 0 for gi, _, _ in rows]),
        shared_src=t([req_slots[members[gi][0]] if gi >= 0 else req_slots[b] for b, (gi, _, _) in enumerate(rows)],
                     torch.int64),
        group_rows=t([b for m in members for b in m]),
        group_indptr=t([0] + [sum(map(len, members[:i + 1])) for i in range(len(members))]),
        work=t(work), max_group_size=max(map(len, members)))
    return dict(k_cache=k_cache.to(DEVICE), v_cache=v_cache.to(DEVICE), req_to_token=table.to(DEVICE),
                req_slots=t(req_slots, torch.int64), seq_lens=t([n for _, _, n in rows]), layout=layout)


def _case(heads, dtype, groups, lone, part_len=None, cache_dtype=None, **kwargs):
    """Cascade against single-level decode over the same cache (of `cache_dtype`, default q's)."""
    num_heads, num_kv_heads, head_dim = heads
    c = _shared_table(groups, lone, num_kv_heads, head_dim, cache_dtype or dtype, part_len=part_len)
    layout = c["layout"]
    q = torch.randn(len(c["seq_lens"]), num_heads, head_dim, device=DEVICE).to(dtype)
    scale = head_dim ** -0.5
    longest = int(c["seq_lens"].max())
    single = ref.decode_attention(q.float(), c["k_cache"].float(), c["v_cache"].float(), c["req_to_token"],
                                  c["req_slots"], c["seq_lens"], scale, longest)
    two_level = ref.cascade_attention(q.float(), c["k_cache"].float(), c["v_cache"].float(),
                                      c["req_to_token"], c["req_slots"], c["seq_lens"], layout.shared_lens,
                                      layout.shared_src, scale, longest)
    torch.testing.assert_close(two_level, single, atol=1e-5, rtol=1e-5)
    out = cascade_attention(q, c["k_cache"], c["v_cache"], c["req_to_token"], c["req_slots"], c["seq_lens"],
                            layout, scale, longest, **kwargs)
    # Over an e4m3 pool the dots take q and p in float16 (kernels.kv_dtype): its tolerance at least.
    tol = max(TOL[dtype], TOL[torch.float16]) if cache_dtype == torch.float8_e4m3fn else TOL[dtype]
    torch.testing.assert_close(out.float(), single, atol=tol, rtol=tol)
    return out


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", [(4, 4, 32), (6, 2, 64), (8, 1, 64), (3, 1, 96)],
                         ids=lambda h: "h{}kv{}d{}".format(*h))
def test_cascade_matches_single_level(heads, dtype):
    # Group sizes 1, 2 and 5; prefix lengths aligned to nothing; an ungrouped row; a row
    # whose suffix is its one decode token.
    _case(heads, dtype, [(37, [40, 90]), (131, [132, 150, 133, 200, 139]), (5, [6])], [23])


@pytest.mark.parametrize("dtype", DTYPES)
def test_cascade_over_an_fp8_pool(dtype):
    """kv_cache_dtype="fp8": the shared and suffix parts read the e4m3 pool upcast."""
    _case((6, 2, 64), dtype, [(37, [40, 90]), (131, [132, 150, 133])], [23], part_len=50,
          cache_dtype=torch.float8_e4m3fn)


@pytest.mark.parametrize("suffix_splits,part_len", [(1, 1000), (2, 37), (5, 16)])
def test_cascade_forced_splits(suffix_splits, part_len):
    # Suffix splits most rows leave unused (the merge must skip them); prefix chunks of any
    # length, so groups have different part counts.
    _case((8, 2, 32), torch.float32, [(150, [151, 170, 300]), (70, [71, 72])], [1, 260], part_len=part_len,
          suffix_splits=suffix_splits, min_split_tokens=16)


def test_split_prefixes_balances_and_bounds():
    work, parts = split_prefixes([2048, 100, 700], target_items=20)
    items = [work[i:i + 4] for i in range(0, len(work), 4)]
    assert sum(parts) == len(items) <= 20 + 3
    for g, n in enumerate([2048, 100, 700]):  # each prefix covered once, in order, by its parts
        mine = [it for it in items if it[0] == g]
        assert [it[3] for it in mine] == list(range(parts[g]))
        assert mine[0][1] == 0 and mine[-1][2] == n
        assert all(a[2] == b[1] for a, b in zip(mine, mine[1:]))
    assert parts[1] == 1 and parts[0] > 1


def test_cascade_single_kv_head_full_tile():
    # One KV head, 4 query heads: a group of 16 rows fills the 64-query M tile.
    heads = (4, 1, 32)
    rows = max_group_rows(*heads[:2])
    assert rows == 16
    _case(heads, torch.float16, [(100, [101 + i for i in range(rows)])], [])


def test_cascade_padding_group_row_and_work_item():
    # CUDA-graph padding: an empty group, a keyless work item and a zero-length row must be
    # harmless (zeros, no NaN).
    num_heads, num_kv_heads, head_dim = 4, 2, 32
    c = _shared_table([(40, [41, 60])], [9], num_kv_heads, head_dim, torch.float32)
    lay = c["layout"]
    q = torch.randn(4, num_heads, head_dim, device=DEVICE)
    zero = lambda dt=torch.int32: torch.zeros(1, dtype=dt, device=DEVICE)  # noqa: E731
    seq_lens = torch.cat([c["seq_lens"], zero()])
    slots = torch.cat([c["req_slots"], zero(torch.int64)])
    padded = CascadeInputs(torch.cat([lay.shared_lens, zero()]), torch.cat([lay.shared_parts, zero()]),
                           torch.cat([lay.shared_src, zero(torch.int64)]), torch.cat([lay.group_rows, zero()]),
                           torch.cat([lay.group_indptr, lay.group_indptr[-1:]]),  # group 1: empty
                           torch.cat([lay.work, torch.zeros(8, dtype=torch.int32, device=DEVICE)]),
                           max_group_size=4)
    out = cascade_attention(q, c["k_cache"], c["v_cache"], c["req_to_token"], slots, seq_lens, padded, 0.2, 60)
    expected = ref.decode_attention(q, c["k_cache"], c["v_cache"], c["req_to_token"], slots, seq_lens, 0.2, 60)
    torch.testing.assert_close(out[:3], expected[:3], atol=1e-4, rtol=1e-4)
    assert torch.equal(out[3], torch.zeros_like(out[3]))


def test_kernel_benchmark_runs_tiny():
    """The H200 micro-benchmark's harness, at a tiny size in the interpreter: its cases are
    exact, and it prints one table row per case."""
    from tandem.bench import cascade_kernels as bench
    case = bench.Case((4, 2, 32), groups=2, rows=3, shared=70, suffix=9)
    d = bench.build(case, torch.float32, torch.device(DEVICE))
    args = (d["q"], d["k"], d["v"], d["table"], d["req_slots"], d["seq_lens"])
    out = cascade_attention(*args, d["layout"], 0.3, 79)
    torch.testing.assert_close(out, ref.decode_attention(*args, 0.3, 79), atol=1e-4, rtol=1e-4)
    row = bench.run_case(case, torch.float32, torch.device(DEVICE), reps=1)
    assert set(bench.COLUMNS) <= set(row) and row["single_ms"] > 0 and row["shared_gb_s"] > 0
    # The sweep: the shared part alone, at another chunking and key tile.
    swept = bench.Case((4, 2, 32), groups=2, rows=3, shared=70, suffix=9, waves=8, min_part=16, tile=(16, 4, 1))
    row = bench.run_case(swept, torch.float32, torch.device(DEVICE), reps=1, shared_only=True)
    assert set(row) == set(bench.SWEEP_COLUMNS) and row["items"] > 2 and row["shared_ms"] > 0
    # Decode's layout: each row's own keys interleaved with the other rows', the same attention.
    dec = bench.Case((4, 2, 32), groups=2, rows=3, shared=70, suffix=9, suffix_layout="decode")
    d2 = bench.build(dec, torch.float32, torch.device(DEVICE))
    own = d2["table"][1:, 70:]
    assert (own[1:, 0] - own[:-1, 0] == 1).all() and (own[:, 1] - own[:, 0] == 6).all()
    assert own.unique().numel() == own.numel() and (d2["table"][1:, :70] == d["table"][1:, :70]).all()
    args2 = (d2["q"], d2["k"], d2["v"], d2["table"], d2["req_slots"], d2["seq_lens"])
    torch.testing.assert_close(cascade_attention(*args2, d2["layout"], 0.3, 79),
                               ref.decode_attention(*args2, 0.3, 79), atol=1e-4, rtol=1e-4)
    # The random layout: own keys anywhere in a larger pool, still distinct.
    rnd = bench.Case((4, 2, 32), groups=2, rows=3, shared=70, suffix=9, suffix_layout="random", pool_tokens=500)
    d3 = bench.build(rnd, torch.float32, torch.device(DEVICE))
    own3 = d3["table"][1:, 70:]
    assert own3.unique().numel() == own3.numel() and int(own3.max()) < d3["k"].shape[0] and int(own3.max()) > 141 + 54
    args3 = (d3["q"], d3["k"], d3["v"], d3["table"], d3["req_slots"], d3["seq_lens"])
    torch.testing.assert_close(cascade_attention(*args3, d3["layout"], 0.3, 79),
                               ref.decode_attention(*args3, 0.3, 79), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("suffix_splits", [1, 3, 8, 9, 17, 64])
def test_cascade_merge_tiles_any_split_count(suffix_splits):
    # Suffix splits + shared parts per row cross the merge's MERGE_TILE (8) boundary: chunks of 16
    # keys give the 150-token group 10 parts, so its rows merge up to 64 + 10 partials.
    _case((8, 2, 32), torch.float32, [(150, [151, 170, 1500]), (20, [21, 72])], [1, 700], part_len=16,
          suffix_splits=suffix_splits, min_split_tokens=16)
