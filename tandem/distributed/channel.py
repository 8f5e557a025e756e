"""Rank 0 -> workers: each step's host metadata, sent while rank 0's own step is queued.

Why broadcast and not a replayed scheduler: the scheduler, the prefix cache and the
detokenizer (stop strings end requests) then live on rank 0 only, and workers need no
tokenizer and no request state beyond a slot's sampling parameters. The message is the
step's rows (slot, seed, start, KV slots, prefill ids, sample index) plus the requests
admitted since the last step; rank 0 sends it (one non-blocking ZMQ push per worker, no
reply) before queueing its own forward, so no rank waits on a host round trip; the GPUs
meet in the step's first collective. Sampled ids never travel: every rank samples the same
gathered logits with the same seeded sampler and stashes them in its own FutureMap.
"""
import pickle
from dataclasses import dataclass, field

import zmq

from tandem.request import Request
from tandem.sampling import SamplingParams
from tandem.scheduler.batch import Row, ScheduledBatch


@dataclass
class StepMessage:
    admits: list[tuple] = field(default_factory=list)  # start_request arguments, in order
    step: int = -1
    rows: list[tuple] = field(default_factory=list)  # (slot, seed, start, kv_slots, prefill_ids, sample_index)
    stop: bool = False


class StepSender:
    """Rank 0's side: one PUSH socket per worker (TCP: works across nodes, leaves no files)."""

    def __init__(self, host: str, num_workers: int):
        self.ctx = zmq.Context()
        self.sockets, self.addresses = [], []
        for _ in range(num_workers):
            sock = self.ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.SNDHWM, 0)  # never block rank 0 (a dead worker is the watchdog's)
            sock.setsockopt(zmq.LINGER, 0)
            port = sock.bind_to_random_port(f"tcp://{host}")
            self.sockets.append(sock)
            self.addresses.append(f"tcp://{host}:{port}")
        self.pending = StepMessage()

    def admit(self, slot: int, prompt_ids: list[int], params: SamplingParams, outputs: list[int]) -> None:
        # Workers need a slot's params for sampling; its history only when penalties read it.
        history = params.uses_penalties
        self.pending.admits.append((slot, prompt_ids if history else [], params,
                                    list(outputs) if history else []))

    def launch(self, batch: ScheduledBatch) -> None:
        msg, self.pending = self.pending, StepMessage()
        msg.step = batch.step
        msg.rows = [(r.req.slot, r.req.seed, r.start, r.kv_slots, r.prefill_ids, r.sample_index)
                    for r in batch.rows]
        self._send(msg)

    def stop(self) -> None:
        self._send(StepMessage(stop=True))

    def _send(self, msg: StepMessage) -> None:
        data = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
        for sock in self.sockets:
            sock.send(data, copy=False)

    def close(self) -> None:
        for sock in self.sockets:
            sock.close(0)
        self.ctx.term()


class StepReceiver:
    """A worker's side: turns messages back into start_request calls and ScheduledBatches."""

    def __init__(self, address: str):
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.PULL)
        self.sock.setsockopt(zmq.RCVHWM, 0)
        self.sock.connect(address)
        self.params: dict[int, SamplingParams] = {}

    def recv(self, timeout_ms: int) -> StepMessage | None:
        """The next message, or None after `timeout_ms` without one."""
        if not self.sock.poll(timeout_ms):
            return None
        return pickle.loads(self.sock.recv())

    def batch(self, msg: StepMessage) -> ScheduledBatch:
        rows = []
        for slot, seed, start, kv_slots, prefill_ids, sample_index in msg.rows:
            req = Request("", [], self.params[slot], seed, max_samples=0, slot=slot)
            rows.append(Row(req, start, kv_slots, prefill_ids, sample_index))
        return ScheduledBatch(msg.step, rows)

    def close(self) -> None:
        self.sock.close(0)
        self.ctx.term()
