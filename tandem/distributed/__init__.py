"""Several processes, one engine: tensor parallelism on torch.distributed (NCCL on CUDA,
gloo on the CPU) and data-parallel replicas behind one server."""


def start_parallel(cfg, model_config, device):
    """Rank 0's runtime: nothing for one rank; otherwise check the shapes, then start and
    supervise the workers (`Leader`)."""
    from tandem.distributed.runtime import SingleProcess
    if cfg.tensor_parallel_size == 1:
        return SingleProcess()
    if cfg.tensor_parallel_size < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1; got {cfg.tensor_parallel_size}")
    from tandem.distributed.leader import Leader
    from tandem.distributed.sharding import Shard
    Shard(model_config, 0, cfg.tensor_parallel_size)  # heads / KV heads / MLP divisible: or ValueError
    return Leader(cfg, device)
