"""Streams and events that are real on CUDA and no-ops on the CPU.

The overlap loop is written once against this small surface, so the identical loop runs
(and is tested) on CPU-only CI: there every call completes in order, synchronously.
"""
import contextlib
from dataclasses import dataclass

import torch


class NullEvent:
    def record(self, stream=None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def elapsed_time(self, other: "NullEvent") -> float:
        return 0.0


class NullStream:
    def wait_stream(self, other) -> None:
        pass

    def wait_event(self, event) -> None:
        pass

    def synchronize(self) -> None:
        pass


def host_int64(values, pin: bool) -> torch.Tensor:
    """A host int64 tensor holding `values` (a list of ints), pinned when `pin` (its copy to the
    device can then be async). Filled through numpy: 16 ns an int against torch.tensor(list)'s
    50 on the CPU box, for the tier's slot lists, a request's history and its outputs."""
    out = torch.empty(len(values), dtype=torch.int64, pin_memory=pin)
    out.numpy()[:] = values
    return out


def device_int64(values, device: torch.device) -> torch.Tensor:
    """`values` (a list of ints) on `device` as int64, copied asynchronously from pinned memory on
    CUDA (the caching host allocator keeps the source alive until the copy ran)."""
    return host_int64(values, device.type == "cuda").to(device, non_blocking=True)


def host_wait(event) -> None:
    """Block the host until `event` has completed. The loop's sanctioned waits go through here,
    exempt from sync-debug mode (which guards everything else in the loop)."""
    mode = torch.cuda.get_sync_debug_mode() if isinstance(event, torch.cuda.Event) else 0
    if mode:
        torch.cuda.set_sync_debug_mode(0)
    try:
        event.synchronize()
    finally:
        if mode:
            torch.cuda.set_sync_debug_mode(mode)


@dataclass
class StreamSet:
    """schedule: host-to-device metadata; forward: model + sampling; copy: device-to-host."""

    device: torch.device
    schedule: object
    forward: object
    copy: object

    @staticmethod
    def create(device: torch.device) -> "StreamSet":
        if device.type == "cuda":
            return StreamSet(device, torch.cuda.Stream(device), torch.cuda.Stream(device),
                             torch.cuda.Stream(device))
        return StreamSet(device, NullStream(), NullStream(), NullStream())

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"

    def use(self, stream):
        """Make `stream` current for the ops inside the block."""
        return torch.cuda.stream(stream) if self.is_cuda else contextlib.nullcontext()

    def event(self, timing: bool = False):
        return torch.cuda.Event(enable_timing=timing) if self.is_cuda else NullEvent()

    def record_stream(self, tensor: torch.Tensor, stream) -> None:
        """Tell the caching allocator `tensor` is used on `stream` (no reuse before it passes)."""
        if self.is_cuda:
            tensor.record_stream(stream)

    def pin(self) -> bool:
        return self.is_cuda
