"""Cascade decode attention vs the single-level kernel, over shared-prefix lengths and group
sizes: where the cascade path wins (the crossover `CascadeRule` should encode) and the
bandwidth the shared part achieves.

    python -m tandem.bench.cascade_kernels                      # Qwen3-0.6B heads, bf16, H200
    python -m tandem.bench.cascade_kernels --heads 32 8 128     # Llama-3.1-8B heads
    python -m tandem.bench.cascade_kernels --heads 8 1 128      # one KV head
    python -m tandem.bench.cascade_kernels --sweep --groups 32 --group-size 16 --shared-len 2048 \
        --waves 2 8 16 --tile 64:4:2 128:8:3                    # the shared part's chunking and tile

Each case: G groups of R rows; a row's keys are its group's shared prefix (P tokens) and its
own suffix (U tokens). Times (ms, device events over CUDA-graph replays, as the engine runs):
the single-level decode kernel over all P + U keys; the whole cascade path (suffix part,
shared part, merge); the shared part alone; the suffix part alone; the merge (the whole path
less both parts). Bandwidth: KV bytes each reads once (single: every row's P + U keys; shared
part: each group's P keys; suffix part: every row's U keys) / its time.
"""
from __future__ import annotations

import argparse
import itertools
import time
from dataclasses import dataclass

import torch

from tandem.cascade_layout import (MAX_PARTS, MIN_PART_TOKENS, WORK_WAVES, CascadeInputs, max_group_rows,
                                   split_prefixes, target_work_items)
from tandem.kernels.cascade_attention import cascade_attention, shared_prefix_partials
from tandem.kernels.decode_attention import (MIN_ROW_SPLIT_TOKENS, _num_sms, decode_attention, decode_num_splits,
                                             decode_suffix_partials, default_block_n)


@dataclass
class Case:
    heads: tuple[int, int, int]  # query heads, KV heads, head dim
    groups: int
    rows: int  # per group
    shared: int
    suffix: int
    waves: int = WORK_WAVES  # the layout's chunking (`target_work_items`)
    min_part: int = MIN_PART_TOKENS
    tile: tuple[int, int, int] = (0, 4, 3)  # the shared kernel's BLOCK_N (0: its default), warps, stages
    # Where each row's own keys lie: "contiguous" (a prefill's), "decode": interleaved with the
    # other rows' (token j of row b at own + j * batch + b), as rows decoding in step take slots,
    # or "random": anywhere in a pool of `pool_tokens` slots (a long-running engine's free list).
    suffix_layout: str = "contiguous"
    pool_tokens: int = 0  # "random": the own keys' pool (0: 8x the keys they need)


def build(case: Case, dtype: torch.dtype, device: torch.device) -> dict:
    """Caches, table and cascade layout for `case`; each row's table lists its group's prefix
    slots, then its own."""
    num_heads, num_kv_heads, head_dim = case.heads
    batch = case.groups * case.rows
    own_slots, pool = _own_slots(case, batch)
    slots = 1 + case.groups * case.shared + pool
    k = torch.randn(slots, num_kv_heads, head_dim, device=device).to(dtype)
    v = torch.randn(slots, num_kv_heads, head_dim, device=device).to(dtype)
    table = torch.zeros(batch + 1, case.shared + case.suffix, dtype=torch.int32, device=device)
    own = 1 + case.groups * case.shared
    for b in range(batch):
        g = b // case.rows
        table[b + 1, :case.shared] = torch.arange(1 + g * case.shared, 1 + (g + 1) * case.shared)
        table[b + 1, case.shared:] = own + own_slots[b]
    work, parts = split_prefixes([case.shared] * case.groups,
                                 target_work_items(_num_sms(device), num_kv_heads, case.waves), case.min_part)
    ints = lambda x: torch.tensor(x, dtype=torch.int32, device=device)  # noqa: E731
    layout = CascadeInputs(
        shared_lens=ints([case.shared] * batch), shared_parts=ints([parts[b // case.rows] for b in range(batch)]),
        shared_src=ints([1 + (b // case.rows) * case.rows for b in range(batch)]).long(),
        group_rows=ints(list(range(batch))), group_indptr=ints(list(range(0, batch + 1, case.rows))),
        work=ints(work), max_group_size=max_group_rows(num_heads, num_kv_heads))  # the engine's M tile
    return dict(q=torch.randn(batch, num_heads, head_dim, device=device).to(dtype), k=k, v=v, table=table,
                req_slots=torch.arange(1, batch + 1, device=device),
                seq_lens=ints([case.shared + case.suffix] * batch), layout=layout)


def _own_slots(case: Case, batch: int) -> tuple[torch.Tensor, int]:
    """Each row's own keys as offsets [batch, suffix] into a pool after the shared prefixes,
    by `case.suffix_layout`; and the pool's size."""
    own_keys = batch * case.suffix
    if case.suffix_layout == "decode":  # token j of row b at j * batch + b
        return torch.arange(own_keys).view(case.suffix, batch).t(), own_keys
    if case.suffix_layout == "random":
        pool = max(case.pool_tokens, own_keys) if case.pool_tokens else 8 * own_keys
        return torch.randperm(pool, generator=torch.Generator().manual_seed(0))[:own_keys].view(batch, -1), pool
    return torch.arange(own_keys).view(batch, case.suffix), own_keys


def time_ms(fn, reps: int, device: torch.device) -> float:
    """Device ms of one `fn` (host ms on the CPU). On CUDA `fn` is replayed from a CUDA graph,
    as the engine's decode steps are: eager launches from Python (~20-40 us each) would bound
    the small cases by the host, not the kernels."""
    fn()  # compile
    if device.type != "cuda":
        start = time.perf_counter()
        for _ in range(reps):
            fn()
        return (time.perf_counter() - start) / reps * 1e3
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the capture, as torch.cuda.graph asks
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    end.synchronize()
    return begin.elapsed_time(end) / reps


def run_case(case: Case, dtype: torch.dtype, device: torch.device, reps: int, shared_only: bool = False) -> dict:
    """The case's times and bandwidths; `shared_only`: the shared part's alone (a tile sweep)."""
    d = build(case, dtype, device)
    q, k, v, table, slots, lens, lay = d["q"], d["k"], d["v"], d["table"], d["req_slots"], d["seq_lens"], d["layout"]
    scale, longest = case.heads[2] ** -0.5, case.shared + case.suffix
    mid_o = torch.empty(q.shape[0], q.shape[1], MAX_PARTS, q.shape[2], dtype=torch.float32, device=device)
    mid_lse = torch.empty(q.shape[0], q.shape[1], MAX_PARTS, dtype=torch.float32, device=device)
    block_n, warps, stages = case.tile
    shared = time_ms(lambda: shared_prefix_partials(q, k, v, table, slots, lay, scale, mid_o, mid_lse, 0,
                                                    block_n=block_n or None, num_warps=warps, num_stages=stages),
                     reps, device)
    token_bytes = 2 * case.heads[1] * case.heads[2] * k.element_size()  # K and V of one token
    row = dict(heads="x".join(map(str, case.heads)), groups=case.groups, rows=case.rows, shared=case.shared,
               suffix=case.suffix, layout=case.suffix_layout, waves=case.waves, min_part=case.min_part,
               tile=":".join(map(str, case.tile)),
               items=lay.work.numel() // 4, shared_ms=shared,
               shared_gb_s=case.groups * case.shared * token_bytes / shared / 1e6)
    if shared_only:
        return row
    single = time_ms(lambda: decode_attention(q, k, v, table, slots, lens, scale, longest), reps, device)
    cascade = time_ms(lambda: cascade_attention(q, k, v, table, slots, lens, lay, scale, longest), reps, device)
    splits = decode_num_splits(q.shape[0], case.heads[1], case.heads[0] // case.heads[1], longest, device)
    suffix_o = torch.empty(q.shape[0], q.shape[1], splits, q.shape[2], dtype=torch.float32, device=device)
    suffix_lse = torch.empty(q.shape[0], q.shape[1], splits, dtype=torch.float32, device=device)
    suffix = time_ms(lambda: decode_suffix_partials(q, k, v, table, slots, lens, lay.shared_lens, scale, suffix_o,
                                                    suffix_lse, splits, MIN_ROW_SPLIT_TOKENS,
                                                    default_block_n(case.heads[2])), reps, device)
    batch = case.groups * case.rows
    return row | dict(single_ms=single, cascade_ms=cascade, speedup=single / cascade, suffix_ms=suffix,
                      merge_ms=cascade - shared - suffix, single_gb_s=batch * longest * token_bytes / single / 1e6,
                      suffix_gb_s=batch * case.suffix * token_bytes / suffix / 1e6)


COLUMNS = ["heads", "groups", "rows", "shared", "suffix", "layout", "single_ms", "cascade_ms", "speedup",
           "shared_ms", "suffix_ms", "merge_ms", "single_gb_s", "shared_gb_s", "suffix_gb_s"]
SWEEP_COLUMNS = ["heads", "groups", "rows", "shared", "suffix", "layout", "waves", "min_part", "tile", "items",
                 "shared_ms", "shared_gb_s"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tandem.bench.cascade_kernels", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--heads", type=int, nargs=3, default=[16, 8, 128], metavar=("Q", "KV", "D"))
    ap.add_argument("--shared-len", type=int, nargs="+", default=[64, 128, 256, 512, 1024, 2048, 4096])
    ap.add_argument("--group-size", type=int, nargs="+", default=[2, 4, 8, 16])
    ap.add_argument("--groups", type=int, nargs="+", default=[4, 32])
    ap.add_argument("--suffix-len", type=int, default=256)
    ap.add_argument("--suffix-layout", nargs="+", choices=["contiguous", "decode", "random"], default=["contiguous"],
                    help="each row's own keys: contiguous slots (a prefill's), interleaved across rows "
                         "(decode's: rows decoding together take consecutive slots) or random in a pool of "
                         "--pool-tokens slots")
    ap.add_argument("--pool-tokens", type=int, default=0,
                    help="the random layout's pool of own-key slots (0: 8x the keys; the engine's whole KV pool "
                         "tests the address spread of a long-running engine)")
    ap.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--sweep", action="store_true",
                    help="the shared part alone, over --waves x --min-part-tokens x --tile (its chunking and tile)")
    ap.add_argument("--waves", type=int, nargs="+", default=[WORK_WAVES])
    ap.add_argument("--min-part-tokens", type=int, nargs="+", default=[MIN_PART_TOKENS])
    ap.add_argument("--tile", nargs="+", default=["0:4:3"], metavar="BLOCK_N:WARPS:STAGES",
                    help="the shared kernel's key tile (0: its default), warps and pipeline stages")
    args = ap.parse_args(argv)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    limit = max_group_rows(args.heads[0], args.heads[1])
    columns = SWEEP_COLUMNS if args.sweep else COLUMNS
    tiles = [tuple(int(x) for x in t.split(":")) for t in args.tile]
    print("| " + " | ".join(columns) + " |\n|" + "---|" * len(columns))
    for groups, rows, shared, waves, min_part, tile, layout in itertools.product(
            args.groups, args.group_size, args.shared_len, args.waves, args.min_part_tokens, tiles,
            args.suffix_layout):
        if rows > limit:
            continue
        case = Case(tuple(args.heads), groups, rows, shared, args.suffix_len, waves, min_part, tile, layout,
                    args.pool_tokens)
        r = run_case(case, dtype, device, args.reps, shared_only=args.sweep)
        print("| " + " | ".join(f"{r[c]:.3f}" if isinstance(r[c], float) else str(r[c]) for c in columns) + " |",
              flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
