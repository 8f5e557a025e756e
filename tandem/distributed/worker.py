"""A tensor-parallel worker: builds the same engine as rank 0 on its shard, then launches
each step rank 0 sends (`python -m tandem.distributed.worker SPEC`, started by `start_worker`;
the step channel's secret comes in the environment)."""
from __future__ import annotations

import ctypes
import faulthandler
import logging
import os
import signal
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

log = logging.getLogger("tandem")

# While no step comes, check this often that rank 0 is still there.
_IDLE_POLL_S = 1.0


class Spec(msgspec.Struct):
    """A worker's command line (JSON): its place in the group and the engine's config."""

    info: RankInfo
    config: EngineConfig


def start_worker(cfg: EngineConfig, info: RankInfo, secret: str) -> subprocess.Popen:
    spec = msgspec.json.encode(Spec(info, cfg)).decode()
    return subprocess.Popen([sys.executable, "-m", "tandem.distributed.worker", spec],
                            env={**os.environ, SECRET_ENV: secret})


class WorkerRuntime:
    def __init__(self, info: RankInfo, timeout_s: float, device: torch.device, secret: str):
        self.info, self.timeout_s, self.secret = info, timeout_s, secret
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

    def check(self, grace_s: float = 0.0) -> None:
        pass

    def close(self) -> None:
        if self.receiver is not None:
            self.receiver.close()
        if dist.is_initialized():
            dist.destroy_process_group()


def serve(engine, receiver: StepReceiver, parent: int) -> bool:
    """Launch every step rank 0 sends, in order, keeping one step in flight as rank 0 does
    (lifetime rule of the staging and result rings: step N - 2 is complete before step N).
    True when rank 0 said stop; False when rank 0 is gone."""
    runner, pending = engine.runner, None
    while True:
        try:
            msg = receiver.recv(_IDLE_POLL_S)
            gone = msg is None and os.getppid() != parent
        except (EOFError, OSError):  # the channel closed without a Stop
            msg, gone = None, True
        if gone:
            log.warning("rank %d: rank 0 is gone; exiting", engine.parallel.info.rank)
            return False
        if msg is None:
            continue
        if isinstance(msg, Stop):
            break
        for a in msg.admits:
            receiver.admit(a)
            runner.start_request(a.slot, a.prompt_ids, a.params, a.outputs)
        launched = runner.launch(receiver.batch(msg))
        if pending is not None:
            pending.host.wait()
        pending = launched
    if pending is not None:
        pending.host.wait()
    return True


def main(argv: list[str]) -> int:
    spec = msgspec.json.decode(argv[0], type=Spec)
    secret = os.environ.pop(SECRET_ENV, "")  # not inherited by anything this process starts
    _die_with_parent()
    return run(spec.config, spec.info, secret, linger_s=0.0)


def run(cfg: EngineConfig, info: RankInfo, secret: str, linger_s: float) -> int:
    """Build this rank's engine and serve rank 0's steps until it stops; the exit code.
    `linger_s`: after a start-up failure, wait that long for rank 0 to read it."""
    parent = os.getppid()
    logging.basicConfig(level=logging.INFO,
                        format=f"%(asctime)s tp-rank{info.rank} %(levelname)s %(message)s")
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the group; rank 0 stops us
    faulthandler.register(signal.SIGUSR1)  # `kill -USR1 PID` prints where a worker is stuck
    from tandem.config import resolve_device
    from tandem.engine import Engine
    runtime = WorkerRuntime(info, cfg.launch.dist_timeout_s, resolve_device(cfg.device), secret)
    try:
        engine = Engine(cfg, parallel=runtime)
    except Exception as exc:
        log.exception("rank %d failed to start", info.rank)
        runtime.rdv.fail(f"{type(exc).__name__}: {exc}", linger_s)
        return 1
    try:
        return 0 if serve(engine, runtime.receiver, parent) else 1
    finally:
        runtime.close()


def _die_with_parent() -> None:
    """Linux: SIGKILL this process when its parent exits (no orphans whatever kills rank 0)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
