"""A tensor-parallel worker: builds the same engine as rank 0 on its shard, then launches
each step rank 0 sends (`python -m tandem.distributed.worker SPEC`)."""
from __future__ import annotations

import base64
import ctypes
import faulthandler
import datetime
import json
import logging
import os
import pickle
import signal
import sys

import torch
import torch.distributed as dist

from tandem.config import EngineConfig
from tandem.distributed.channel import StepReceiver
from tandem.distributed.group import TPGroup
from tandem.distributed.runtime import RankInfo, Rendezvous, init_collectives

log = logging.getLogger("tandem")

# While no step comes, check this often that rank 0 is still there.
_IDLE_POLL_S = 1.0


class WorkerRuntime:
    def __init__(self, info: RankInfo, timeout_s: float, device: torch.device):
        self.info, self.timeout_s = info, timeout_s
        if device.type == "cuda":
            torch.cuda.set_device(info.local_rank)
        self.store = dist.TCPStore(info.store_host, info.store_port, info.size, is_master=False,
                                   timeout=datetime.timedelta(seconds=timeout_s))
        self.rdv = Rendezvous(self.store, info, timeout_s)
        self.tp = TPGroup(info.rank, info.size)
        self.sender, self.failure, self.receiver = None, None, None

    def agree_min(self, key: str, value: int) -> int:
        self.rdv.publish(key, str(value))
        return min(int(v) for v in self.rdv.gather(key))

    def connect(self, device: torch.device) -> None:
        init_collectives(self.info, self.store, device, self.timeout_s)

    def ready(self) -> None:
        host, _, port = self.store.get("steps").decode().rpartition(":")
        self.receiver = StepReceiver(host, int(port), self.info.rank)  # connected before "ready"
        self.rdv.publish("ready", "1")

    def check(self, grace_s: float = 0.0) -> None:
        pass

    def close(self) -> None:
        if self.receiver is not None:
            self.receiver.close()
        if dist.is_initialized():
            dist.destroy_process_group()


def serve(engine, receiver: StepReceiver, parent: int) -> None:
    """Launch every step rank 0 sends, in order, keeping one step in flight as rank 0 does
    (lifetime rule of the staging and result rings: step N - 2 is complete before step N)."""
    runner, pending = engine.runner, None
    while True:
        msg = receiver.recv(_IDLE_POLL_S)
        if msg is None:
            if os.getppid() != parent:
                log.warning("rank %d: rank 0 is gone; exiting", engine.parallel.info.rank)
                return
            continue
        if msg.stop:
            break
        for slot, prompt_ids, params, outputs in msg.admits:
            receiver.params[slot] = params
            runner.start_request(slot, prompt_ids, params, outputs)
        launched = runner.launch(receiver.batch(msg))
        if pending is not None:
            pending.host.wait()
        pending = launched
    if pending is not None:
        pending.host.wait()


def main(argv: list[str]) -> int:
    spec = json.loads(argv[0])
    _die_with_parent()
    parent = os.getppid()
    logging.basicConfig(level=logging.INFO,
                        format=f"%(asctime)s tp-rank{spec['rank']} %(levelname)s %(message)s")
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the group; rank 0 stops us
    faulthandler.register(signal.SIGUSR1)  # `kill -USR1 PID` prints where a worker is stuck
    cfg: EngineConfig = pickle.loads(base64.b64decode(spec["config"]))  # from our own parent
    info = RankInfo(spec["rank"], spec["size"], spec["local_rank"], spec["store_host"], spec["store_port"])
    from tandem.config import resolve_device
    from tandem.engine import Engine
    runtime = WorkerRuntime(info, cfg.dist_timeout_s, resolve_device(cfg.device))
    try:
        engine = Engine(cfg, parallel=runtime)
    except Exception as exc:
        log.exception("rank %d failed to start", info.rank)
        runtime.rdv.fail(f"{type(exc).__name__}: {exc}")
        return 1
    try:
        serve(engine, runtime.receiver, parent)
    finally:
        runtime.close()
    return 0


def _die_with_parent() -> None:
    """Linux: SIGKILL this process when its parent exits (no orphans whatever kills rank 0)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
