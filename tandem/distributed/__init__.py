"""Several processes, one engine: tensor parallelism on torch.distributed (NCCL on CUDA,
gloo on the CPU) and data-parallel replicas behind one server.

This package never imports the engine: the entry point (`tandem.entrypoints.ranks`) asks
`start_parallel` for this process's runtime and hands it to `Engine(cfg, parallel=...)`."""


def start_parallel(cfg, model_config, device):
    """This process's runtime: `SingleProcess` for one rank; rank 0 checks the shapes, then
    starts and supervises the workers (`Leader`); under torchrun a rank > 0 gets its
    `WorkerRuntime` (it builds the same engine and steps rank 0's plan)."""
    from tandem.distributed.runtime import SingleProcess
    if cfg.tensor_parallel_size == 1:
        return SingleProcess()
    if cfg.tensor_parallel_size < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1; got {cfg.tensor_parallel_size}")
    from tandem.distributed.layout import flags_layout
    from tandem.distributed.leader import Leader
    from tandem.distributed.sharding import Shard
    from tandem.distributed.torchrun import torchrun_env, torchrun_layout, worker_runtime
    Shard(model_config, 0, cfg.tensor_parallel_size)  # heads / KV heads / MLP divisible: or ValueError
    env = torchrun_env()
    layout = flags_layout(cfg) if env is None else torchrun_layout(cfg, env)  # every rank checks it
    if env is not None and env.rank > 0:
        return worker_runtime(cfg, env, layout, device)
    return Leader(cfg, device, layout)
