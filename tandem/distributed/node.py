"""A node other than rank 0's in a multi-node tensor-parallel group: start this node's
ranks, wait while they serve, stop them all when one ends or this process is told to.

    export TANDEM_TP_SECRET=...  # the same on every node: the step channel admits no one else
    # node 0 (rank 0 runs the engine and its node's other ranks):
    tandem serve --model M --tp 16 --nnodes 2 --node-rank 0 --master-addr 10.0.0.1 --master-port 29500
    # node 1:
    tandem serve --model M --tp 16 --nnodes 2 --node-rank 1 --master-addr 10.0.0.1 --master-port 29500
"""
from __future__ import annotations

import logging
import signal
import time

from tandem.config import EngineConfig
from tandem.distributed.auth import group_secret
from tandem.distributed.runtime import RankInfo
from tandem.distributed.worker import start_worker

log = logging.getLogger("tandem")


def run_node(cfg: EngineConfig) -> int:
    """Blocks until this node's ranks exit; returns the first non-zero exit code (or 0)."""
    n, nnodes, node, launch = cfg.tensor_parallel_size, cfg.launch.nnodes, cfg.launch.node_rank, cfg.launch
    if n % nnodes or not 0 < node < nnodes:
        raise ValueError(f"node_rank must be in [1, nnodes) and tensor_parallel_size={n} a multiple "
                         f"of nnodes={nnodes}")
    if launch.master_port is None:
        raise ValueError("a multi-node group needs master_port (rank 0's rendezvous port)")
    secret = group_secret(nnodes)
    per_node = n // nnodes
    procs = [start_worker(cfg, RankInfo(node * per_node + i, n, i, launch.master_addr, launch.master_port), secret)
             for i in range(per_node)]
    log.info("node %d: ranks %d-%d started", node, node * per_node, (node + 1) * per_node - 1)
    stop = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.append(True))
    code = 0
    while not stop and all(p.poll() is None for p in procs):
        time.sleep(0.2)
    for p in procs:  # one rank ended (or we were told to stop): the group is over
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(10)
        except Exception:
            p.kill()
            p.wait()
        code = code or (p.returncode if p.returncode and p.returncode > 0 else 0)
    return code
