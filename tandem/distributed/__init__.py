"""Several processes, one engine: tensor parallelism on torch.distributed (NCCL on CUDA,
gloo on the CPU) and data-parallel replicas behind one server."""


def start_parallel(cfg, model_config, device):
    """Rank 0's runtime: nothing for one rank; otherwise check the shapes, then start and
    supervise the workers (`Leader`). Under torchrun a rank > 0 does not return: it serves
    rank 0's steps, then ends the process (`tandem.distributed.torchrun`)."""
    from tandem.distributed.runtime import SingleProcess
    if cfg.tensor_parallel_size == 1:
        return SingleProcess()
    if cfg.tensor_parallel_size < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1; got {cfg.tensor_parallel_size}")
    from tandem.distributed.layout import flags_layout
    from tandem.distributed.leader import Leader
    from tandem.distributed.sharding import Shard
    from tandem.distributed.torchrun import run_worker_rank, torchrun_env, torchrun_layout
    Shard(model_config, 0, cfg.tensor_parallel_size)  # heads / KV heads / MLP divisible: or ValueError
    env = torchrun_env()
    layout = flags_layout(cfg) if env is None else torchrun_layout(cfg, env)  # every rank checks it
    if env is not None and env.rank > 0:
        raise SystemExit(run_worker_rank(cfg, env, layout))
    return Leader(cfg, device, layout)
