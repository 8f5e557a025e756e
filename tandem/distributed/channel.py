"""Rank 0 -> workers: each step's host metadata, sent while rank 0's own step is queued.

Why broadcast and not a replayed scheduler: the scheduler, the prefix cache and the
detokenizer (stop strings end requests) then live on rank 0 only, and workers need no
tokenizer and no request state beyond a slot's sampling parameters. The message is the
step's rows (slot, seed, start, KV slots, prefill ids, sample index, cached prefix) plus the requests
admitted since the last step; rank 0 sends it (one socket write per worker, no reply)
before queueing its own forward, so no rank waits on a host round trip: the GPUs meet in
the step's first collective. Sampled ids never travel: every rank samples the same
gathered logits with the same seeded sampler and stashes them in its own FutureMap.

Transport: plain TCP sockets from the standard library (`multiprocessing.connection`), so
the engine needs nothing beyond torch; it works across nodes and leaves no files behind.
"""
import dataclasses
import pickle
from dataclasses import dataclass, field
from multiprocessing.connection import Client, Connection, Listener

from tandem.request import Request
from tandem.sampling import SamplingParams
from tandem.scheduler.batch import Row, ScheduledBatch


@dataclass
class StepMessage:
    admits: list[tuple] = field(default_factory=list)  # start_request arguments, in order
    step: int = -1
    rows: list[tuple] = field(default_factory=list)  # (slot, seed, *ROW_FIELDS)
    stop: bool = False


# Every Row field but the request travels as is (new fields travel without edits here).
ROW_FIELDS = tuple(f.name for f in dataclasses.fields(Row) if f.name != "req")


class StepSender:
    """Rank 0's side: a listener the workers connect to; `accept` once all said ready."""

    def __init__(self, host: str):
        self.listener = Listener((host, 0), backlog=1024)
        self.port = self.listener.address[1]
        self.conns: list[Connection] = []
        self.pending = StepMessage()

    def accept(self, num_workers: int, ranks: set[int]) -> None:
        """Take the workers' connections (each sent its rank first: strangers are refused)."""
        while len(self.conns) < num_workers:
            conn = self.listener.accept()
            if conn.poll(5) and pickle.loads(conn.recv_bytes()) in ranks:
                self.conns.append(conn)
            else:
                conn.close()

    def admit(self, slot: int, prompt_ids: list[int], params: SamplingParams, outputs: list[int]) -> None:
        # Workers need a slot's params for sampling; its history only when penalties read it.
        history = params.uses_penalties
        self.pending.admits.append((slot, prompt_ids if history else [], params,
                                    list(outputs) if history else []))

    def launch(self, batch: ScheduledBatch) -> None:
        msg, self.pending = self.pending, StepMessage()
        msg.step = batch.step
        msg.rows = [(r.req.slot, r.req.seed, *(getattr(r, f) for f in ROW_FIELDS)) for r in batch.rows]
        self._send(msg)

    def stop(self) -> None:
        self._send(StepMessage(stop=True))

    def _send(self, msg: StepMessage) -> None:
        data = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
        for conn in self.conns:
            conn.send_bytes(data)

    def close(self) -> None:
        for conn in self.conns:
            conn.close()
        self.listener.close()


class StepReceiver:
    """A worker's side: turns messages back into start_request calls and ScheduledBatches."""

    def __init__(self, host: str, port: int, rank: int):
        self.conn = Client((host, port))
        self.conn.send_bytes(pickle.dumps(rank))
        self.params: dict[int, SamplingParams] = {}

    def recv(self, timeout_s: float) -> StepMessage | None:
        """The next message, or None after `timeout_s` without one."""
        if not self.conn.poll(timeout_s):
            return None
        return pickle.loads(self.conn.recv_bytes())

    def batch(self, msg: StepMessage) -> ScheduledBatch:
        rows = []
        for slot, seed, *values in msg.rows:
            req = Request("", [], self.params[slot], seed, max_samples=0, slot=slot)
            rows.append(Row(req, **dict(zip(ROW_FIELDS, values))))
        return ScheduledBatch(msg.step, rows)

    def close(self) -> None:
        self.conn.close()
