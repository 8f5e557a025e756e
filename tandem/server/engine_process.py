"""The engine loop in its own process, fed and drained over ZMQ IPC.

Detokenization: a request with stop strings is detokenized here, step by step
(`tandem.text.RequestText`), because its stop strings must end it in the step
that completes them; moving them to the front end would cost an abort round trip
and extra generated tokens. Every other request is detokenized by the front end
(`Add.detokenize` False) from the ids each delta names (`Delta.text_ids`): the
same decoder fed the same ids, off this process's path between two forwards
(at 256 decoding rows, text was most of a result's processing). The front end
tokenizes prompts and applies chat templates, so the engine receives token ids only.

Per iteration: take every queued message without blocking while there is
work (block when idle), run one `engine.step()`, send its deltas with fresh
load figures. An abort is therefore applied before the next step is planned.
"""
from __future__ import annotations

import logging
import os
import shutil
import signal

import msgspec
import zmq

from tandem.config import EngineConfig
from tandem.diagnostics.errors import EngineDeadError
from tandem.distributed.runtime import WorkerDiedError
from tandem.outputs import StepOutput
from tandem.sampling import SamplingParams
from tandem.server import protocol as P

log = logging.getLogger("tandem.server")

# While idle, wake this often to notice that the front end died (orphaned engine).
_IDLE_POLL_MS = 500


def run_engine(config: bytes, inbound: str, outbound: str, max_waiting: int, gpus: str | None = None) -> None:
    """Process entry point: `config` is a msgpack-encoded EngineConfig; `gpus` the
    CUDA_VISIBLE_DEVICES of this engine (a data-parallel replica's share), set before CUDA starts."""
    if gpus is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = gpus
    logging.basicConfig(level=logging.INFO, format="%(asctime)s engine %(levelname)s %(message)s")
    # Ctrl-C (or a SIGTERM to the group) reaches every process; the front end drains, then
    # stops the engine with Shutdown. An engine whose front end died notices by itself.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    parent = os.getppid()
    ctx = zmq.Context()
    pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    pull.connect(inbound)
    push.connect(outbound)
    push.setsockopt(zmq.LINGER, 2000)
    enc = P.encoder()
    try:
        from tandem.entrypoints.ranks import build_engine  # heavy import: after the sockets, inside the try
        engine = build_engine(msgspec.msgpack.decode(config, type=EngineConfig))
    except Exception as exc:  # any start-up failure is reported, not just logged
        # Bad input (a model it cannot open): the front end's one line says it. A bug: its traceback.
        if not isinstance(exc, (ValueError, OSError)):
            log.exception("engine failed to start")
        push.send(enc.encode(P.Failed(f"{type(exc).__name__}: {exc}")))
        pull.close(0)
        push.close()
        ctx.term()  # waits (LINGER) until Failed is delivered
        raise SystemExit(1) from None
    push.send(enc.encode(P.Ready(engine.max_model_len, engine.model_config.vocab_size, _stats(engine),
                                 engine.resolved_settings())))
    try:
        ipc_dir = os.path.dirname(inbound.removeprefix("ipc://"))
        _EngineLoop(engine, pull, push, max_waiting, parent, ipc_dir).run()
    finally:
        engine.close()  # tensor-parallel workers (atexit does not run in this process)
        pull.close(0)
        push.close()
        ctx.term()
    from tandem.entrypoints.cli import exit_quietly
    exit_quietly(0)  # a clean stop: no Triton leak report from teardown in the server log


class _EngineLoop:
    def __init__(self, engine, pull: zmq.Socket, push: zmq.Socket, max_waiting: int, parent: int,
                 ipc_dir: str):
        self.engine, self.pull, self.push = engine, pull, push
        self.max_waiting, self.parent = max_waiting, parent
        self.ipc_dir = ipc_dir  # the front end's socket folder: ours to remove if it dies
        self.enc, self.dec = P.encoder(), P.to_engine_decoder()
        self.report_stats = False  # send fresh stats even without deltas (after a cache reset)

    def run(self) -> None:
        while True:
            if os.getppid() != self.parent:  # every iteration (a syscall, ~1 us): busy or idle
                log.warning("front end is gone; engine exiting")
                # A killed front end cannot remove its socket folder; nobody else would.
                shutil.rmtree(self.ipc_dir, ignore_errors=True)
                # Nobody to report to or linger for; the OS frees everything, GPU memory too.
                os._exit(0)
            busy = self.engine.has_unfinished()
            has_mail = bool(self.pull.poll(0 if busy else _IDLE_POLL_MS))
            if not has_mail and not busy:
                continue
            accepted: list[str] = []
            rejected: list[P.Rejection] = []
            if has_mail and not self._receive(accepted, rejected):
                return
            try:
                deltas = self._step() if self.engine.has_unfinished() else []
            except (EngineDeadError, WorkerDiedError) as exc:  # logged once; report it, then go
                self.push.send(self.enc.encode(P.Failed(str(exc))))
                self.push.close()  # LINGER delivers Failed before the hard exit
                os._exit(3)  # no destructors on a dead CUDA context
            if accepted or rejected or deltas or self.report_stats:
                self.report_stats = False
                msg = P.Outputs(accepted, rejected, deltas, _stats(self.engine))
                self.push.send(self.enc.encode(msg), copy=False)

    def _receive(self, accepted: list[str], rejected: list[P.Rejection]) -> bool:
        """Apply every queued message; False on Shutdown."""
        waiting = None  # the queue length, read once per batch of messages and only if one adds
        while True:
            try:
                raw = self.pull.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return True
            msg = self.dec.decode(raw.buffer)
            if isinstance(msg, P.Shutdown):
                return False
            if isinstance(msg, P.Abort):
                for rid in msg.request_ids:
                    self.engine.abort(rid)
                continue
            if isinstance(msg, P.ResetPrefixCache):
                log.info("prefix cache reset: %d KV slots freed", self.engine.reset_prefix_cache())
                self.report_stats = True
                continue
            if waiting is None:
                waiting = self.engine.stats()["waiting"]
            if waiting >= self.max_waiting:
                rejected.append(P.Rejection(msg.request_id, 503, f"the waiting queue is full "
                                                                  f"({self.max_waiting} requests)"))
                continue
            try:
                params = SamplingParams(**msgspec.structs.asdict(msg.params))
                self.engine.add_request(msg.prompt_token_ids, params, msg.request_id, detokenize=msg.detokenize)
            except ValueError as exc:  # the front end checks first; this is the backstop
                rejected.append(P.Rejection(msg.request_id, 400, str(exc)))
                continue
            accepted.append(msg.request_id)
            waiting += 1

    def _step(self) -> list[P.Delta]:
        deltas = []
        for out in self.engine.step():
            deltas.append(_delta(out))
            if out.finished:
                self.engine.release(out.request_id)
        return deltas


def _delta(out: StepOutput) -> P.Delta:
    lps = None
    if out.new_logprobs is not None:
        lps = [P.Logprob(lp.token_id, lp.logprob, lp.top) for lp in out.new_logprobs]
    prompt = None
    if out.prompt_logprobs is not None:
        prompt = [None if lp is None else P.Logprob(lp.token_id, lp.logprob, lp.top, lp.rank)
                  for lp in out.prompt_logprobs]
    return P.Delta(out.request_id, out.new_token_ids, out.new_text, out.finished, out.finish_reason, lps,
                   out.num_cached_tokens, out.error, out.error_status, out.error_code, prompt, out.text_ids)


def _stats(engine) -> P.Stats:
    s = engine.stats()
    recent = engine.timeline.recent() if engine.timeline is not None else {}
    return P.Stats(s["running"], s["waiting"], float(s["kv_cache_usage"]),
                   recent.get("gpu_busy_fraction"), recent.get("mean_cpu_lead_ms"),
                   recent.get("mean_host_ms", 0.0), s["prefix_cache_queried_tokens"],
                   s["prefix_cache_hit_tokens"], s["prefix_cache_tokens"],
                   s.get("spec_decode_num_drafts", 0), s.get("spec_decode_num_draft_tokens", 0),
                   s.get("spec_decode_num_accepted_tokens", 0), s.get("spec_decode_num_accepted_tokens_per_pos", []),
                   **{k: s[k] for k in _HOST_TIER_STATS})


_HOST_TIER_STATS = ("host_cache_hit_tokens", "host_cache_tokens", "host_load_bytes", "host_load_seconds",
                    "host_write_back_bytes", "host_write_back_seconds")
