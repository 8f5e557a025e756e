"""A tensor-parallel group that torchrun started: one torchrun process per rank.

    export TANDEM_TP_SECRET=$(openssl rand -hex 32)   # the same for every process of the job
    torchrun --standalone --nproc-per-node 2 -m tandem.server --model M --tp 2

WORLD_SIZE must equal tensor_parallel_size. Global rank 0 is the engine: it runs the
scheduler and the API, exactly as with ranks that tandem spawns. Every other rank turns
into a worker where it builds its engine (`Engine`/`LLM(...)`, `tandem serve`, `tandem
generate`), serves rank 0's steps until rank 0 stops, and then ends its process: code after
the constructor runs on rank 0 only. tensor_parallel_size=1 ignores torchrun altogether
(each process is then an independent engine, e.g. data-parallel evaluation).

Why one process per rank and not one per node that spawns its ranks: a tandem worker
already is a process per rank told (rank, size, local rank, rendezvous address), which is
what torchrun's variables are; rank 0 only skips starting processes. A process per node
would redo torchrun's own job (start, watch and stop the local processes) and give RANK
and WORLD_SIZE a meaning (nodes) that no other torchrun program gives them. torchrun
supervises the processes: when one exits it stops the others on its node; rank 0 also
notices a worker whose step channel closes (`Leader`), wherever it runs.

Rendezvous: torchrun's agent hosts a TCPStore at MASTER_ADDR:MASTER_PORT (its default,
TORCHELASTIC_USE_AGENT_STORE=True) and every rank joins it as a client; otherwise rank 0
hosts it there, as torch's env:// does. The group's keys live under the run id and restart
count, apart from the agent's own and from an earlier attempt's. torchrun, not tandem,
starts the ranks, so rank 0 cannot hand them a fresh secret (the store is readable by
anyone who reaches it): the operator sets TANDEM_TP_SECRET, on one node as on several.
"""
from __future__ import annotations

import os
import signal
from dataclasses import dataclass
from typing import Mapping

from tandem.config import EngineConfig
from tandem.distributed.auth import operator_secret
from tandem.distributed.layout import Layout

# What torchrun sets for every process it starts (and other launchers do not set together).
_REQUIRED = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT")
# After a start-up failure a worker waits this long for rank 0 to read it: torchrun stops the
# group once the worker exits, and rank 0 should have said why by then.
_FAILURE_LINGER_S = 10.0


@dataclass(frozen=True)
class TorchrunEnv:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    node_rank: int  # GROUP_RANK
    nnodes: int
    master_addr: str
    master_port: int
    agent_store: bool  # torchrun's agent hosts the TCPStore at MASTER_ADDR:MASTER_PORT
    run_id: str
    restart: int


def torchrun_env(environ: Mapping[str, str] = os.environ) -> TorchrunEnv | None:
    """This process's place in a torchrun job; None when torchrun did not start it."""
    if not all(k in environ for k in _REQUIRED):
        return None
    try:
        world, local_world = int(environ["WORLD_SIZE"]), int(environ["LOCAL_WORLD_SIZE"])
        return TorchrunEnv(
            rank=int(environ["RANK"]), world_size=world, local_rank=int(environ["LOCAL_RANK"]),
            local_world_size=local_world, node_rank=int(environ["GROUP_RANK"]),
            nnodes=int(environ.get("GROUP_WORLD_SIZE") or max(1, world // max(1, local_world))),
            master_addr=environ["MASTER_ADDR"], master_port=int(environ["MASTER_PORT"]),
            agent_store=environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True",
            run_id=environ.get("TORCHELASTIC_RUN_ID", "none"),
            restart=int(environ.get("TORCHELASTIC_RESTART_COUNT", "0")))
    except ValueError as exc:
        raise ValueError(f"torchrun's environment is malformed: {exc}") from None


def torchrun_layout(cfg: EngineConfig, env: TorchrunEnv) -> Layout:
    """The group torchrun started, checked against the engine's own settings."""
    n = cfg.tensor_parallel_size
    if env.world_size != n:
        raise ValueError(f"torchrun started {env.world_size} processes (WORLD_SIZE) but tensor_parallel_size={n}: "
                         f"start one process per rank (--nnodes x --nproc-per-node = {n})")
    if env.world_size != env.nnodes * env.local_world_size:
        raise ValueError(f"WORLD_SIZE={env.world_size} is not {env.nnodes} nodes x LOCAL_WORLD_SIZE="
                         f"{env.local_world_size}: every node needs the same --nproc-per-node")
    _check_flags(cfg, env)
    one_node = env.nnodes == 1
    return Layout(size=n, nnodes=env.nnodes, local_rank=env.local_rank, store_host=env.master_addr,
                  store_port=env.master_port, host_store=not env.agent_store,
                  store_prefix=f"tandem/{env.run_id}/{env.restart}/",
                  # Several nodes: listen everywhere (the hostname torchrun names may resolve to a
                  # loopback address on its own node); the channel admits only holders of the secret.
                  channel_bind="127.0.0.1" if one_node else "",
                  channel_host="127.0.0.1" if one_node else env.master_addr, spawn=False,
                  secret=operator_secret("a tensor-parallel group started by torchrun"))


def _check_flags(cfg: EngineConfig, env: TorchrunEnv) -> None:
    """--nnodes/--node-rank/--master-addr/--master-port may be left out under torchrun; given,
    they must say what torchrun says."""
    defaults = EngineConfig().launch
    for name, theirs in (("nnodes", env.nnodes), ("node_rank", env.node_rank),
                         ("master_addr", env.master_addr), ("master_port", env.master_port)):
        ours = getattr(cfg.launch, name)
        if ours != getattr(defaults, name) and ours != theirs:
            raise ValueError(f"{name}={ours} disagrees with torchrun's environment ({theirs}); under "
                             f"torchrun leave --{name.replace('_', '-')} out")


def worker_runtime(cfg: EngineConfig, env: TorchrunEnv, layout: Layout, device):
    """A rank > 0's runtime: it joins rank 0's group; the entry point builds its engine and
    steps rank 0's plan until rank 0 stops, then ends the process."""
    from tandem.distributed.runtime import RankInfo  # torch: only once a rank starts
    from tandem.distributed.worker import WorkerRuntime
    # torchrun stops a job with SIGTERM to every rank: a worker stays until rank 0 (finishing
    # its in-flight requests) stops it or its channel closes; torchrun's SIGKILL follows anyway.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    info = RankInfo(env.rank, env.world_size, env.local_rank, layout.store_host, layout.store_port,
                    layout.store_prefix)
    return WorkerRuntime(info, cfg.launch.dist_timeout_s, device, layout.secret, linger_s=_FAILURE_LINGER_S)
