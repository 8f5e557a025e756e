"""Rank 0: starts the workers of its node, supervises them, and sends them each step.

Workers are plain subprocesses (`python -m tandem.entrypoints.worker`): they work from a
daemonic parent too (the server's engine process) and die with their parent (PDEATHSIG).
A watchdog thread polls them, and the step channel of every rank (ranks on other nodes or
started by torchrun are not our children: their channel closing says they ended); when one
ends unexpectedly it records why, aborts the NCCL communicator (so a rank-0 wait inside a
collective returns instead of hanging) and stops the other workers; the engine's next step
(or the failing one) raises WorkerDiedError with that reason.
"""
from __future__ import annotations

import atexit
import dataclasses
import logging
import signal
import subprocess
import threading
import time

import torch
import torch.distributed as dist

from tandem.config import EngineConfig
from tandem.distributed.channel import StepSender
from tandem.distributed.group import TPGroup
from tandem.distributed.layout import Layout
from tandem.distributed.runtime import RankInfo, Rendezvous, WorkerDiedError, open_store, parallel_env
from tandem.distributed.worker import start_worker

log = logging.getLogger("tandem")

_WATCH_S = 0.1


class Leader:
    def __init__(self, cfg: EngineConfig, device: torch.device, layout: Layout):
        n, per_node = layout.size, layout.per_node
        if device.type == "cuda" and torch.cuda.device_count() < per_node:
            raise ValueError(f"tensor_parallel_size={n} over {layout.nnodes} node(s) needs {per_node} GPUs "
                             f"per node; this node has {torch.cuda.device_count()}")
        parallel_env()
        self.cfg, self.device, self.timeout_s = cfg, device, cfg.launch.dist_timeout_s
        self.tp = TPGroup(0, n)
        self.failure: str | None = None
        self._closing = self._ready = False
        self.procs: dict[int, subprocess.Popen] = {}
        if device.type == "cuda":
            torch.cuda.set_device(layout.local_rank)
        info = RankInfo(0, n, layout.local_rank, layout.store_host, layout.store_port, layout.store_prefix)
        tcp, self.store = open_store(info, layout.host_store, self.timeout_s)
        self.info = dataclasses.replace(info, store_port=tcp.port)  # the free port it got, if 0
        self.sender = StepSender(layout.channel_bind, layout.secret.encode(),
                                 speculative=cfg.speculative_config is not None)
        self.store.set("steps", f"{layout.channel_host}:{self.sender.port}")
        self.rdv = Rendezvous(self.store, self.info, self.timeout_s, watch=self._watch_startup)
        for rank in range(1, per_node) if layout.spawn else ():
            self.procs[rank] = start_worker(cfg, dataclasses.replace(self.info, rank=rank, local_rank=rank),
                                            layout.secret)
        atexit.register(self.close)  # a forgotten close() still stops the workers
        log.info("tensor parallel: %d ranks (%d started here), rendezvous at %s:%d",
                 n, len(self.procs), layout.store_host, tcp.port)

    # ---- start-up ----
    def agree_min(self, key: str, value: int) -> int:
        return self.rdv.agree_min(key, value)

    def connect(self, device: torch.device) -> None:
        self.rdv.join(device)

    def ready(self) -> None:
        self.rdv.publish("ready", "1")
        self.rdv.gather("ready")  # every worker built its engine; each connects to the sender next
        self.sender.accept(set(range(1, self.info.size)), self.timeout_s, watch=self.rdv.poll)
        threading.Thread(target=self._watchdog, name="tandem-tp-watchdog", daemon=True).start()
        self._ready = True

    def plan_source(self, scheduler, on_admit, tier=None):
        return scheduler  # rank 0 plans every rank's steps

    def _watch_startup(self) -> None:
        for rank, proc in self.procs.items():
            if proc.poll() is not None:
                raise RuntimeError(f"tensor-parallel rank {rank} exited during start-up "
                                   f"({_describe(proc.returncode)}); its log is above")

    # ---- running ----
    def check(self, grace_s: float = 0.0) -> None:
        """Raise WorkerDiedError if a worker is gone. `grace_s`: after a failed collective,
        give a dying worker that long to be seen dead (the peer's socket closes first)."""
        deadline = time.monotonic() + grace_s
        while self.failure is None and not self._poll() and time.monotonic() < deadline:
            time.sleep(_WATCH_S / 2)
        if self.failure is not None:
            raise WorkerDiedError(self.failure)

    def _poll(self) -> bool:
        """Record the first worker found dead; True if one is."""
        if self.failure is not None:
            return True
        if self._closing:
            return False
        for rank, proc in self.procs.items():
            if proc.poll() is not None:
                return self._failed(f"tensor-parallel worker rank {rank} (pid {proc.pid}) died "
                                    f"({_describe(proc.returncode)}); the engine is stopped")
        # A rank this process did not start (torchrun, another node); ours are reported by their
        # exit status, seen a moment after their socket closes.
        for rank in set(self.sender.closed_ranks()) - self.procs.keys():
            return self._failed(f"tensor-parallel worker rank {rank} closed its step channel (its process "
                                f"ended); the engine is stopped")
        return False

    def _failed(self, reason: str) -> bool:
        self.failure = reason
        log.error("%s", reason)
        self._abort()
        return True

    def _watchdog(self) -> None:
        while not self._closing and not self._poll():
            time.sleep(_WATCH_S)

    def _abort(self) -> None:
        """Unblock rank 0 (a collective waiting for the dead rank) and stop the other workers."""
        if self.device.type == "cuda" and dist.is_initialized():
            try:
                dist.distributed_c10d._abort_process_group()
            except Exception as exc:  # best effort: the error is already recorded
                log.warning("aborting the NCCL communicator failed: %s", exc)
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()

    # ---- shutdown ----
    def close(self) -> None:
        """Stop every worker (politely, then by force) and leave the process group."""
        if self._closing:
            return
        self._closing = True
        atexit.unregister(self.close)
        if self.failure is None:
            try:
                self.sender.stop()
            except Exception:
                pass
        if not self._ready:  # start-up failed here: ranks we did not start stop waiting for us
            try:
                self.rdv.fail("rank 0 stopped during start-up; its log says why")
            except Exception:
                pass
        deadline = time.monotonic() + 10
        for proc in self.procs.values():
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.sender.close()
        if dist.is_initialized():
            if self.failure is None:
                dist.destroy_process_group()
            else:  # a dead peer: a polite destroy could wait for it
                dist.distributed_c10d._abort_process_group()
        self.store = None


def _describe(code: int | None) -> str:
    if code is not None and code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"
