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
from tandem.forward_batch import max_group_rows  # noqa: E402
from tandem.kernels.cascade_attention import cascade_attention  # noqa: E402

TOL = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def _shared_table(groups: list[tuple[int, list[int]]], lone: list[int], num_kv_heads: int,
                  head_dim: int, dtype: torch.dtype, seed: int = 0):
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
    shared = [s for _, s, _ in rows]
    src = [req_slots[members[gi][0]] if gi >= 0 else req_slots[b] for b, (gi, _, _) in enumerate(rows)]
    t = lambda x, dt=torch.int32: torch.tensor(x, dtype=dt, device=DEVICE)  # noqa: E731
    return dict(k_cache=k_cache.to(DEVICE), v_cache=v_cache.to(DEVICE), req_to_token=table.to(DEVICE),
                req_slots=t(req_slots, torch.int64), seq_lens=t([n for _, _, n in rows]),
                shared_lens=t(shared), shared_src=t(src, torch.int64),
                group_rows=t([b for m in members for b in m]),
                group_indptr=t([0] + [sum(map(len, members[:i + 1])) for i in range(len(members))]),
                max_group=max(map(len, members), default=1))


def _case(heads, dtype, groups, lone, **kwargs):
    num_heads, num_kv_heads, head_dim = heads
    c = _shared_table(groups, lone, num_kv_heads, head_dim, dtype)
    q = torch.randn(len(c["seq_lens"]), num_heads, head_dim, device=DEVICE).to(dtype)
    scale = head_dim ** -0.5
    longest = int(c["seq_lens"].max())
    single = ref.decode_attention(q.float(), c["k_cache"].float(), c["v_cache"].float(), c["req_to_token"],
                                  c["req_slots"], c["seq_lens"], scale, longest)
    two_level = ref.cascade_attention(q.float(), c["k_cache"].float(), c["v_cache"].float(),
                                      c["req_to_token"], c["req_slots"], c["seq_lens"], c["shared_lens"],
                                      c["shared_src"], scale, longest)
    torch.testing.assert_close(two_level, single, atol=1e-5, rtol=1e-5)
    out = cascade_attention(q, c["k_cache"], c["v_cache"], c["req_to_token"], c["req_slots"], c["seq_lens"],
                            c["shared_lens"], c["group_rows"], c["group_indptr"], scale, longest,
                            max(s for s, _ in groups), c["max_group"], **kwargs)
    torch.testing.assert_close(out.float(), single, atol=TOL[dtype], rtol=TOL[dtype])
    return out


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", [(4, 4, 32), (6, 2, 64), (8, 1, 64), (3, 1, 96)],
                         ids=lambda h: "h{}kv{}d{}".format(*h))
def test_cascade_matches_single_level(heads, dtype):
    # Group sizes 1, 2 and 5; prefix lengths aligned to nothing; an ungrouped row; a row
    # whose suffix is its one decode token.
    _case(heads, dtype, [(37, [40, 90]), (131, [132, 150, 133, 200, 139]), (5, [6])], [23])


@pytest.mark.parametrize("splits", [(1, 1), (2, 3), (5, 7)])
def test_cascade_forced_splits(splits):
    # Many splits over short parts: most are unused and the merge must skip them.
    _case((8, 2, 32), torch.float32, [(150, [151, 170, 300]), (70, [71, 72])], [1, 260],
          suffix_splits=splits[0], shared_splits=splits[1], min_split_tokens=16)


def test_cascade_single_kv_head_full_tile():
    # One KV head, 4 query heads: a group of 16 rows fills the 64-query M tile.
    heads = (4, 1, 32)
    rows = max_group_rows(*heads[:2])
    assert rows == 16
    _case(heads, torch.float16, [(100, [101 + i for i in range(rows)])], [])


def test_cascade_padding_group_and_row():
    # CUDA-graph padding: an empty group and a zero-length row must be harmless (zeros, no NaN).
    num_heads, num_kv_heads, head_dim = 4, 2, 32
    c = _shared_table([(40, [41, 60])], [9], num_kv_heads, head_dim, torch.float32)
    q = torch.randn(4, num_heads, head_dim, device=DEVICE)
    seq_lens = torch.cat([c["seq_lens"], torch.zeros(1, dtype=torch.int32, device=DEVICE)])
    shared = torch.cat([c["shared_lens"], torch.zeros(1, dtype=torch.int32, device=DEVICE)])
    slots = torch.cat([c["req_slots"], torch.zeros(1, dtype=torch.int64, device=DEVICE)])
    indptr = torch.cat([c["group_indptr"], c["group_indptr"][-1:]])  # group 1: empty
    out = cascade_attention(q, c["k_cache"], c["v_cache"], c["req_to_token"], slots, seq_lens, shared,
                            c["group_rows"], indptr, 0.2, 60, 40, 2, shared_splits=2)
    expected = ref.decode_attention(q, c["k_cache"], c["v_cache"], c["req_to_token"], slots, seq_lens, 0.2, 60)
    torch.testing.assert_close(out[:3], expected[:3], atol=1e-4, rtol=1e-4)
    assert torch.equal(out[3], torch.zeros_like(out[3]))
