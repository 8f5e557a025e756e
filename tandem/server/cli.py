"""`tandem serve`: parse options, start the engine process, then serve HTTP until stopped."""
from __future__ import annotations

import argparse
import asyncio
import logging
import os
import re
import socket
import sys
from pathlib import Path

from tandem import options
from tandem.config import EngineConfig
from tandem.distributed.torchrun import torchrun_env
from tandem.server.drain import EXIT_RESERVE_S
from tandem.server.reasoning import PARSERS, reasoning_parser
from tandem.server.responses_store import DEFAULT_MAX_BYTES, DEFAULT_MAX_RESPONSES, ResponseStore

log = logging.getLogger("tandem.server")
API_KEY_ENV = "TANDEM_API_KEY"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tandem serve", description="OpenAI-compatible HTTP server")
    p.add_argument("--served-model-name", default=None,
                   help="the name clients pass as 'model' (default: the model's directory or file name)")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default: %(default)s, loopback)")
    p.add_argument("--port", type=int, default=8000, help="TCP port to listen on (default: %(default)s)")
    # From the environment, the key does not show in `ps` (vLLM: VLLM_API_KEY).
    p.add_argument("--api-key", default=os.environ.get(API_KEY_ENV) or None,
                   help=f"require 'Authorization: Bearer KEY' on /v1/* (default: ${API_KEY_ENV}, if set)")
    p.add_argument("--max-waiting-requests", type=int, default=1024,
                   help="requests queued beyond this get 503 with Retry-After (default: %(default)s)")
    p.add_argument("--restart-engine", action="store_true",
                   help="start a new engine process when one dies (its in-flight requests fail with 503)")
    p.add_argument("--strict-api", action="store_true",
                   help="refuse requests with fields no OpenAI or vLLM schema has (default: ignore "
                        "them with a warning)")
    p.add_argument("--max-request-bytes", type=int, default=16 * 2**20,
                   help="larger request bodies get 413 (default 16 MiB)")
    p.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="on SIGTERM, seconds until the process has exited: in-flight requests get this "
                        f"less {EXIT_RESERVE_S:g} s for the shutdown itself (at least half) before they are failed "
                        "(default: %(default)s)")
    p.add_argument("--reasoning-parser", default=None, choices=sorted(PARSERS), metavar="NAME",
                   help="split a reasoning model's <think>...</think> from its answer: reasoning_content "
                        f"in chat responses, constraints applied after it ({', '.join(sorted(PARSERS))}; "
                        "default: none)")
    p.add_argument("--max-stored-responses", type=int, default=DEFAULT_MAX_RESPONSES, metavar="N",
                   help="/v1/responses answers kept in memory for previous_response_id and GET (the oldest "
                        f"go first; also at most {DEFAULT_MAX_BYTES // 2**20} MiB); 0 keeps none "
                        "(default: %(default)s)")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                   help="the server's and uvicorn's log level (default: %(default)s)")
    p.add_argument("--dp", type=int, default=1, metavar="N",
                   help="data parallelism: N engine replicas (each with --tp GPUs), one front end "
                        "(default: %(default)s)")
    options.add_engine_options(p, launch=True)
    return p


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:  # everything that can be checked before a model loads (tens of seconds) is checked here
        cfg = _checked_config(args)
        torchrun = torchrun_env() if cfg.tensor_parallel_size > 1 else None
        if torchrun is not None and (args.dp > 1 or args.restart_engine):  # torchrun's ranks serve one engine
            raise ValueError("--dp > 1 and --restart-engine do not work with --tp > 1 under torchrun: its ranks "
                             "serve one engine (WORLD_SIZE = --tp) and end with it")
        if (torchrun is None or torchrun.rank == 0) and cfg.launch.node_rank == 0:  # the one that serves HTTP
            check_port_free(args.host, args.port)
    except (ValueError, OSError) as exc:  # one line, as the other commands print bad input
        print(f"tandem serve: error: {exc}", file=sys.stderr)
        return 2
    if torchrun is not None and torchrun.rank > 0:  # a torchrun worker rank: its engine only, no HTTP
        from tandem.entrypoints.ranks import serve_rank, start_runtime
        return serve_rank(cfg, start_runtime(cfg))
    if cfg.launch.node_rank > 0:  # a multi-node group's other node: its ranks only, no HTTP
        from tandem.distributed.node import run_node
        return run_node(cfg)
    # The step timeline feeds /metrics (GPU busy, CPU lead, host ms): always on, a bounded
    # window of it in memory; `--timeline PATH` also writes every step there.
    cfg.timeline = cfg.timeline or True
    cfg.timeline_max_records = cfg.timeline_max_records or 4096
    try:
        return asyncio.run(_serve(args, cfg))
    except KeyboardInterrupt:
        return 0


def _checked_config(args: argparse.Namespace) -> EngineConfig:
    for flag, value, low in (("--max-waiting-requests", args.max_waiting_requests, 1), ("--dp", args.dp, 1),
                             ("--shutdown-timeout", args.shutdown_timeout, 0),
                             ("--max-stored-responses", args.max_stored_responses, 0),
                             ("--max-request-bytes", args.max_request_bytes, 1024)):
        if value < low:
            raise ValueError(f"{flag} must be >= {low}, got {value}")
    return options.checked_engine_config(args)


def check_port_free(host: str, port: int) -> None:
    """Raise unless this process can listen on host:port now, bound the way uvicorn binds
    (SO_REUSEADDR), so a taken port fails before the model loads, not after. Racy by nature:
    uvicorn still reports a port taken in between."""
    if not 0 <= port <= 65535:
        raise ValueError(f"--port must be in [0, 65535], got {port}")
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as exc:
        raise ValueError(f"--host {host}: {exc.strerror}") from None
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(address)
        except OSError as exc:
            raise OSError(f"cannot listen on {host}:{port}: {exc.strerror} (--port, --host)") from None


def _import_grammar_library() -> None:
    try:
        import xgrammar  # noqa: F401
    except ImportError:  # structured output then answers with its own clear error
        pass


async def _serve(args: argparse.Namespace, cfg: EngineConfig) -> int:
    import uvicorn

    from tandem.models.checkpoint import builtin_model_path, open_checkpoint, open_tokenizer
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
        # The front end tokenizes: load the tokenizer while the engine loads the model. And it
        # checks grammars: import xgrammar now (0.3-3 s), not on the event loop at the first
        # structured request.
        tokenizer_task = asyncio.create_task(asyncio.to_thread(
            lambda: open_tokenizer(cfg.tokenizer, open_checkpoint(path, allow_pickle=cfg.allow_pickle,
                                                                  config_only=True))))
        grammar_task = asyncio.create_task(asyncio.to_thread(_import_grammar_library))
        await client.start()
        tokenizer = await tokenizer_task
        client.use_tokenizer(tokenizer)  # requests without stop strings are detokenized here
        await grammar_task
    except Exception as exc:
        log.error("could not start: %s", exc)
        tokenizer_task.cancel()
        await asyncio.gather(tokenizer_task, grammar_task, return_exceptions=True)
        await client.close()
        return 1
    name = args.served_model_name or (path.stem if path.is_file() else path.name)
    reasoning = reasoning_parser(args.reasoning_parser)
    state = ServerState(client, tokenizer, name, frozenset({str(cfg.model or path), str(path)}), metrics,
                        FieldPolicy(args.strict_api), server_info=server_info(args, cfg),
                        reasoning=reasoning.for_tokenizer(tokenizer) if reasoning else None,
                        responses=ResponseStore(args.max_stored_responses))
    app = create_app(state, args.api_key, args.max_request_bytes)
    # The drain fails what is left within --shutdown-timeout before uvicorn exits; its own deadline
    # is for the responses that are ending then.
    server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                                           timeout_graceful_shutdown=drain.FLUSH_S))
    drain.install(server, state, client, args.shutdown_timeout)
    log.info("serving %s on http://%s:%d (context %d tokens)", name, args.host, args.port,
             state.max_model_len)
    try:
        await server.serve()
    finally:
        await client.close()
    return 0 if server.started else 1


def server_info(args: argparse.Namespace, cfg: EngineConfig) -> dict:
    """What `GET /server_info` reports: the engine configuration in effect (the server's
    timeline included) and the server's own arguments, secrets redacted."""
    import msgspec
    engine = set(options.engine_dests())
    return {"engine_config": _redacted(msgspec.to_builtins(cfg)),
            "server_args": _redacted({k: v for k, v in vars(args).items() if k not in engine})}


_SECRET = re.compile(r"(^|_)(key|secret|password|token)$")


def _redacted(values: dict) -> dict:
    def value(key: str, v):
        if isinstance(v, dict):
            return _redacted(v)
        return "<redacted>" if v is not None and _SECRET.search(key) else v
    return {k: value(k, v) for k, v in values.items()}


def _engine_client(cfg: EngineConfig, args: argparse.Namespace, metrics, client_cls):
    """One engine, or `--dp` of them behind a router; on CUDA replica i gets the visible GPUs
    [i * tp, (i + 1) * tp)."""
    if args.dp == 1:
        return client_cls(cfg, args.max_waiting_requests, metrics, restart=args.restart_engine)
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
