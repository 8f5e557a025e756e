"""Where a tensor-parallel group's ranks run and meet, as `tandem serve` is told
(`--nnodes/--node-rank/--master-addr/--master-port`); `tandem.distributed.layout` turns it
into a rank's layout. A leaf module: the engine's configuration nests it as `cfg.launch`.
Each field's `help` is its flag's help (`tandem.options`)."""
from dataclasses import dataclass, field


def _flag(default, help: str):
    return field(default=default, metadata={"help": help})


@dataclass
class Launch:
    """Several nodes: start the same command on each with its node_rank; rank 0's node hosts
    the rendezvous. One node needs none of it (the defaults)."""

    nnodes: int = _flag(1, "nodes the tensor-parallel group spans")
    node_rank: int = _flag(0, "this node's place (0 runs the engine and the HTTP server; others only ranks)")
    master_addr: str = _flag("127.0.0.1", "node 0's address (the rendezvous)")
    master_port: int | None = _flag(None, "the rendezvous port on node 0 (None: a free port; one node only)")
    dist_timeout_s: float = _flag(600.0, "start-up rendezvous and collective timeout, in seconds")
