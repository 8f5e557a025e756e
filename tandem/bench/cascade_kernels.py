"""Cascade decode attention vs the single-level kernel, over shared-prefix lengths and group
sizes: where the cascade path wins (the crossover `CascadeRule` should encode) and the
bandwidth the shared part achieves.

    python -m tandem.bench.cascade_kernels                      # Qwen3-0.6B heads, bf16, H200
    python -m tandem.bench.cascade_kernels --heads 32 8 128     # Llama-3.1-8B heads
    python -m tandem.bench.cascade_kernels --heads 8 1 128      # one KV head

Each case: G groups of R rows; a row's keys are its group's shared prefix (P tokens) and its
own suffix (U tokens). Times (ms, device events): the single-level decode kernel over all
P + U keys; the whole cascade path (suffix part, shared part, merge); the shared part alone.
Bandwidth: KV bytes each reads once (single: every row's P + U keys; shared part: each
group's P keys) / its time.
"""
from __future__ import annotations

import argparse
import itertools
import time
from dataclasses import dataclass

import torch

from tandem.cascade_layout import MAX_PARTS, CascadeInputs, max_group_rows, split_prefixes
from tandem.kernels.cascade_attention import cascade_attention, shared_prefix_partials
from tandem.kernels.decode_attention import _num_sms, decode_attention


@dataclass
class Case:
    heads: tuple[int, int, int]  # query heads, KV heads, head dim
    groups: int
    rows: int  # per group
    shared: int
    suffix: int


def build(case: Case, dtype: torch.dtype, device: torch.device) -> dict:
    """Caches, table and cascade layout for `case`; each row's table lists its group's prefix
    slots, then its own."""
    num_heads, num_kv_heads, head_dim = case.heads
    batch = case.groups * case.rows
    slots = 1 + case.groups * case.shared + batch * case.suffix
    k = torch.randn(slots, num_kv_heads, head_dim, device=device).to(dtype)
    v = torch.randn(slots, num_kv_heads, head_dim, device=device).to(dtype)
    table = torch.zeros(batch + 1, case.shared + case.suffix, dtype=torch.int32, device=device)
    own = 1 + case.groups * case.shared
    for b in range(batch):
        g = b // case.rows
        table[b + 1, :case.shared] = torch.arange(1 + g * case.shared, 1 + (g + 1) * case.shared)
        table[b + 1, case.shared:] = torch.arange(own + b * case.suffix, own + (b + 1) * case.suffix)
    work, parts = split_prefixes([case.shared] * case.groups, -(-2 * _num_sms(device) // num_kv_heads))
    ints = lambda x: torch.tensor(x, dtype=torch.int32, device=device)  # noqa: E731
    layout = CascadeInputs(
        shared_lens=ints([case.shared] * batch), shared_parts=ints([parts[b // case.rows] for b in range(batch)]),
        shared_src=ints([1 + (b // case.rows) * case.rows for b in range(batch)]).long(),
        group_rows=ints(list(range(batch))), group_indptr=ints(list(range(0, batch + 1, case.rows))),
        work=ints(work), max_group_size=max_group_rows(num_heads, num_kv_heads))  # the engine's M tile
    return dict(q=torch.randn(batch, num_heads, head_dim, device=device).to(dtype), k=k, v=v, table=table,
                req_slots=torch.arange(1, batch + 1, device=device),
                seq_lens=ints([case.shared + case.suffix] * batch), layout=layout)


def time_ms(fn, reps: int, device: torch.device) -> float:
    fn()  # compile
    if device.type != "cuda":
        start = time.perf_counter()
        for _ in range(reps):
            fn()
        return (time.perf_counter() - start) / reps * 1e3
    for _ in range(3):
        fn()
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    for _ in range(reps):
        fn()
    end.record()
    end.synchronize()
    return begin.elapsed_time(end) / reps


def run_case(case: Case, dtype: torch.dtype, device: torch.device, reps: int) -> dict:
    d = build(case, dtype, device)
    q, k, v, table, slots, lens, lay = d["q"], d["k"], d["v"], d["table"], d["req_slots"], d["seq_lens"], d["layout"]
    scale, longest = case.heads[2] ** -0.5, case.shared + case.suffix
    single = time_ms(lambda: decode_attention(q, k, v, table, slots, lens, scale, longest), reps, device)
    cascade = time_ms(lambda: cascade_attention(q, k, v, table, slots, lens, lay, scale, longest), reps, device)
    mid_o = torch.empty(q.shape[0], q.shape[1], MAX_PARTS, q.shape[2], dtype=torch.float32, device=device)
    mid_lse = torch.empty(q.shape[0], q.shape[1], MAX_PARTS, dtype=torch.float32, device=device)
    shared = time_ms(lambda: shared_prefix_partials(q, k, v, table, slots, lay, scale, mid_o, mid_lse, 0),
                     reps, device)
    token_bytes = 2 * case.heads[1] * case.heads[2] * k.element_size()  # K and V of one token
    batch = case.groups * case.rows
    return dict(heads="x".join(map(str, case.heads)), groups=case.groups, rows=case.rows, shared=case.shared,
                suffix=case.suffix, single_ms=single, cascade_ms=cascade, speedup=single / cascade,
                shared_ms=shared, single_gb_s=batch * longest * token_bytes / single / 1e6,
                shared_gb_s=case.groups * case.shared * token_bytes / shared / 1e6)


COLUMNS = ["heads", "groups", "rows", "shared", "suffix", "single_ms", "cascade_ms", "speedup", "shared_ms",
           "single_gb_s", "shared_gb_s"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tandem.bench.cascade_kernels", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--heads", type=int, nargs=3, default=[16, 8, 128], metavar=("Q", "KV", "D"))
    ap.add_argument("--shared-len", type=int, nargs="+", default=[64, 128, 256, 512, 1024, 2048, 4096])
    ap.add_argument("--group-size", type=int, nargs="+", default=[2, 4, 8, 16])
    ap.add_argument("--groups", type=int, nargs="+", default=[4, 32])
    ap.add_argument("--suffix-len", type=int, default=256)
    ap.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--reps", type=int, default=50)
    args = ap.parse_args(argv)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    limit = max_group_rows(args.heads[0], args.heads[1])
    print("| " + " | ".join(COLUMNS) + " |\n|" + "---|" * len(COLUMNS))
    for groups, rows, shared in itertools.product(args.groups, args.group_size, args.shared_len):
        if rows > limit:
            continue
        r = run_case(Case(tuple(args.heads), groups, rows, shared, args.suffix_len), dtype, device, args.reps)
        print("| " + " | ".join(f"{r[c]:.3f}" if isinstance(r[c], float) else str(r[c]) for c in COLUMNS) + " |",
              flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
