"""The engine's view of its process group: one process (nothing to do), rank 0 (starts and
supervises the workers, sends each step), or a worker (receives each step).

Start-up order on every rank: load this rank's shard -> agree on the KV pool size (the
smallest any rank can hold) -> join the process group -> build the loop (CUDA graphs with
the collectives inside) -> ready. Everything that can fail on one rank while the others
wait goes through the rendezvous store, which rank 0 polls while watching its workers, so
a failure anywhere becomes one clear error on rank 0 and never a hang in a collective.
"""
from __future__ import annotations

import datetime
import logging
import os
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from tandem.distributed.group import SINGLE, TPGroup

log = logging.getLogger("tandem")

_POLL_S = 0.05


class WorkerDiedError(RuntimeError):
    """A tensor-parallel worker process is gone; the engine cannot continue."""


@dataclass
class RankInfo:
    rank: int
    size: int
    local_rank: int
    store_host: str
    store_port: int
    store_prefix: str = ""  # the group's keys in a store others share (torchrun's agent's)


class SingleProcess:
    """tensor_parallel_size == 1: every hook is a no-op."""

    tp: TPGroup = SINGLE
    sender = None
    failure: str | None = None

    def agree_min(self, key: str, value: int) -> int:
        return value

    def connect(self, device: torch.device) -> None:
        pass

    def ready(self) -> None:
        pass

    def plan_source(self, scheduler, on_admit, tier=None):
        """Who plans this rank's steps: its own scheduler (a worker's runtime says otherwise)."""
        return scheduler

    def check(self, grace_s: float = 0.0) -> None:
        pass

    def close(self) -> None:
        pass


class Rendezvous:
    """Per-rank keys in the torch.distributed TCPStore, read by polling (so waits can watch
    for errors and dead processes instead of blocking)."""

    def __init__(self, store: dist.Store, info: RankInfo, timeout_s: float, watch=lambda: None):
        self.store, self.info, self.timeout_s, self.watch = store, info, timeout_s, watch

    def publish(self, key: str, value: str) -> None:
        self.store.set(f"{key}/{self.info.rank}", value)

    def fail(self, message: str, linger_s: float = 0.0) -> None:
        """Report a start-up failure, then wait up to `linger_s` until rank 0 has read it:
        torchrun stops the whole group once one rank exits, which could cut rank 0 short."""
        self.store.set(f"error/{self.info.rank}", message)
        deadline = time.monotonic() + linger_s
        while time.monotonic() < deadline and not self.store.check([f"error_seen/{self.info.rank}"]):
            time.sleep(_POLL_S)

    def gather(self, key: str) -> list[str]:
        keys = [f"{key}/{r}" for r in range(self.info.size)]
        deadline = time.monotonic() + self.timeout_s
        while not self.store.check(keys):
            self.poll()
            if time.monotonic() > deadline:
                missing = [k for k in keys if not self.store.check([k])]
                raise TimeoutError(f"tensor-parallel start-up: no {', '.join(missing)} after "
                                   f"{self.timeout_s:.0f}s")
            time.sleep(_POLL_S)
        return [self.store.get(k).decode() for k in keys]

    def poll(self) -> None:
        """Raise if any rank reported a start-up failure (or `watch` finds a problem)."""
        for r in range(self.info.size):
            err = f"error/{r}"
            if self.store.check([err]):
                message = f"tensor-parallel rank {r} failed to start: {self.store.get(err).decode()}"
                if r != self.info.rank:
                    log.error("%s", message)  # said before the rank may exit (torchrun then stops us)
                    self.store.set(f"error_seen/{r}", "1")
                raise RuntimeError(message)
        self.watch()

    def agree_min(self, key: str, value: int) -> int:
        """The smallest `value` any rank brings (every rank gets the same answer)."""
        self.publish(key, str(value))
        return min(int(v) for v in self.gather(key))

    def join(self, device: torch.device) -> None:
        """Join the default process group: NCCL on CUDA (NVLink multicast off), gloo on the CPU."""
        if dist.is_initialized():
            raise RuntimeError("torch.distributed is already initialized in this process; one "
                               "tensor-parallel engine per process")
        cuda, info = device.type == "cuda", self.info
        dist.init_process_group("nccl" if cuda else "gloo", store=dist.PrefixStore("pg", self.store),
                                rank=info.rank, world_size=info.size,
                                timeout=datetime.timedelta(seconds=self.timeout_s),
                                device_id=torch.device("cuda", info.local_rank) if cuda else None)


def open_store(info: RankInfo, is_master: bool, timeout_s: float) -> tuple[dist.TCPStore, dist.Store]:
    """The rendezvous store (its port is the one it got when `info.store_port` is 0) and the
    group's view of it (under `info.store_prefix`)."""
    tcp = dist.TCPStore(info.store_host, info.store_port, info.size, is_master=is_master,
                        wait_for_workers=False, timeout=datetime.timedelta(seconds=timeout_s))
    return tcp, (dist.PrefixStore(info.store_prefix, tcp) if info.store_prefix else tcp)


def parallel_env() -> None:
    """NCCL's NVLink multicast (NVLS) and symmetric-memory multicast stay off: set for this
    process and inherited by the workers it starts."""
    os.environ["NCCL_NVLS_ENABLE"] = "0"
    os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"
