"""A tensor-parallel worker's runtime: its place in the group, its end of the step channel,
and `StepFollower`, which stands in for the scheduler so that the worker's engine runs the
same step loop as rank 0 on rank 0's plan. The process itself (`python -m
tandem.entrypoints.worker SPEC`, started by `start_worker`; the channel's secret comes in the
environment) lives with the entry points: it builds an Engine, which this package must not
import."""
from __future__ import annotations

import logging
import os
import subprocess
import sys

import msgspec
import torch
import torch.distributed as dist

from tandem.config import EngineConfig
from tandem.distributed.auth import SECRET_ENV
from tandem.distributed.channel import StepReceiver
from tandem.distributed.group import TPGroup
from tandem.distributed.runtime import RankInfo, Rendezvous, open_store
from tandem.distributed.wire import Stop
from tandem.scheduler.batch import ScheduledBatch

log = logging.getLogger("tandem")

# While no step comes, check this often that rank 0 is still there.
_IDLE_POLL_S = 1.0
# The worker process's main module: named, not imported (it imports the engine).
WORKER_MAIN = "tandem.entrypoints.worker"


class Spec(msgspec.Struct):
    """A worker's command line (JSON): its place in the group and the engine's config."""

    info: RankInfo
    config: EngineConfig


def start_worker(cfg: EngineConfig, info: RankInfo, secret: str) -> subprocess.Popen:
    spec = msgspec.json.encode(Spec(info, cfg)).decode()
    return subprocess.Popen([sys.executable, "-m", WORKER_MAIN, spec],
                            env={**os.environ, SECRET_ENV: secret})


class WorkerRuntime:
    """`linger_s`: after a start-up failure, wait that long for rank 0 to read it (`fail`)."""

    def __init__(self, info: RankInfo, timeout_s: float, device: torch.device, secret: str,
                 linger_s: float = 0.0):
        self.info, self.timeout_s, self.secret, self.linger_s = info, timeout_s, secret, linger_s
        self.parent = os.getppid()  # a spawned worker's rank 0 (torchrun's agent under torchrun)
        if device.type == "cuda":
            torch.cuda.set_device(info.local_rank)
        _, self.store = open_store(info, False, timeout_s)
        self.rdv = Rendezvous(self.store, info, timeout_s)
        self.tp = TPGroup(info.rank, info.size)
        self.sender, self.failure, self.receiver = None, None, None

    def agree_min(self, key: str, value: int) -> int:
        return self.rdv.agree_min(key, value)

    def connect(self, device: torch.device) -> None:
        self.rdv.join(device)

    def ready(self) -> None:
        self.rdv.publish("ready", "1")  # first: rank 0 challenges the workers once all are ready
        host, _, port = self.store.get("steps").decode().rpartition(":")
        self.receiver = StepReceiver.connect(host, int(port), self.info.rank, self.secret.encode(), self.timeout_s)

    def plan_source(self, scheduler, on_admit, tier=None) -> StepFollower:
        """A worker plans nothing: its engine steps rank 0's plan as it arrives."""
        return StepFollower(self, on_admit, tier)

    def check(self, grace_s: float = 0.0) -> None:
        pass

    def fail(self, exc: BaseException) -> None:
        """Tell rank 0 why this rank could not start (it reports it and stops the group)."""
        self.rdv.fail(f"{type(exc).__name__}: {exc}", self.linger_s)

    def close(self) -> None:
        if self.receiver is not None:
            self.receiver.close()
        if dist.is_initialized():
            dist.destroy_process_group()


class StepFollower:
    """A worker's scheduler: `schedule` hands the engine the step rank 0 planned (after the
    requests it admitted), so the worker keeps a step in flight exactly as rank 0 does: the
    same `Engine.step`. Everything a scheduler does with the results is rank 0's business."""

    running = waiting = ()  # Engine.stats(): a worker holds no requests of its own
    num_preemptions = steps_planned_ahead = 0

    def __init__(self, runtime: WorkerRuntime, on_admit, tier=None):
        self.runtime, self.on_admit = runtime, on_admit
        self.tier = tier  # this rank's KVTierCopier: rank 0's host-tier copies, on this rank's shard
        self.ended: str | None = None  # "stop" (rank 0 said so) or "gone" (rank 0 vanished)

    def schedule(self, step: int, process_in_flight) -> ScheduledBatch | None:
        """Rank 0's step `step`, or None (no message yet, or the end: see `ended`); the engine
        then processes its in-flight step, as rank 0 does when it has nothing to launch."""
        msg = self._receive()
        if msg is None:
            return None
        if isinstance(msg, Stop):
            self.ended = "stop"
            return None
        assert msg.step == step, f"rank 0 sent step {msg.step}, this rank is at step {step}"
        receiver = self.runtime.receiver
        for a in msg.admits:
            self.on_admit(receiver.admit(a))
        for c in msg.copies:  # before this step's forward (the engine's fence)
            self.tier.replay(c.kind, c.gpu_slots, c.host_slots)  # numbered as on rank 0: same order
        if msg.wait_copy:
            self.tier.require(msg.wait_copy, cause="rank0")  # the forward waits where rank 0's does
        return receiver.batch(msg)

    def _receive(self):
        try:
            msg = self.runtime.receiver.recv(_IDLE_POLL_S)
            gone = msg is None and os.getppid() != self.runtime.parent
        except (EOFError, OSError):  # the channel closed without a Stop
            msg, gone = None, True
        if gone:
            log.warning("rank %d: rank 0 is gone; exiting", self.runtime.info.rank)
            self.ended = "gone"
        return msg

    def has_work(self) -> bool:
        return self.ended is None

    def rollback(self, step: int) -> None:
        # A step this rank failed to launch runs on the others: the ranks cannot agree again.
        raise RuntimeError(f"tensor-parallel rank {self.runtime.info.rank}: step {step} failed to launch")

    def on_step_completed(self, step: int) -> None:
        pass  # KV and slots are rank 0's to free

    def prepare_waiting(self) -> int:
        return 0  # rank 0 plans: it prepares its waiting requests

    def plan_ahead(self, step: int) -> None:
        return None  # rank 0 plans ahead; its step message comes when it launches

    def finish(self, req, step: int) -> None:
        pass

    def kv_holders(self) -> list:
        return []

    def add(self, req) -> None:
        raise RuntimeError("a tensor-parallel worker takes no requests: rank 0 sends its steps")
