"""FutureMap: sampled token ids that stay on the device, indexed by request slot.

Step N's sampled ids are step N+1's decode inputs, and the host has not seen them yet. The
forward stream writes them here after sampling (`stash`) and the next forward reads them
back (`resolve`); both on the forward stream, so ordering is free. Slot 0 is a padding slot
(CUDA-graph padding rows read it harmlessly).
"""
import torch


class FutureMap:
    def __init__(self, max_slots: int, device: torch.device, debug: bool = False):
        self.debug = debug
        # Debug: -1 marks "no token written"; a resolve of it fails on the device.
        self.buf = torch.full((max_slots + 1,), -1 if debug else 0, dtype=torch.int64, device=device)
        self.buf[0] = 0
        # Debug: the map as the stashes left it, without the read marks (see forget_reads).
        self.stashed = self.buf.clone() if debug else None

    def stash(self, slots: torch.Tensor, token_ids: torch.Tensor) -> None:
        self.buf[slots] = token_ids
        if self.stashed is not None:
            self.stashed[slots] = token_ids

    def stash_buffers(self) -> tuple[torch.Tensor, torch.Tensor]:
        """What `stash` writes, for a kernel that stashes in place (`kernels.spec_settle`): the
        map and its debug copy (the map again without debug: a second store of the same value)."""
        return self.buf, self.buf if self.stashed is None else self.stashed

    def forget_reads(self) -> None:
        """Debug: a rolled-back step's reads did not happen; its retry reads the same slots
        again. Without debug reads mark nothing, so there is nothing to undo. Queue it on the
        forward stream, where the reads were."""
        if self.stashed is not None:
            self.buf.copy_(self.stashed)

    def resolve(self, slots: torch.Tensor) -> torch.Tensor:
        ids = self.buf[slots]
        if self.debug:
            torch._assert_async(((ids >= 0) | (slots == 0)).all(),
                                "FutureMap: read of a slot with no stashed token")
            self.buf.index_fill_(0, slots, -1)  # a second read without a stash fails too (no host copy)
            self.buf[:1].zero_()  # padding slot stays valid (a device op: capturable in a graph)
        return ids
