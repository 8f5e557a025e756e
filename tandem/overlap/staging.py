"""Host-to-device staging of a step's integer metadata: one pinned buffer, one async copy.

Two rings, both `depth` deep:
- pinned host buffers: the CPU writes step N's metadata into slot N % depth. Lifetime rule:
  that slot was last used by step N - depth, whose result was processed (copy_done implies
  its forward, hence its host-to-device copy, completed) before step N is planned.
- device buffers: the schedule stream copies into slot N % depth only after the forward that
  last read it signalled `consumed` (write-after-read), or after the whole forward stream
  (`coarse=True`).
"""
import itertools

import numpy as np
import torch

from tandem.overlap.streams import StreamSet


class InputStager:
    def __init__(self, streams: StreamSet, capacity: int, depth: int = 2, coarse: bool = False):
        self.streams, self.capacity, self.depth, self.coarse = streams, capacity, depth, coarse
        self.host = [torch.zeros(capacity, dtype=torch.int64, pin_memory=streams.pin())
                     for _ in range(depth)]
        self.device = [torch.zeros(capacity, dtype=torch.int64, device=streams.device)
                       for _ in range(depth)]
        self.consumed = [streams.event() for _ in range(depth)]

    def stage(self, step: int, fields: dict[str, list[int]]) -> dict[str, torch.Tensor]:
        """Copy the named int lists to the device; returns device views by name."""
        total = sum(len(v) for v in fields.values())
        if total > self.capacity:
            raise RuntimeError(f"step metadata needs {total} ints, staging holds {self.capacity}")
        i = step % self.depth
        host, dev = self.host[i], self.device[i]
        flat = np.fromiter(itertools.chain.from_iterable(fields.values()), dtype=np.int64, count=total)
        host.numpy()[:total] = flat
        schedule = self.streams.schedule
        with self.streams.use(schedule):
            if self.coarse:
                schedule.wait_stream(self.streams.forward)
            else:
                schedule.wait_event(self.consumed[i])  # write-after-read on dev[i]
            dev[:total].copy_(host[:total], non_blocking=True)
        return self.views(i, {name: len(v) for name, v in fields.items()})

    def views(self, ring_slot: int, sizes: dict[str, int]) -> dict[str, torch.Tensor]:
        """Device views of ring slot `ring_slot`, fields laid back to back in dict order.
        The same sizes give the same addresses: CUDA graphs read their inputs here."""
        views, start, dev = {}, 0, self.device[ring_slot]
        for name, size in sizes.items():
            views[name] = dev[start:start + size]
            start += size
        return views

    def mark_consumed(self, step: int) -> None:
        """Called on the forward stream after the last read of step `step`'s inputs."""
        self.consumed[step % self.depth].record(self.streams.forward)
