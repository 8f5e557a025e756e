"""Rank 0 -> workers: each step's host metadata, sent while rank 0's own step is queued.

Why broadcast and not a replayed scheduler: the scheduler, the prefix cache and the
detokenizer (stop strings end requests) then live on rank 0 only, and workers need no
tokenizer and no request state beyond a slot's sampling parameters. The message is the
step's rows (slot, seed, start, KV slots, prefill ids, sample index, cached prefix) plus the requests
admitted since the last step; rank 0 sends it (one socket write per worker, no reply)
before queueing its own forward, so no rank waits on a host round trip: the GPUs meet in
the step's first collective. Sampled ids never travel: every rank samples the same
gathered logits with the same seeded sampler and stashes them in its own FutureMap.

Transport: TCP from the standard library, framed by `multiprocessing.connection`; it works
across nodes and leaves no files behind. Peers authenticate first (`auth`), messages are
typed msgspec (`wire`), and rank 0 stops listening once its workers are in.
"""
from __future__ import annotations

import logging
import select
import socket
import sys
import time
from multiprocessing.connection import Connection
from operator import attrgetter
from typing import Callable

import msgspec

from tandem.distributed.auth import prove, verify_worker
from tandem.distributed.wire import ROW_FIELDS, Admit, Message, Step, Stop, TierCopy
from tandem.request import Request
from tandem.sampling import SamplingParams
from tandem.scheduler.batch import Row, ScheduledBatch

log = logging.getLogger("tandem")

# A worker answers the challenge at once; a peer that does not is refused after this long.
HANDSHAKE_TIMEOUT_S = 5.0
_ACCEPT_POLL_S = 0.1

_row_tuple = attrgetter("req.slot", "req.seed", *ROW_FIELDS)  # WireRow's field order


class StepSender:
    """Rank 0's side: a listener the workers connect to; `accept` takes them all, then closes."""

    def __init__(self, host: str, key: bytes, speculative: bool = False):
        self.speculative = speculative  # workers keep speculative decoding's device state too
        self.listener = socket.create_server((host, 0), backlog=1024)
        self.port = self.listener.getsockname()[1]
        self.key = key
        self.conns: dict[int, Connection] = {}  # by rank
        self.admits: list[Admit] = []
        self.copies: list[TierCopy] = []  # host-tier copies of the next step
        self.wait_copy = 0  # the copy the next step's forward waits for (KVTierCopier.fence)
        self.encoder = msgspec.msgpack.Encoder()

    def accept(self, ranks: set[int], timeout_s: float, watch: Callable[[], None] = lambda: None) -> None:
        """Take one authenticated connection per rank; refuse (and log) anything else. `watch`
        raises if a rank failed meanwhile."""
        waiting, deadline = set(ranks), time.monotonic() + timeout_s
        while waiting:
            watch()
            if time.monotonic() > deadline:
                raise TimeoutError(f"tensor-parallel start-up: rank(s) {sorted(waiting)} did not join the "
                                   f"step channel within {timeout_s:.0f}s")
            if not select.select([self.listener], [], [], _ACCEPT_POLL_S)[0]:
                continue
            sock, addr = self.listener.accept()
            try:
                rank = verify_worker(sock, self.key, waiting, HANDSHAKE_TIMEOUT_S)
            except OSError as exc:  # AuthenticationError, a timeout, a reset
                log.warning("step channel: refused a connection from %s:%s: %s", addr[0], addr[1],
                            str(exc) or type(exc).__name__)
                sock.close()
                continue
            waiting.discard(rank)
            sock.setblocking(True)  # Connection reads the raw descriptor: blocking, no timeout
            self.conns[rank] = Connection(sock.detach())
        self.listener.close()  # everyone is in: from now on the port refuses connections

    def admit(self, slot: int, prompt_ids: list[int], params: SamplingParams, outputs: list[int],
              seed: int = 0) -> None:
        # Workers need a slot's params for sampling, its prompt only when penalties, prompt
        # logprobs (the scored tokens) or speculation (the device token history, the prompt
        # length of the noise keys) read it, and its outputs (none but after a preemption):
        # their step loop checks each row's sample index.
        send_prompt = params.uses_penalties or params.prompt_logprobs is not None or self.speculative
        self.admits.append(Admit(slot, prompt_ids if send_prompt else [], params, list(outputs), seed))

    def tier_copies(self, copies: list[tuple[str, list[int], list[int]]], wait_copy: int) -> None:
        """The host-tier copies the next step's plan queued, and the copy its forward waits for
        (sent with that step)."""
        self.copies, self.wait_copy = [TierCopy(*c) for c in copies], wait_copy

    def launch(self, batch: ScheduledBatch) -> None:
        admits, self.admits = self.admits, []
        copies, self.copies = self.copies, []
        self._send(Step(batch.step, admits, [_row_tuple(r) for r in batch.rows], copies, self.wait_copy))

    def stop(self) -> None:
        self._send(Stop())

    def closed_ranks(self) -> list[int]:
        """Ranks whose connection ended: workers never write, so a readable socket is its end."""
        try:
            return [rank for rank, conn in self.conns.items() if conn.poll(0)]
        except OSError:  # closed by close() meanwhile: rank 0 is stopping
            return []

    def _send(self, msg: Step | Stop) -> None:
        data = self.encoder.encode(msg)
        for conn in self.conns.values():
            conn.send_bytes(data)

    def close(self) -> None:
        for conn in self.conns.values():
            conn.close()
        self.listener.close()


class StepReceiver:
    """A worker's side: turns messages back into admitted requests and ScheduledBatches."""

    def __init__(self, conn: Connection):
        self.conn = conn
        self.decoder = msgspec.msgpack.Decoder(Message)
        self.reqs: dict[int, Request] = {}  # by slot: what a row's sampling reads

    @classmethod
    def connect(cls, host: str, port: int, rank: int, key: bytes, timeout_s: float) -> StepReceiver:
        sock = socket.create_connection((host, port), timeout=timeout_s)
        try:
            prove(sock, key, rank, timeout_s)  # rank 0 challenges once every rank is ready
        except BaseException:
            sock.close()
            raise
        sock.setblocking(True)
        return cls(Connection(sock.detach()))

    def recv(self, timeout_s: float) -> Step | Stop | None:
        """The next message, or None after `timeout_s` without one."""
        if not self.conn.poll(timeout_s):
            return None
        return self.decoder.decode(self.conn.recv_bytes())

    def admit(self, a: Admit) -> Request:
        """The slot's request as this rank knows it: what sampling reads, and the tokens so far.
        It never ends by itself (no stop ids, no length): rank 0 decides that, and stops
        sending its rows."""
        req = Request("", tuple(a.prompt_ids), a.params, a.seed, max_samples=sys.maxsize, slot=a.slot,
                      output_token_ids=list(a.outputs))
        self.reqs[a.slot] = req
        return req

    def batch(self, msg: Step) -> ScheduledBatch:
        rows = []
        for w in msg.rows:
            req = self.reqs[w.slot]
            req.seed = w.seed  # read when this step is launched, before the next message
            rows.append(Row(req, *msgspec.structs.astuple(w)[2:]))
        return ScheduledBatch(msg.step, rows)

    def close(self) -> None:
        self.conn.close()
