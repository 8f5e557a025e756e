"""Copies between the device KV pool and its host tier, on a stream of their own.

Every copy moves the slots' K and V in each cache the pool's slots index (the target's, and a
draft model's when there is one: `HostKVPool`), in one chunked transfer per run of host slots
and one indexed copy per cache between the device staging and the pool (every layer at once:
`KVCache.per_pool`; a launch per layer cost the processing window ~56 launches a copy). The
rules below hold for each cache alike (a cache is only ever read or written at these slots by
the same steps as the target's).

Ordering and lifetime rules (docs/async-model.md, "Host KV tier"). Every copy has a number
(`seq`, in queueing order); the copies run in that order on this one stream, so waiting for
copy s on the device waits for every copy before it too.
- Write-back (GPU -> host) reads GPU slots of unreferenced tree nodes. Every step that wrote
  or read them has completed (a node is unlocked only once its requests were released, after
  their last step completed), so the copy needs no wait on the forward stream.
- Those GPU slots, once evicted, cool in the allocator (`SlotAllocator.free(after_copy=s)`):
  a plan that takes one makes the next forward wait for copy s (`fence`), so the reuse is
  ordered after the copy that reads them. A forward that takes none does not wait for it.
- Load-back (host -> GPU) writes freshly allocated GPU slots (no queued step reads them: same
  argument; a cooling slot's earlier copy runs before it on this stream) and the forward of
  the first admission that reads them waits for that load (`PrefixCache.admit` -> `require`).
  A later reader's forward is ordered after that one on the forward stream.
- Host buffers: every copy that reads or writes a host slot runs on this one stream, so a
  host slot freed and handed out again is overwritten only after earlier copies touched it.
- Pinned index tensors and device staging stay alive until the copy's end event has passed
  (`collect`, polled in the processing window: no host waits).
- Tensor parallelism: rank 0's plan carries its copies (`fence` returns them, the step message
  sends them) and each rank queues the same ones on its own shard before that step's forward.
  A worker's write-back reads slots whose last step rank 0 has seen complete; that step's
  collectives could not complete before this rank's kernels ahead of them (its KV writes and
  reads) had run, so the same rule holds on every rank.
On the CPU the stream and events are no-ops and every copy completes in order.
"""
from __future__ import annotations

import bisect
import operator
import statistics
from collections import deque
from dataclasses import dataclass, field
from time import perf_counter

import torch

from tandem.memory.host_kv import HostKVPool, contiguous_runs
from tandem.memory.kv_cache import KVCache, byte_view
from tandem.overlap.streams import NullStream, StreamSet, host_int64

CHUNK_BYTES = 128 << 20  # device staging per transfer: large enough for full PCIe bandwidth


@dataclass
class _InFlight:
    seq: int  # its number: copies run in this order on the copy stream
    kind: str  # "load" or "write_back"
    start: object
    end: object
    num_bytes: int
    keep_alive: list = field(default_factory=list)  # pinned indices, device staging
    host_seconds: float = 0.0  # CPU: the copy ran synchronously in this long


@dataclass
class TierWait:
    """A forward's device wait for host-tier copies (`KVTierCopier.fence`, timed): events
    around the wait on the forward stream, and why it waited (the timeline's copy stall)."""

    before: object  # passes once the forward stream reaches the wait
    after: object  # passes once the copies waited for are done too
    cause: str  # what made the forward depend on the copy (`KVTierCopier.require`)
    pending_bytes: int  # bytes of the copies waited for (and those before them) not done at the fence


@dataclass
class TierCopyStats:
    load_tokens: int = 0
    load_bytes: int = 0
    load_seconds: float = 0.0  # device time of completed loads
    write_back_tokens: int = 0
    write_back_bytes: int = 0
    write_back_seconds: float = 0.0
    fence_waits: int = 0  # forwards made to wait for a copy (`KVTierCopier.fence`)


PACE_PERIODS = 9  # the step period is the median of this many: one stalled step does not move it
MAX_PERIOD_S = 0.05  # an idle engine's gap between steps is not a step's length
MEASURED_BYTES = 256 << 20  # below this a direction's timed copies are too few for a rate
_SEQ = operator.attrgetter("seq")  # an in-flight record's copy number: `KVTierCopier._uncollected`
# A window's share of the step period. While every forward waited for every copy queued, a
# window that used it all stalled the forwards (H200, 37775e3: 1.36 s of 31.9), so it was 0.5.
# Forwards now wait only for the copies they depend on (6fa100a), and a request is admitted
# only once its prefetched loads completed; a half-step window then left late turns' long
# histories to admission loads (H100, 0d81c5e: 0.5 -> 0.9 took them 25k -> 3k tokens, copy
# stall 34 -> 9 ms, GPU busy 0.9974 -> 0.9987 against 0.9991 without the tier). Below 1: the
# loads a step's admissions read are done before its plan, and the copy stream's gathers share
# the GPU with the forward.
WINDOW_SHARE = 0.9


@dataclass
class CopyPace:
    """What one processing window may queue on the copy stream (prefetch loads, write-ahead):
    what it moves while one step runs, the measured bandwidth times the step period. A window
    queueing more than a step's worth falls behind: the copies a later forward depends on
    (`KVTierCopier.fence`: the loads it reads, the write-backs of slots it takes) queue behind
    it, and the forward waits (H200, 911a469, when every forward waited for every copy: windows
    of up to a prefill step's tokens each way, ~0.9 GB, ~23 ms beside ~6 ms steps, took GPU busy
    from 0.95 to 0.83). Both directions run on the one copy stream, one after the other, so a
    window's budget is one step period for both together (`window`)."""

    token_bytes: int
    most_tokens: int  # a prefill step's
    least_tokens: int = 256  # progress even while the estimate is tiny
    assumed_bytes_per_s: float = 20e9  # until a direction has MEASURED_BYTES timed
    # Step periods by the kind of step they timed (True: with prefill rows): a decode-only step
    # beside prefill steps is several times shorter, and a window sized by their common median
    # overran it.
    periods: dict = field(default_factory=lambda: {kind: deque(maxlen=PACE_PERIODS) for kind in (False, True)})
    last_window: float | None = None
    last_kind: bool = False

    def tick(self, now: float, prefill: bool = False) -> None:
        """A processing window begins (once a step, after launching a step with prefill rows or
        not): the gap since the last window is the period of the step launched before it, the
        one then in flight."""
        if self.last_window is not None:
            self.periods[self.last_kind].append(min(now - self.last_window, MAX_PERIOD_S))
        self.last_window, self.last_kind = now, prefill

    def window(self, shared: bool = True) -> "WindowBudget":
        """This window's copy time: WINDOW_SHARE of the period of steps of the kind now in flight
        (the last `tick`'s), spent by both directions in turn (`shared`; off, the experiment's A/B: that
        much each, which the one stream runs back to back)."""
        periods = self.periods[self.last_kind] or self.periods[not self.last_kind]
        return WindowBudget(self, WINDOW_SHARE * statistics.median(periods) if periods else None, shared)


@dataclass
class WindowBudget:
    """One processing window's copy seconds (None: no step period measured yet: every ask gets
    the pace's least tokens). `spend` takes what a direction queued off a shared budget."""

    pace: CopyPace
    seconds: float | None
    shared: bool

    def tokens(self, *bytes_per_s: float | None) -> int:
        """Tokens that fit in what is left when each one costs a copy at every rate given (a
        prefetch that may evict: a write-back, then a load)."""
        pace = self.pace
        if self.seconds is None:
            return pace.least_tokens
        per_token = sum(pace.token_bytes / (rate or pace.assumed_bytes_per_s) for rate in bytes_per_s)
        return max(pace.least_tokens, min(pace.most_tokens, int(max(self.seconds, 0.0) / per_token)))

    def spend(self, num_bytes: int, bytes_per_s: float | None) -> None:
        if self.shared and self.seconds is not None:
            self.seconds -= num_bytes / (bytes_per_s or self.pace.assumed_bytes_per_s)


class KVTierCopier:
    def __init__(self, caches: list[KVCache], host: HostKVPool, streams: StreamSet, precise: bool = True):
        assert len(caches) == len(host.shapes), "one host part per cache"
        self.caches, self.host, self.streams = list(caches), host, streams
        self.stream = torch.cuda.Stream(streams.device) if streams.is_cuda else NullStream()
        self.chunk_tokens = max(1, CHUNK_BYTES // host.token_bytes)
        self.stats = TierCopyStats()
        self._in_flight: list[_InFlight] = []
        self._unfenced: list[tuple[str, list[int], list[int]]] = []  # (kind, gpu, host) since the last fence
        self.seq = 0  # the last copy queued
        self.required = 0  # the latest copy a forward queued from now on must wait for (`require`)
        self.required_cause = ""  # why the forward depends on that copy (`require`'s cause)
        self.fenced = 0  # the latest copy the forward stream has waited for (or found complete)
        self.precise = precise  # False: every forward waits for every copy queued before it (the A/B)
        self.fenced_tokens = (0, 0)  # (loaded, written back) behind the last fence: the timeline's
        self.fence_wait: TierWait | None = None  # the last fence's wait (timed fences)
        self._timed = {"load": [0, 0.0], "write_back": [0, 0.0]}  # completed bytes, copy seconds (CopyPace)

    # ---- the two directions ----
    def write_back(self, gpu_slots: list[int], host_slots: list[int]) -> int:
        """Queue GPU slots -> host slots (same order). Returns the copy's number."""
        queued = self._copy("write_back", gpu_slots, host_slots)
        self.stats.write_back_tokens += len(gpu_slots)
        self.stats.write_back_bytes += queued.num_bytes
        self._unfenced.append(("write_back", gpu_slots, host_slots))
        return queued.seq

    def load(self, host_slots: list[int], gpu_slots: list[int]) -> int:
        """Queue host slots -> GPU slots (same order). Returns the copy's number."""
        queued = self._copy("load", gpu_slots, host_slots)
        self.stats.load_tokens += len(gpu_slots)
        self.stats.load_bytes += queued.num_bytes
        self._unfenced.append(("load", gpu_slots, host_slots))
        return queued.seq

    def require(self, seq: int, cause: str = "load") -> None:
        """The next forward reads or writes what copy `seq` touches: it waits for it (`fence`).
        `cause` names why, for the timeline ("load": it reads what the copy loads; "slot_reuse":
        it writes slots the copy reads; "rank0": a tensor-parallel worker follows rank 0)."""
        if seq > self.required:
            self.required, self.required_cause = seq, cause

    def done(self, seq: int) -> bool:
        """Copy `seq` has completed (its end event passed, or it was collected). Never waits."""
        copy = self._uncollected(seq)
        return copy is None or copy.end.query()

    def _uncollected(self, seq: int) -> _InFlight | None:
        """Copy `seq`'s record while `collect` has not dropped it (None: its end event passed).
        The records are in copy order (`_copy` appends, `collect` keeps the order): a bisection,
        not a scan (a window's write-ahead queues a copy a node; asked for each admission)."""
        records = self._in_flight
        at = bisect.bisect_left(records, seq, key=_SEQ)
        return records[at] if at < len(records) and records[at].seq == seq else None

    def _copy(self, kind: str, gpu_slots: list[int], host_slots: list[int]) -> _InFlight:
        assert len(gpu_slots) == len(host_slots)
        self.seq += 1
        record = _InFlight(self.seq, kind, self.streams.event(timing=True), self.streams.event(timing=True),
                           len(gpu_slots) * self.host.token_bytes)
        t0 = perf_counter()
        with self.streams.use(self.stream):
            record.start.record(self.stream)
            for at in range(0, len(gpu_slots), self.chunk_tokens):
                g, h = gpu_slots[at:at + self.chunk_tokens], host_slots[at:at + self.chunk_tokens]
                if kind == "load":
                    self._load_chunk(h, g, record.keep_alive)
                else:
                    self._write_back_chunk(g, h, record.keep_alive)
            record.end.record(self.stream)
        record.host_seconds = perf_counter() - t0
        self._in_flight.append(record)
        return record

    def _device_index(self, slots: list[int], keep_alive: list) -> torch.Tensor:
        src = host_int64(slots, self.streams.pin())
        keep_alive.append(src)  # read by the async H2D until the copy's end event
        return src.to(self.streams.device, non_blocking=True)

    def _write_back_chunk(self, gpu_slots: list[int], host_slots: list[int], keep_alive: list) -> None:
        idx = self._device_index(gpu_slots, keep_alive)
        staging = self._staging(len(gpu_slots), keep_alive)  # one row per token, the host rows' layout
        for pools, rows in self._pools_and_rows(staging):
            torch.index_select(pools, 1, idx, out=rows)  # gathers straight into the staging's layout
        for at, first, n in contiguous_runs(host_slots):
            self.host.data[first:first + n].copy_(staging[at:at + n], non_blocking=True)

    def _load_chunk(self, host_slots: list[int], gpu_slots: list[int], keep_alive: list) -> None:
        idx = self._device_index(gpu_slots, keep_alive)
        staging = self._staging(len(gpu_slots), keep_alive)
        for at, first, n in contiguous_runs(host_slots):
            staging[at:at + n].copy_(self.host.data[first:first + n], non_blocking=True)
        for pools, rows in self._pools_and_rows(staging):
            pools.index_copy_(1, idx, rows)

    def _pools_and_rows(self, staging: torch.Tensor):
        """(a cache's every K and V pool [2 * layers, slots, heads * dim], its part of `staging`
        as [2 * layers, tokens, heads * dim]) for every cache: one indexed copy moves a chunk's
        tokens in every layer of a cache (the host rows' layout is each cache's K of every layer,
        then its V: the pools' order)."""
        for c, kv in enumerate(self.caches):
            part = self.host.part(staging, c)
            # Bytes for an e4m3 pool: the CPU has no float8 index_copy_, and a copy is exact either way.
            yield byte_view(kv.per_pool()), byte_view(part.view(part.shape[0], part.shape[1], -1).transpose(0, 1))

    def _staging(self, n: int, keep_alive: list) -> torch.Tensor:
        """Device rows for n tokens (allocated on the copy stream; kept until the copy's end
        event: the async D2H / H2D reads or writes it)."""
        staging = torch.empty((n, self.host.data.shape[1]), dtype=self.host.data.dtype, device=self.streams.device)
        keep_alive.append(staging)
        return staging

    # ---- ordering and bookkeeping ----
    def fence(self, forward_stream, timed: bool = False) -> list[tuple[str, list[int], list[int]]]:
        """Before a step's forward is queued: it waits (on the device) for the latest copy it
        depends on (`required`: the loads it reads, the copies of slots it may overwrite; with
        `precise` off, every copy queued so far), unless the forward stream waited for that one
        already or it is complete. Returns the copies queued since the last fence as (kind,
        gpu_slots, host_slots), in order (tensor-parallel ranks replay them, then `require`
        this fence's `fenced`). `timed`: timing events around a wait go to `fence_wait` (the
        timeline's copy stall)."""
        copies, self._unfenced = self._unfenced, []
        self.fenced_tokens = (sum(len(g) for k, g, _ in copies if k == "load"),
                              sum(len(g) for k, g, _ in copies if k == "write_back"))
        self.fence_wait = None
        if not self.precise:
            self.required = self.seq
        if self.required <= self.fenced:
            return copies
        self.fenced = self.required
        copy = self._uncollected(self.required)
        if copy is None:
            return copies
        self.stats.fence_waits += 1
        if not timed:
            forward_stream.wait_event(copy.end)  # device-side order: no host wait
            return copies
        wait = TierWait(self.streams.event(timing=True), self.streams.event(timing=True), self.required_cause,
                        self._pending_bytes(self.required))
        wait.before.record(forward_stream)
        forward_stream.wait_event(copy.end)
        wait.after.record(forward_stream)
        self.fence_wait = wait
        return copies

    def _pending_bytes(self, seq: int) -> int:
        """Bytes of copies up to `seq` whose end events have not passed (asks, never waits)."""
        return sum(r.num_bytes for r in self._in_flight if r.seq <= seq and not r.end.query())

    def queued_bytes(self) -> tuple[int, int]:
        """(load, write-back) bytes queued so far: a window's share is the difference."""
        return self.stats.load_bytes, self.stats.write_back_bytes

    def replay(self, kind: str, gpu_slots: list[int], host_slots: list[int]) -> None:
        """A copy rank 0 queued, on this rank's shard (tensor parallelism)."""
        if kind == "load":
            self.load(host_slots, gpu_slots)
        else:
            self.write_back(gpu_slots, host_slots)

    def collect(self) -> None:
        """In the processing window: account copies whose end event passed and drop what they
        kept alive. Never waits."""
        still = []
        for record in self._in_flight:
            if not record.end.query():
                still.append(record)
                continue
            seconds = (record.start.elapsed_time(record.end) / 1e3 if self.streams.is_cuda
                       else record.host_seconds)
            if record.kind == "load":
                self.stats.load_seconds += seconds
            else:
                self.stats.write_back_seconds += seconds
            timed = self._timed[record.kind]
            timed[0], timed[1] = timed[0] + record.num_bytes, timed[1] + seconds
        self._in_flight = still

    def bytes_per_s(self, kind: str) -> float | None:
        """The rate completed copies of `kind` ("load", "write_back") achieved on the copy
        stream; None until MEASURED_BYTES were timed."""
        num_bytes, seconds = self._timed[kind]
        return num_bytes / seconds if num_bytes >= MEASURED_BYTES and seconds > 0 else None

    def reset_stats(self) -> None:
        """Start the figures from zero (after the warm-up; waits for the copy stream: start-up
        only, never in the loop)."""
        self.stream.synchronize()
        self.collect()
        self.stats = TierCopyStats()

    def close(self) -> None:
        """Everything queued finished (the engine synchronized): drop the keep-alives."""
        self._in_flight = []
