"""A fixed-shape verify step's query inputs in one launch: token ids, positions, KV locations.

A graphed verify step (`speculative.graphs.VerifyGraphs`) scores Q queries a row: the row's
last token, then its proposals, at positions `length - 1 + j`, each writing its KV at the
row's `req_to_token` entry there, or at the dummy slot 0 past the row's k_row. The torch form
(`graphs.query_inputs` on the CPU, this kernel's reference) takes ~15 small kernels of index
arithmetic and gathers, each a few microseconds of GPU inside the graph; here one program
per row writes all three.
"""
import torch
import triton
import triton.language as tl

from tandem.kernels.grid import next_power_of_2


@triton.jit
def _verify_inputs_kernel(
    Proposals, Last, Lengths, KRows, Slots, Table, stride_t, WIDTH, InputIds, Positions, Locs,
    Q, K, BLOCK: tl.constexpr,
):
    b = tl.program_id(0)
    j = tl.arange(0, BLOCK).to(tl.int64)
    query = j < Q
    last = tl.load(Last + b).to(tl.int64)
    # Query j > 0 scores proposal j - 1 (0 past the row's count: `prepare` zeroed them).
    proposals = tl.load(Proposals + b * K + j - 1, mask=query & (j > 0), other=0).to(tl.int64)
    ids = tl.where(j == 0, last, proposals)
    positions = tl.maximum(tl.load(Lengths + b).to(tl.int64) - 1 + j, 0)  # padding rows: length 0
    # Queries past the row's k_row have no reserved slot: their KV goes to the dummy slot 0.
    # Their positions may pass the table's width; what they read there is never used.
    live = query & (j <= tl.load(KRows + b).to(tl.int64))
    row = Table + tl.load(Slots + b).to(tl.int64) * stride_t
    locs = tl.load(row + tl.minimum(positions, WIDTH - 1), mask=live, other=0).to(tl.int64)
    out = b * Q + j
    tl.store(InputIds + out, ids, mask=query)
    tl.store(Positions + out, positions, mask=query)
    tl.store(Locs + out, locs, mask=query)


def verify_inputs(proposals: torch.Tensor, last: torch.Tensor, lengths: torch.Tensor, k_rows: torch.Tensor,
                  slots: torch.Tensor, table: torch.Tensor, queries: int
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`proposals` [B, k] (zero past each row's count), the rows' `last` tokens, `lengths`
    (before the step), `k_rows`, request `slots` [B] and the `req_to_token` table: the query
    tokens' (ids, positions, KV locations), each [B * queries] int64, row-major. Fixed shapes,
    no host read (graph-capturable)."""
    B, k = proposals.shape
    assert 1 <= queries <= k + 1 and table.stride(1) == 1
    ids, positions, locs = (torch.empty(B * queries, dtype=torch.int64, device=proposals.device) for _ in range(3))
    if B == 0:
        return ids, positions, locs
    _verify_inputs_kernel[(B,)](
        proposals, last, lengths, k_rows, slots, table, table.stride(0), table.shape[1], ids, positions, locs,
        queries, k, BLOCK=max(2, next_power_of_2(queries)), num_warps=1)  # 2: no one-lane blocks
    return ids, positions, locs
