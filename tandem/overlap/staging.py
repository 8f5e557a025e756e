"""Host-to-device staging of a step's integer metadata: one pinned buffer, one async copy.

Two rings, both `depth` deep:
- pinned host buffers: the CPU writes step N's metadata into slot N % depth once the copy that
  last read the slot has run (`copied`). That copy was step N - depth's, whose result is
  usually processed by then (its forward, hence its copy, completed: the event has fired), but
  a step staged in the wait for step N - depth (`ModelRunner.stage_ahead`) comes before that
  result, and a step staged ahead then dropped leaves a copy its retry must not overwrite.
- device buffers: the schedule stream copies into slot N % depth only after the forward that
  last read it signalled `consumed` (write-after-read), or after the whole forward stream
  (`coarse=True`).

Every field starts on a 16-byte boundary: Triton specializes a kernel on whether each pointer
argument is 16-byte aligned, so views at whatever offset the earlier fields left would compile
a new variant of a kernel for each parity pattern met while serving (measured on the H200: the
cascade kernels compiled 5 variants, 2.8 s, in a steady-state run).
"""
from collections.abc import Sequence

import numpy as np
import torch

from tandem.overlap.streams import StreamSet, host_wait


ALIGN_INTS = 2  # 16 bytes of int64
MAX_FIELDS = 64  # alignment padding is at most ALIGN_INTS - 1 ints a field


def field_offsets(sizes: dict[str, int]) -> tuple[dict[str, int], int]:
    """Each field's start (ints, a multiple of ALIGN_INTS), in dict order, and the end of the last."""
    offsets, start = {}, 0
    for name, size in sizes.items():
        offsets[name] = start
        start += -(-size // ALIGN_INTS) * ALIGN_INTS
    return offsets, start


class InputStager:
    def __init__(self, streams: StreamSet, capacity: int, depth: int = 2, coarse: bool = False):
        self.streams, self.depth, self.coarse = streams, depth, coarse
        self.capacity = capacity + (ALIGN_INTS - 1) * MAX_FIELDS
        self.host = [torch.zeros(self.capacity, dtype=torch.int64, pin_memory=streams.pin())
                     for _ in range(depth)]
        self.device = [torch.zeros(self.capacity, dtype=torch.int64, device=streams.device)
                       for _ in range(depth)]
        self.consumed = [streams.event() for _ in range(depth)]
        self.copied = [streams.event() for _ in range(depth)]  # the last copy out of host[i] ran

    def stage(self, step: int, fields: dict[str, Sequence[int]]) -> dict[str, torch.Tensor]:
        """Copy the named int lists (or int64 arrays) to the device; returns device views by name."""
        sizes = {name: len(v) for name, v in fields.items()}
        assert len(sizes) <= MAX_FIELDS, "the capacity's alignment slack counts MAX_FIELDS fields"
        offsets, total = field_offsets(sizes)
        if total > self.capacity:
            raise RuntimeError(f"step metadata needs {total} ints, staging holds {self.capacity}")
        i = step % self.depth
        host, dev = self.host[i], self.device[i]
        if not self.copied[i].query():  # write-after-read on host[i]; fired but for a step staged ahead
            host_wait(self.copied[i])
        flat = host.numpy()
        for name, values in fields.items():
            flat[offsets[name]:offsets[name] + sizes[name]] = values
        schedule = self.streams.schedule
        with self.streams.use(schedule):
            if self.coarse:
                schedule.wait_stream(self.streams.forward)
            else:
                schedule.wait_event(self.consumed[i])  # write-after-read on dev[i]
            dev[:total].copy_(host[:total], non_blocking=True)
            self.copied[i].record(schedule)
        return _sliced(dev, offsets, sizes)

    def views(self, ring_slot: int, sizes: dict[str, int]) -> dict[str, torch.Tensor]:
        """Device views of ring slot `ring_slot`, fields in dict order, each 16-byte aligned.
        The same sizes give the same addresses: CUDA graphs read their inputs here."""
        return sliced_views(self.device[ring_slot], sizes)

    def mark_consumed(self, step: int) -> None:
        """Called on the forward stream after the last read of step `step`'s inputs."""
        self.consumed[step % self.depth].record(self.streams.forward)


def ragged_columns(starts: list[int], lengths: list[int], req_slots: list[int],
                   pad: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Per token of rows laid out one after another (row i: `lengths[i]` tokens from position
    `starts[i]`, request slot `req_slots[i]`): its position and its row's request slot, then
    `pad` zeros in each. Made in numpy: as Python lists (a range and a repeat a row, then the
    stager's conversion) they cost ~40 ns a token, and a long prefill step stages ~8k of each."""
    n = np.asarray(lengths, dtype=np.int64)
    total = int(n.sum())
    positions, slots = np.zeros(total + pad, dtype=np.int64), np.zeros(total + pad, dtype=np.int64)
    if total:
        first = np.cumsum(n) - n  # each row's first token in the step
        positions[:total] = np.arange(total) + np.repeat(np.asarray(starts, dtype=np.int64) - first, n)
        slots[:total] = np.repeat(np.asarray(req_slots, dtype=np.int64), n)
    return positions, slots


def sliced_views(buffer: torch.Tensor, sizes: dict[str, int]) -> dict[str, torch.Tensor]:
    """Views of `buffer` laid out as the stager lays out fields of these sizes."""
    return _sliced(buffer, field_offsets(sizes)[0], sizes)


def _sliced(buffer: torch.Tensor, offsets: dict[str, int], sizes: dict[str, int]) -> dict[str, torch.Tensor]:
    return {name: buffer[offsets[name]:offsets[name] + size] for name, size in sizes.items()}
