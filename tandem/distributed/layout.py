"""Where a tensor-parallel group's ranks run and where they meet: read from the engine's
flags (`--nnodes/--node-rank/--master-addr/--master-port`; tandem starts the ranks) or from
torchrun's environment (`tandem.distributed.torchrun`; torchrun started them). Rank 0 and
the workers take everything else from here, so both launches run the same code."""
from __future__ import annotations

from dataclasses import dataclass

from tandem.config import EngineConfig
from tandem.distributed.auth import group_secret


@dataclass(frozen=True)
class Layout:
    size: int  # ranks in the group (= tensor_parallel_size)
    nnodes: int
    local_rank: int  # this process's GPU on its node
    store_host: str  # the rendezvous TCPStore
    store_port: int  # 0: any free port (a one-node group that tandem starts)
    host_store: bool  # rank 0 runs the TCPStore (False: torchrun's agent already does)
    store_prefix: str  # the group's keys, apart from anything else in a shared store
    channel_bind: str  # the step channel listens here ...
    channel_host: str  # ... and the workers connect here
    spawn: bool  # rank 0 starts its node's other ranks (False: torchrun started them)
    secret: str

    @property
    def per_node(self) -> int:
        return self.size // self.nnodes


def flags_layout(cfg: EngineConfig) -> Layout:
    """Rank 0's layout when tandem starts the ranks: node 0 runs ranks [0, tp / nnodes)."""
    n, nnodes, launch = cfg.tensor_parallel_size, cfg.launch.nnodes, cfg.launch
    if n % nnodes:
        raise ValueError(f"tensor_parallel_size={n} must be a multiple of nnodes={nnodes}")
    if nnodes > 1 and launch.master_port is None:
        raise ValueError("a multi-node group needs master_port (the rendezvous port on this node)")
    host = launch.master_addr if nnodes > 1 else "127.0.0.1"
    return Layout(size=n, nnodes=nnodes, local_rank=0, store_host=host, store_port=launch.master_port or 0,
                  host_store=True, store_prefix="", channel_bind=host, channel_host=host, spawn=True,
                  secret=group_secret(nnodes))
