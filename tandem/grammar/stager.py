"""Token masks to the device: a pinned host ring, a device ring, the schedule stream.

Lifetimes, as in InputStager (both rings `depth` deep, indexed by step):
- host slot N % depth is refilled for step N + depth, after step N + depth - 1's result was
  processed; that implies step N's sampling ran, which waited for this slot's copy.
- device slot N % depth is overwritten only after the sampling that read it recorded
  `consumed` on the forward stream (write-after-read).
"""
import torch

from tandem.overlap.streams import StreamSet


class MaskStager:
    def __init__(self, streams: StreamSet, max_rows: int, vocab_size: int, depth: int = 2) -> None:
        self.streams, self.depth = streams, depth
        width = (vocab_size + 31) // 32
        self.host = [torch.empty((max_rows, width), dtype=torch.int32, pin_memory=streams.pin())
                     for _ in range(depth)]
        self.device = [torch.empty((max_rows, width), dtype=torch.int32, device=streams.device)
                       for _ in range(depth)]
        self.ready = [streams.event() for _ in range(depth)]
        self.consumed = [streams.event() for _ in range(depth)]

    def host_rows(self, step: int, n: int) -> torch.Tensor:
        return self.host[step % self.depth][:n]

    def copy(self, step: int, n: int) -> tuple[torch.Tensor, object]:
        """Queue the host rows' copy; returns the device rows and the event sampling waits on."""
        i, schedule = step % self.depth, self.streams.schedule
        with self.streams.use(schedule):
            schedule.wait_event(self.consumed[i])  # write-after-read on device[i]
            self.device[i][:n].copy_(self.host[i][:n], non_blocking=True)
            self.ready[i].record(schedule)
        return self.device[i][:n], self.ready[i]

    def mark_consumed(self, step: int) -> None:
        """After the step's sampling was queued on the forward stream (its last read)."""
        self.consumed[step % self.depth].record(self.streams.forward)
