"""Which part of an engine this process is, decided once, by the entry point.

One process, or rank 0 of a tensor-parallel group: `build_engine` returns the Engine, with
the runtime that starts and supervises the workers. A worker (spawned by rank 0 as `python
-m tandem.entrypoints.worker SPEC`, or a torchrun rank > 0): `serve_rank` builds the same
engine on its shard and runs its step loop on rank 0's plan (`StepFollower`) until rank 0
stops. The engine only receives its runtime; it never starts processes itself, so the engine
and the distributed runtime do not import each other.
"""
from __future__ import annotations

import faulthandler
import logging
import signal

from tandem.config import EngineConfig, ModelConfig, resolve_device
from tandem.distributed import start_parallel
from tandem.distributed.leader import Leader
from tandem.distributed.runtime import SingleProcess
from tandem.distributed.worker import WorkerRuntime
from tandem.engine import Engine
from tandem.models.checkpoint import builtin_model_path, open_checkpoint

log = logging.getLogger("tandem")


def build_engine(cfg: EngineConfig) -> Engine:
    """This process's engine. A torchrun rank > 0 never gets one back: it serves rank 0's
    steps, then ends the process (SystemExit with its exit code), so the code after this
    runs on rank 0 only, as in any torchrun program."""
    runtime = start_runtime(cfg)
    if isinstance(runtime, WorkerRuntime):
        raise SystemExit(serve_rank(cfg, runtime))
    return Engine(cfg, parallel=runtime)


def start_runtime(cfg: EngineConfig) -> SingleProcess | Leader | WorkerRuntime:
    """This process's runtime (`tandem.distributed.start_parallel`). The model's shape is read
    first, so that a group whose heads do not divide fails before any worker starts."""
    if cfg.tensor_parallel_size == 1:
        return SingleProcess()
    path = cfg.model if cfg.model is not None else builtin_model_path()
    model_config = ModelConfig.from_hf(open_checkpoint(path, allow_pickle=cfg.allow_pickle, config_only=True).config)
    return start_parallel(cfg, model_config, resolve_device(cfg.device))


def serve_rank(cfg: EngineConfig, runtime: WorkerRuntime) -> int:
    """A worker's life: build this rank's engine, step it until rank 0 stops; the exit code."""
    rank = runtime.info.rank
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s tp-rank{rank} %(levelname)s %(message)s")
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the group; rank 0 stops us
    faulthandler.register(signal.SIGUSR1)  # `kill -USR1 PID` prints where a worker is stuck
    try:
        engine = Engine(cfg, parallel=runtime)
    except Exception as exc:
        log.exception("rank %d failed to start", rank)
        runtime.fail(exc)
        return 1
    try:
        return _step_until_stopped(engine)
    finally:
        engine.close()


def _step_until_stopped(engine: Engine) -> int:
    """0 when rank 0 said stop; 1 when it vanished or a step failed here (rank 0 then sees
    this rank's channel close and stops the group)."""
    follower = engine.scheduler
    try:
        while follower.has_work():
            engine.step()
    except Exception:
        log.exception("rank %d: a step failed", engine.parallel.info.rank)
        return 1
    return 0 if follower.ended == "stop" else 1
