"""CUDA graphs for prefill steps: one graph per (token bucket, staging ring slot).

An eager prefill step launches ~9 kernels a layer from Python, 11-20 ms of host time on the
H200's hosts against 1-4 ms of GPU work for a few hundred tokens of the 0.6B shape
(docs/benchmarks.md, session 22): a small prefill step is host-bound, and its prompt's first
token waits for Python. A graphed step is padded to its bucket's fixed shape:
- tokens past the real ones: request slot 0, position 0, KV slot 0 (the dummy slot); they
  form a padding row of length 0 right after the real rows, whose attention writes zeros;
- rows past the padding row: empty (no tokens, length 0);
- the extend attention's programs come from a host-planned block table (row, query block),
  sized by the bucket; its unused entries name a block past every row's end and do nothing;
- the logits of the sampled rows' last tokens go to the logits buffer decode graphs share.
Steps it does not take (they run eagerly): decode rows in the step (mixed batches), prompt
logprobs, more tokens or rows than the largest bucket holds, and steps of an engine with a
draft model (its attention tiles can differ from the block table's).
"""
import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tandem.cuda_graph import capture_all, warm_and_capture
from tandem.forward_batch import ForwardBatch
from tandem.kernels.grid import cdiv
from tandem.memory.kv_cache import KVCache
from tandem.memory.req_to_token import ReqToTokenTable
from tandem.models.decoder import DecoderModel
from tandem.overlap.staging import InputStager, ragged_columns
from tandem.overlap.streams import StreamSet
from tandem.scheduler.batch import ScheduledBatch

log = logging.getLogger("tandem")

# The fields a graph reads from the staging ring, in this order at the ring slot's start.
PREFILL_FIELDS = ("input_ids", "positions", "out_cache_loc", "token_req_slots", "req_slots", "seq_lens",
                  "prefix_lens", "qo_indptr", "block_rows", "block_index", "sample_token_idx", "sample_slots")
# A step is graphed while its dense-matmul work is at most this many FLOPs (2 x parameters x
# tokens): ~12 ms at ~650 TFLOP/s of bf16 on an H200, about what an eager step's launches take
# on the H200's slower hosts. Past it the GPU work covers the launches and padding only costs.
GRAPH_MAX_FLOPS = 8e12
# At most this many tokens (Experiments.prefill_graph_max_tokens). 2,048 until session 26: the
# host tier's multi-turn prefill steps (4-6k new tokens over ~10k cached, 0.6B shape) launched
# eagerly for ~14 ms of host time against ~15-25 ms of GPU work, and with the plans and copy
# windows around them left the host no lead (docs/benchmarks.md, session 26).
LARGEST_BUCKET = 8192
MAX_ROWS = 64  # prompts a graphed step holds (rows of the shared logits buffer)


@dataclass(frozen=True)
class PrefillBucket:
    tokens: int  # the step's tokens, padded
    rows: int  # real rows it holds; one more (the padding row) is staged
    blocks: int  # block-table entries: every query block of every row, padding included

    def sizes(self) -> dict[str, int]:
        """The staged fields' lengths, in staging order."""
        t, r, b = self.tokens, self.rows, self.blocks
        return dict(zip(PREFILL_FIELDS, (t, t, t, t, r + 1, r + 1, r + 1, r + 2, b, b, r, r)))


def graph_token_limit(num_params: int, max_prefill_tokens: int, largest: int = LARGEST_BUCKET) -> int:
    """The most tokens a graphed prefill step holds: GRAPH_MAX_FLOPS of work, at most
    `largest` and the step budget."""
    return min(int(GRAPH_MAX_FLOPS // (2 * max(num_params, 1))), largest, max_prefill_tokens)


def prefill_buckets(max_tokens: int, max_rows: int, block_rows: int) -> list[PrefillBucket]:
    """Token buckets: powers of two from 16 to 512 (a step pads at most 2x while its work is
    small), then every 256 to 2,048 (at most +50%, then less), then every 512 (at most +25%;
    padding tokens cost dense work only, not attention), up to `max_tokens`. A bucket holds up
    to tokens / 8 prompts (at least 2), at most `max_rows`; `block_rows` is the attention's
    query block, the block table's unit."""
    sizes = [s for s in (16, 32, 64, 128, 256, 512) if s <= max_tokens]
    sizes += list(range(768, min(max_tokens, 2048) + 1, 256))
    sizes += list(range(2560, max_tokens + 1, 512))
    out = []
    for t in sizes:
        rows = max(1, min(max(t // 8, 2), max_rows))
        out.append(PrefillBucket(t, rows, cdiv(t, block_rows) + rows + 1))
    return out


def prefill_graph_metadata(batch: ScheduledBatch, bucket: PrefillBucket, block_rows: int) -> dict[str, Sequence[int]]:
    """A prefill-only step's inputs in the graph's layout (module docstring), padded to `bucket`."""
    ids, locs, lengths = [], [], []
    req_slots, seq_lens, prefix_lens, qo_indptr = [], [], [], [0]
    rows_of_block, index_of_block, sample_idx, sample_slots = [], [], [], []
    for i, row in enumerate(batch.rows):
        slot, start, n = row.req.slot, row.start, len(row.kv_slots)
        ids += row.prefill_ids
        locs += row.kv_slots
        lengths.append(n)
        req_slots.append(slot)
        seq_lens.append(start + n)
        prefix_lens.append(start)
        qo_indptr.append(qo_indptr[-1] + n)
        rows_of_block += [i] * cdiv(n, block_rows)
        index_of_block += range(cdiv(n, block_rows))
        if row.sample_index is not None:
            sample_idx.append(qo_indptr[-1] - 1)
            sample_slots.append(slot)
    pad_row, pad_tokens = len(batch.rows), bucket.tokens - len(ids)
    rows_of_block += [pad_row] * cdiv(pad_tokens, block_rows)
    index_of_block += range(cdiv(pad_tokens, block_rows))
    assert pad_tokens >= 0 and pad_row <= bucket.rows and len(rows_of_block) <= bucket.blocks
    unused_block = cdiv(bucket.tokens, block_rows)  # past every row's end: no work
    empty_rows = bucket.rows - pad_row  # the padding row, then rows without tokens
    positions, token_req = ragged_columns(prefix_lens, lengths, req_slots, pad=pad_tokens)
    fields = {
        "input_ids": ids + [0] * pad_tokens, "positions": positions,
        "out_cache_loc": locs + [0] * pad_tokens, "token_req_slots": token_req,
        "req_slots": req_slots + [0] * (empty_rows + 1), "seq_lens": seq_lens + [0] * (empty_rows + 1),
        "prefix_lens": prefix_lens + [0] * (empty_rows + 1),
        "qo_indptr": qo_indptr + [bucket.tokens] * (empty_rows + 1),
        "block_rows": rows_of_block + [pad_row] * (bucket.blocks - len(rows_of_block)),
        "block_index": index_of_block + [unused_block] * (bucket.blocks - len(index_of_block)),
        "sample_token_idx": sample_idx + [0] * (bucket.rows - len(sample_idx)),
        "sample_slots": sample_slots + [0] * (bucket.rows - len(sample_slots)),
    }
    assert tuple(fields) == PREFILL_FIELDS and {k: len(v) for k, v in fields.items()} == bucket.sizes()
    return fields


def graphable(batch: ScheduledBatch) -> bool:
    """Prefill rows only, and none owing prompt logprobs (their LM head runs over every token)."""
    if batch.decode is not None:  # decode columns: no prefill row (and no rows to make)
        return False
    return all(r.prefill_ids is not None and r.prompt_logprobs is None for r in batch.rows) and bool(batch.rows)


class PrefillGraphs:
    def __init__(self, model: DecoderModel, kv: KVCache, table: ReqToTokenTable, backend, streams: StreamSet,
                 stager: InputStager, buckets: list[PrefillBucket], block_rows: int, max_seq_len: int,
                 logits: torch.Tensor, capture: bool = True):
        self.model, self.kv, self.table, self.backend = model, kv, table, backend
        self.streams, self.stager, self.buckets = streams, stager, buckets
        self.block_rows = block_rows  # the attention's query block: the block table's unit
        self.max_seq_len = max_seq_len
        # Shared with the decode graphs. Ordering rule: replays and the sampling that reads
        # their logits all run on the forward stream, so a replay never overwrites logits
        # still to be read.
        assert logits.shape[0] >= max(b.rows for b in buckets)
        self.logits = logits
        self.use_graphs = capture  # False: the same fixed-shape work, run eagerly (CPU tests)
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.memory_bytes = 0  # device memory the captured graphs took (measured at capture)
        self.replays = 0  # steps run through a bucket (stats)

    def bucket(self, batch: ScheduledBatch) -> PrefillBucket | None:
        """The smallest bucket holding the step, or None (it runs eagerly)."""
        if not graphable(batch):
            return None
        tokens, rows = batch.num_tokens, len(batch.rows)
        return next((b for b in self.buckets if b.tokens >= tokens and b.rows >= rows), None)

    def metadata(self, batch: ScheduledBatch, bucket: PrefillBucket) -> dict[str, Sequence[int]]:
        return prefill_graph_metadata(batch, bucket, self.block_rows)

    def forward(self, views: dict[str, torch.Tensor], bucket: PrefillBucket) -> torch.Tensor:
        """The captured work; also what a replay recomputes. Returns logits [bucket.rows, V]."""
        self.table.write_on_device(views["token_req_slots"], views["positions"], views["out_cache_loc"])
        fb = ForwardBatch(
            input_ids=views["input_ids"], positions=views["positions"], out_cache_loc=views["out_cache_loc"],
            req_slots=views["req_slots"], seq_lens=views["seq_lens"], prefix_lens=views["prefix_lens"],
            qo_indptr=views["qo_indptr"], req_to_token=self.table.table,
            # The host lists size only the dense extend grid, which the block table replaces.
            host_req_slots=[], host_seq_lens=[], host_extend_lens=[bucket.tokens], is_decode=False,
            max_seq_len=self.max_seq_len, extend_blocks=(views["block_rows"], views["block_index"]))
        hidden = self.model(fb, self.kv, self.backend)
        return self.model.compute_logits(hidden[views["sample_token_idx"]], out=self.logits[:bucket.rows])

    @torch.no_grad()
    def capture(self, pool=None) -> None:
        """`pool`: the decode graphs' memory pool (replays of both are ordered on the forward stream)."""
        by_tokens = {b.tokens: b for b in self.buckets}

        def one(ring: int, tokens: int, views: dict[str, torch.Tensor], pool) -> None:
            bucket = by_tokens[tokens]
            _pad_views(views, bucket)
            self.graphs[(tokens, ring)] = warm_and_capture(lambda: self.forward(views, bucket), pool,
                                                           self.streams.forward)
        self.memory_bytes = capture_all(self.streams, list(by_tokens), self.stager.depth,
                                        lambda ring, tokens: self.stager.views(ring, by_tokens[tokens].sizes()),
                                        one, pool)
        log.info("captured %d prefill graphs (up to %d tokens) using %.0f MiB",
                 len(self.graphs), self.buckets[-1].tokens, self.memory_bytes / 2**20)

    def replay(self, bucket: PrefillBucket, ring: int) -> torch.Tensor:
        """Queue the step on the current (forward) stream; returns the logits buffer's rows."""
        self.replays += 1
        if not self.use_graphs:
            return self.forward(self.stager.views(ring, bucket.sizes()), bucket)
        graph, logits = self.graphs[(bucket.tokens, ring)]
        graph.replay()
        return logits

    def close(self) -> None:
        """Free the graphs; their memory pool goes back once no graph uses it."""
        for graph, _ in self.graphs.values():
            graph.reset()
        self.graphs.clear()
        self.logits = None


def _pad_views(views: dict[str, torch.Tensor], bucket: PrefillBucket) -> None:
    """All-padding inputs for a capture: one padding row holding every token (zeroed views
    otherwise): a layout the replays' inputs also have, so the warm-up compiles their kernels."""
    views["qo_indptr"][1:] = bucket.tokens
    views["block_index"].copy_(torch.arange(bucket.blocks, device=views["block_index"].device))
