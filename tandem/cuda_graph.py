"""CUDA graphs for decode steps: one graph per (batch-size bucket, staging ring slot).

A decode step's whole forward (FutureMap gather, table write, model, logits) is one graph
replay instead of ~1,700 kernel launches from Python. Inputs are read from the staging
ring's device buffers at fixed offsets, so each ring slot has its own graphs; or, with
`per_ring_slot=False`, one graph per bucket reads the graphs' own input buffer, into which
the step's ring slot is copied before the replay (`Experiments.decode_graph_per_ring_slot`). Rows past the
real batch are padding: request slot 0 (the padding row and FutureMap padding slot), KV
slot 0 (the dummy slot), sequence length 0 (attention outputs zeros); they are never sampled.
"""
import logging

import torch

from tandem.forward_batch import ForwardBatch
from tandem.memory.kv_cache import KVCache
from tandem.memory.req_to_token import ReqToTokenTable
from tandem.models.decoder import DecoderModel
from tandem.overlap.future_map import FutureMap
from tandem.overlap.staging import InputStager, field_offsets, sliced_views
from tandem.overlap.streams import StreamSet
from tandem.scheduler.cascade import CascadeRule, graph_inputs, graph_sizes

log = logging.getLogger("tandem")

DECODE_FIELDS = ("req_slots", "positions", "out_cache_loc", "seq_lens")


def default_buckets(max_batch: int) -> list[int]:
    """Decode batch sizes captured in graphs: fine steps up to 256 rows, then every 32 rows
    up to `max_batch` (a batch pads to the next bucket, so past 256 the padding stays <= 12%),
    and `max_batch` itself, so no decode step up to the maximum runs eagerly."""
    sizes = [1, 2, 4, 8] + list(range(16, 257, 16)) + list(range(288, max_batch + 32, 32))
    return sorted({min(s, max_batch) for s in sizes if s > 0})


def decode_sizes(bucket: int) -> dict[str, int]:
    return {name: bucket for name in DECODE_FIELDS}


def warm_and_capture(run, pool, stream: torch.cuda.Stream) -> tuple[torch.cuda.CUDAGraph, object]:
    """Run `run()` once (compiles kernels, fills caches), then capture it: (graph, its outputs)."""
    with torch.cuda.stream(stream):
        run()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool, stream=stream):
        out = run()
    return graph, out


def capture_all(streams: StreamSet, buckets: list[int], depth: int, views, capture_one, pool=None) -> int:
    """The capture loop of every graph set: per bucket and staging ring slot, all-padding
    inputs (`views(ring, bucket)` zeroed), then `capture_one(ring, bucket, views, pool)`, on
    the forward stream. `pool`: share another set's memory pool (their replays are ordered on
    the one forward stream). Returns the device memory the graphs took from this process's
    allocator (their memory pool). Not the device's free memory: other processes on the GPU
    change that meanwhile (the H200 suite's shared test pass saw -462 MiB at 578fb93)."""
    device = streams.device
    reserved_before = torch.cuda.memory_reserved(device)
    pool = torch.cuda.graph_pool_handle() if pool is None else pool
    forward = streams.forward
    forward.wait_stream(torch.cuda.current_stream(device))
    for bucket in reversed(buckets):  # largest first: smaller ones reuse its pool
        for ring in range(depth):
            v = views(ring, bucket)
            for t in v.values():
                t.zero_()
            capture_one(ring, bucket, v, pool)
    torch.cuda.current_stream(device).wait_stream(forward)
    torch.cuda.synchronize(device)
    return torch.cuda.memory_reserved(device) - reserved_before


class DecodeGraphs:
    def __init__(self, model: DecoderModel, kv: KVCache, table: ReqToTokenTable, backend,
                 future_map: FutureMap, streams: StreamSet, stager: InputStager,
                 buckets: list[int], max_seq_len: int, draft=None, cascade: CascadeRule | None = None,
                 per_ring_slot: bool = True):
        self.model, self.kv, self.table, self.backend = model, kv, table, backend
        self.draft = draft  # speculative decoding's draft model: the graph writes its KV too
        self.future_map, self.streams, self.stager = future_map, streams, stager
        self.buckets = buckets
        # Decode kernels take their split count from this host int; fixed for every replay.
        self.max_seq_len = max_seq_len
        # Cascade attention: a second graph per (bucket >= 2, ring slot) reading the padded
        # cascade layout after the decode fields (`tandem.scheduler.cascade.graph_sizes`).
        self.cascade = cascade
        self.graphs: dict[tuple[int, int, bool], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.memory_bytes = 0  # device memory the captured graphs took (measured at capture)
        self.pool = None  # the graphs' memory pool, once captured
        # The debug FutureMap's device assert cannot be captured (its message is copied from
        # pageable host memory), so in debug mode the gather runs eagerly into a static buffer.
        self.resolve_in_graph = not future_map.debug
        self.input_ids = {b: torch.zeros(b, dtype=torch.int64, device=streams.device) for b in buckets}
        # One logits buffer for every graph (fp32 [bucket, vocab] each would be GiBs at a 152k
        # vocab). Ordering rule: replays and the sampling that reads their logits all run on
        # the forward stream, so a replay never overwrites logits still to be read.
        self.logits = torch.empty(self.max_batch, model.config.vocab_size, dtype=torch.float32,
                                  device=streams.device)
        # Graphs per ring slot read the slot in place; else every graph reads `inputs`, the
        # step's ring slot copied there first (`feed`).
        self.per_ring_slot = per_ring_slot
        self.input_ints = {(b, c): field_offsets(self.sizes(b, c))[1]
                           for b in buckets for c in (False, True) if not c or self.has_cascade(b)}
        self.inputs = None if per_ring_slot else torch.zeros(
            max(self.input_ints.values()), dtype=torch.int64, device=streams.device)

    @property
    def max_batch(self) -> int:
        return self.buckets[-1]

    def bucket(self, batch_size: int) -> int:
        return next(b for b in self.buckets if b >= batch_size)

    def has_cascade(self, bucket: int) -> bool:
        return self.cascade is not None and bucket >= self.cascade.min_group_rows

    def sizes(self, bucket: int, cascade: bool) -> dict[str, int]:
        """The staged fields a graph reads, in staging order."""
        sizes = decode_sizes(bucket)
        return sizes | graph_sizes(bucket, self.cascade) if cascade else sizes

    def graph_views(self, ring: int, bucket: int, cascade: bool) -> dict[str, torch.Tensor]:
        """The inputs the (bucket, ring slot) graph reads: the ring slot's or the graphs' own."""
        sizes = self.sizes(bucket, cascade)
        return self.stager.views(ring, sizes) if self.per_ring_slot else sliced_views(self.inputs, sizes)

    def feed(self, bucket: int, ring: int, cascade: bool) -> int:
        """Make the step staged in ring slot `ring` the graph's inputs; returns the ring slot the
        graphs are keyed by. On the current (forward) stream: the copy runs after the wait for
        the staged inputs (read-after-write) and after the previous replay's reads of `inputs`
        (write-after-read, one stream); the ring slot's `consumed` is recorded after it."""
        if self.per_ring_slot:
            return ring
        end = self.input_ints[(bucket, cascade)]
        self.inputs[:end].copy_(self.stager.device[ring][:end], non_blocking=True)
        return 0

    def forward(self, views: dict[str, torch.Tensor], bucket: int, cascade: bool = False) -> torch.Tensor:
        """The captured work; also what a replay recomputes. Returns logits [bucket, V]."""
        req_slots = views["req_slots"]
        input_ids = self.future_map.resolve(req_slots) if self.resolve_in_graph else self.input_ids[bucket]
        self.table.write_on_device(req_slots, views["positions"], views["out_cache_loc"])
        fb = ForwardBatch(
            input_ids=input_ids, positions=views["positions"], out_cache_loc=views["out_cache_loc"],
            req_slots=req_slots, seq_lens=views["seq_lens"], prefix_lens=views["seq_lens"],
            qo_indptr=views["seq_lens"], req_to_token=self.table.table,
            host_req_slots=[0] * bucket, host_seq_lens=[1] * bucket, host_extend_lens=[1] * bucket,
            is_decode=True, max_seq_len=self.max_seq_len,
            cascade=graph_inputs(views, self.cascade) if cascade else None)
        hidden = self.model(fb, self.kv, self.backend)
        if self.draft is not None:
            self.draft.mirror(fb)  # the draft's KV is valid wherever the target's is
        return self.model.compute_logits(hidden, out=self.logits[:bucket])

    @torch.no_grad()
    def capture(self) -> None:
        # The graphs' memory pool; the prefill graphs capture into it too (all replays are
        # ordered on the one forward stream, and every output lives outside the pool).
        self.pool = pool = torch.cuda.graph_pool_handle()
        for cascade in (False, True):
            buckets = [b for b in self.buckets if not cascade or self.has_cascade(b)]

            def one(ring: int, bucket: int, views: dict[str, torch.Tensor], pool, cascade=cascade) -> None:
                self.graphs[(bucket, ring, cascade)] = warm_and_capture(
                    lambda: self.forward(views, bucket, cascade), pool, self.streams.forward)
            self.memory_bytes += capture_all(
                self.streams, buckets, self.stager.depth if self.per_ring_slot else 1,
                lambda ring, bucket, cascade=cascade: self.graph_views(ring, bucket, cascade), one, pool)
        log.info("captured %d decode graphs (buckets up to %d, cascade %s) using %.0f MiB",
                 len(self.graphs), self.max_batch, "on" if self.cascade else "off", self.memory_bytes / 2**20)

    def close(self) -> None:
        """Free the graphs; their private memory pool goes back once no graph uses it."""
        for graph, _ in self.graphs.values():
            graph.reset()
        self.graphs.clear()
        self.input_ids.clear()
        self.logits = self.inputs = None

    def replay(self, bucket: int, ring: int, req_slots: torch.Tensor, cascade: bool = False) -> torch.Tensor:
        """Queue the graph on the current (forward) stream; returns its logits buffer.
        `req_slots` are the staged slots the graph reads (used here only in debug mode);
        `cascade`: the graph reading the cascade layout staged after the decode fields."""
        graph, logits = self.graphs[(bucket, self.feed(bucket, ring, cascade), cascade)]
        if not self.resolve_in_graph:
            self.input_ids[bucket].copy_(self.future_map.resolve(req_slots))
        graph.replay()
        return logits
