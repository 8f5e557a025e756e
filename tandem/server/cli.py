"""`tandem serve`: parse options, start the engine process, then serve HTTP until stopped."""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import types
from pathlib import Path

from tandem.config import EngineConfig
from tandem.distributed.torchrun import run_worker_rank, torchrun_env, torchrun_layout

log = logging.getLogger("tandem.server")

# EngineConfig fields that are not plain command-line options.
_NOT_OPTIONS = {"model", "extra"}


def _engine_options(parser: argparse.ArgumentParser) -> None:
    """One option per EngineConfig field, so new engine knobs appear here without edits."""
    group = parser.add_argument_group("engine options")
    for f in dataclasses.fields(EngineConfig):
        if f.name in _NOT_OPTIONS:
            continue
        flag = "--" + f.name.replace("_", "-")
        kinds = [t for t in (f.type.__args__ if isinstance(f.type, types.UnionType) else (f.type,))
                 if t is not type(None)]
        kind, optional = kinds[0], isinstance(f.type, types.UnionType)
        if kind is bool:
            if f.default and f.name.startswith("enable_"):  # on by default: --no-<feature> turns it off
                flag = "--no-" + f.name.removeprefix("enable_").replace("_", "-")
            group.add_argument(flag, action="store_true" if not f.default else "store_false",
                               dest=f.name, help=f"(engine) default {f.default}")
            continue
        group.add_argument(flag, type=_parser(kind, optional), default=f.default, dest=f.name,
                           metavar=kind.__name__.upper(),
                           help=f"(engine) default {f.default}" + ("; 'none' to unset" if optional else ""))


def _parser(kind: type, optional: bool):
    def parse(text: str):
        if optional and text.lower() == "none":
            return None
        return kind(text)
    parse.__name__ = kind.__name__  # argparse names the type in its error message
    return parse


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tandem serve", description="OpenAI-compatible HTTP server")
    p.add_argument("--model", default=None, help="HF directory or .gguf file (default: the built-in model)")
    p.add_argument("--served-model-name", default=None, help="the name clients pass as 'model'")
    p.add_argument("--host", default="127.0.0.1", help="bind address (loopback unless told otherwise)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1/*")
    p.add_argument("--max-waiting-requests", type=int, default=1024,
                   help="requests queued beyond this get 503 with Retry-After")
    p.add_argument("--restart-engine", action="store_true",
                   help="start a new engine process when one dies (its in-flight requests fail with 503)")
    p.add_argument("--strict-api", action="store_true",
                   help="refuse requests with fields no OpenAI or vLLM schema has (default: ignore "
                        "them with a warning)")
    p.add_argument("--max-request-bytes", type=int, default=16 * 2**20,
                   help="larger request bodies get 413 (default 16 MiB)")
    p.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="on SIGTERM, seconds in-flight requests get to finish before they are failed")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.add_argument("--dp", type=int, default=1, metavar="N",
                   help="data parallelism: N engine replicas (each with --tp GPUs), one front end")
    _engine_options(p)
    p.add_argument("--tp", type=int, dest="tensor_parallel_size", metavar="N", default=argparse.SUPPRESS,
                   help="tensor parallelism: N ranks per engine (= --tensor-parallel-size)")
    return p


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if args.max_waiting_requests < 1:
        log.error("--max-waiting-requests must be >= 1")
        return 2
    if args.dp < 1:
        log.error("--dp must be >= 1")
        return 2
    if args.shutdown_timeout < 0:
        log.error("--shutdown-timeout must be >= 0")
        return 2
    if args.max_request_bytes < 1024:
        log.error("--max-request-bytes must be >= 1024")
        return 2
    cfg = EngineConfig(model=args.model, **{f.name: getattr(args, f.name) for f in dataclasses.fields(EngineConfig)
                                            if f.name not in _NOT_OPTIONS})
    torchrun = torchrun_env() if cfg.tensor_parallel_size > 1 else None
    if torchrun is not None and (args.dp > 1 or args.restart_engine):  # torchrun's ranks serve one engine
        log.error("--dp > 1 and --restart-engine do not work with --tp > 1 under torchrun: its ranks "
                  "serve one engine (WORLD_SIZE = --tp) and end with it")
        return 2
    if torchrun is not None and torchrun.rank > 0:  # a torchrun worker rank: its engine only, no HTTP
        return run_worker_rank(cfg, torchrun, torchrun_layout(cfg, torchrun))
    if cfg.node_rank > 0:  # a multi-node group's other node: its ranks only, no HTTP
        from tandem.distributed.node import run_node
        return run_node(cfg)
    # The step timeline feeds /metrics (GPU busy, CPU lead, host ms); a bounded window of it.
    cfg.timeline = True
    cfg.timeline_max_records = cfg.timeline_max_records or 4096
    try:
        return asyncio.run(_serve(args, cfg))
    except KeyboardInterrupt:
        return 0


async def _serve(args: argparse.Namespace, cfg: EngineConfig) -> int:
    import uvicorn

    from tandem.models.checkpoint import builtin_model_path, open_checkpoint
    from tandem.server import drain
    from tandem.server.api import ServerState, create_app
    from tandem.server.client import EngineClient
    from tandem.server.fields import FieldPolicy
    from tandem.server.metrics import Metrics

    path = Path(cfg.model).expanduser() if cfg.model is not None else builtin_model_path()
    metrics = Metrics(replicas=args.dp)
    try:
        client = _engine_client(cfg, args, metrics, EngineClient)
    except ValueError as exc:
        log.error("%s", exc)
        return 2
    try:
        # The front end tokenizes: load the tokenizer while the engine loads the model.
        tokenizer_task = asyncio.create_task(asyncio.to_thread(
            lambda: open_checkpoint(path, allow_pickle=cfg.allow_pickle, config_only=True).load_tokenizer()))
        await client.start()
        tokenizer = await tokenizer_task
    except Exception as exc:
        log.error("could not start: %s", exc)
        tokenizer_task.cancel()
        await asyncio.gather(tokenizer_task, return_exceptions=True)
        await client.close()
        return 1
    name = args.served_model_name or (path.stem if path.is_file() else path.name)
    state = ServerState(client, tokenizer, name, frozenset({str(cfg.model or path), str(path)}), metrics,
                        FieldPolicy(args.strict_api))
    app = create_app(state, args.api_key, args.max_request_bytes)
    # uvicorn's own deadline is a backstop: the drain fails what is left at --shutdown-timeout.
    server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                                           timeout_graceful_shutdown=args.shutdown_timeout + 5))
    drain.install(server, state, client, args.shutdown_timeout)
    log.info("serving %s on http://%s:%d (context %d tokens)", name, args.host, args.port,
             state.max_model_len)
    try:
        await server.serve()
    finally:
        await client.close()
    return 0 if server.started else 1


def _engine_client(cfg: EngineConfig, args: argparse.Namespace, metrics, client_cls):
    """One engine, or `--dp` of them behind a router; on CUDA replica i gets the visible GPUs
    [i * tp, (i + 1) * tp)."""
    if args.dp == 1:
        return client_cls(cfg, args.max_waiting_requests, metrics, restart=args.restart_engine)
    import os

    import torch

    from tandem.server.router import ReplicaMetrics, ReplicaRouter
    tp, count = cfg.tensor_parallel_size, torch.cuda.device_count()
    cuda = cfg.device == "cuda" or (cfg.device == "auto" and count > 0)
    pool = (os.environ.get("CUDA_VISIBLE_DEVICES") or ",".join(map(str, range(count)))).split(",")
    if cuda and args.dp * tp > count:
        raise ValueError(f"--dp {args.dp} x --tp {tp} needs {args.dp * tp} GPUs; {count} visible")
    replicas = [client_cls(cfg, args.max_waiting_requests, ReplicaMetrics(metrics, i),
                           ",".join(pool[i * tp:(i + 1) * tp]) if cuda else None, restart=args.restart_engine)
                for i in range(args.dp)]
    return ReplicaRouter(replicas, metrics)
