"""The tensor-parallel step channel: only peers holding the group's secret get in (both
ways), nothing received is unpickled, and a step arrives exactly as rank 0 scheduled it."""
import logging
import os
import pickle
import socket
import threading
from multiprocessing.connection import Connection

import msgspec
import pytest

from tandem import LLM
from tandem.distributed import channel, leader
from tandem.distributed.auth import SECRET_ENV, AuthenticationError, group_secret, prove
from tandem.distributed.channel import StepReceiver, StepSender
from tandem.distributed.wire import Stop
from tandem.request import Request
from tandem.sampling import SamplingParams
from tandem.scheduler.batch import Row, ScheduledBatch
from tiny_models import make_tiny_model

KEY = b"the group's secret, 32 bytes...."


def _in_thread(fn, *args) -> dict:
    """Run fn(*args) in a thread; the dict gets its 'result' or 'error' once joined."""
    out: dict = {}

    def run():
        try:
            out["result"] = fn(*args)
        except Exception as exc:
            out["error"] = exc
    out["thread"] = threading.Thread(target=run)
    out["thread"].start()
    return out


class _RunsCode:
    """Unpickling this creates a directory: proof that a payload ran."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return os.mkdir, (self.path,)


def _join(sender: StepSender, rank: int, key: bytes = KEY) -> dict:
    """A peer connected now (so queued in this order) whose handshake runs in a thread."""
    sock = socket.create_connection(("127.0.0.1", sender.port))

    def handshake() -> StepReceiver:
        try:
            prove(sock, key, rank, 10)
        except BaseException:
            sock.close()
            raise
        sock.setblocking(True)
        return StepReceiver(Connection(sock.detach()))
    return _in_thread(handshake)


def _pickle_peer(s: socket.socket, marker: str) -> bytes:
    """A stranger speaking the old protocol: a pickled rank that runs code when loaded."""
    with s:
        payload = pickle.dumps(_RunsCode(marker))
        s.sendall(len(payload).to_bytes(4, "big") + payload)
        s.shutdown(socket.SHUT_WR)
        s.settimeout(10)
        got = b""
        try:
            while chunk := s.recv(4096):  # until rank 0 hangs up on us
                got += chunk
        except ConnectionResetError:  # it did not read all we sent
            pass
        return got


def test_strangers_are_refused_and_logged_and_the_workers_get_in(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(channel, "HANDSHAKE_TIMEOUT_S", 0.5)
    sender = StepSender("127.0.0.1", KEY)
    marker = str(tmp_path / "pwned")
    silent = socket.create_connection(("127.0.0.1", sender.port))  # connects, says nothing
    strangers = [
        _in_thread(_pickle_peer, socket.create_connection(("127.0.0.1", sender.port)), marker),
        _join(sender, 1, b"a guessed secret, 32 bytes......"),
    ]
    workers = [_join(sender, rank) for rank in (1, 2)]  # queued behind the strangers
    with caplog.at_level(logging.WARNING, logger="tandem"):
        sender.accept({1, 2}, timeout_s=30)
    for t in strangers + workers:
        t["thread"].join(10)
    assert not os.path.exists(marker)
    assert len(strangers[0]["result"]) == 32  # the challenge, then rank 0 hung up
    assert isinstance(strangers[1]["error"], AuthenticationError)
    silent.close()
    assert all("error" not in w for w in workers) and len(sender.conns) == 2
    refusals = [r for r in caplog.records if "refused a connection from 127.0.0.1" in r.getMessage()]
    assert len(refusals) == 3
    with pytest.raises(ConnectionRefusedError):  # everyone is in: the port is closed
        socket.create_connection(("127.0.0.1", sender.port), timeout=5)

    # The authenticated workers still get rank 0's steps.
    params = SamplingParams(max_tokens=4, temperature=0.0)
    sender.admit(3, [1, 2], params, [])
    req = Request("r", [1, 2], params, 77, max_samples=4, slot=3)
    sender.launch(ScheduledBatch(5, [Row(req, 0, [10, 11], [1, 2], 0)]))
    for w in workers:
        receiver = w["result"]
        msg = receiver.recv(10)
        assert [a.slot for a in msg.admits] == [3] and msg.admits[0].params == params
        receiver.admit(msg.admits[0])
        (row,) = receiver.batch(msg).rows
        assert (row.req.slot, row.req.seed, row.start, row.kv_slots, row.prefill_ids, row.sample_index,
                row.cached_prefix) == (3, 77, 0, [10, 11], [1, 2], 0, None)
        receiver.close()
    sender.close()


def test_a_duplicate_or_unknown_rank_is_refused(caplog):
    sender = StepSender("127.0.0.1", KEY)
    first, bogus, duplicate, second = _join(sender, 1), _join(sender, 5), _join(sender, 1), _join(sender, 2)
    sender.accept({1, 2}, timeout_s=30)
    for t in (first, bogus, duplicate, second):
        t["thread"].join(10)
    assert isinstance(bogus["error"], AuthenticationError)  # holds the secret, but no such rank
    assert isinstance(duplicate["error"], AuthenticationError)
    assert len(sender.conns) == 2
    first["result"].close()
    second["result"].close()
    sender.close()


def _impostor(server: socket.socket) -> None:
    """A rank 0 without the secret: challenges, takes any proof, answers with a guess."""
    conn, _ = server.accept()
    with conn:
        conn.sendall(os.urandom(32))
        conn.recv(68)
        conn.sendall(os.urandom(32))
        conn.recv(1)


def test_a_worker_refuses_a_rank_0_without_the_secret():
    with socket.create_server(("127.0.0.1", 0)) as server:
        impostor = _in_thread(_impostor, server)
        with pytest.raises(AuthenticationError, match="does not hold this group's secret"):
            StepReceiver.connect("127.0.0.1", server.getsockname()[1], 1, KEY, timeout_s=10)
        impostor["thread"].join(10)
    # A real rank 0 with another secret hangs up on the worker: refused as well.
    other = StepSender("127.0.0.1", b"not the group's secret, 32 bytes")
    worker = _join(other, 1)
    with pytest.raises(TimeoutError):
        other.accept({1}, timeout_s=1)
    worker["thread"].join(10)
    assert isinstance(worker["error"], AuthenticationError)
    other.close()


def test_the_decoder_builds_only_step_messages(tmp_path):
    decoder = StepReceiver(conn=None).decoder
    marker = str(tmp_path / "pwned")
    with pytest.raises(msgspec.DecodeError):
        decoder.decode(pickle.dumps(_RunsCode(marker)))
    assert not os.path.exists(marker)
    with pytest.raises(msgspec.ValidationError):  # a row with a string where a slot goes
        decoder.decode(msgspec.msgpack.encode({"type": "Step", "step": 1, "admits": [],
                                               "rows": [["1", 0, 0, [1], None, 0, None]]}))
    bad_params = msgspec.msgpack.encode({"type": "Step", "step": 1, "rows": [],
                                         "admits": [[1, [], {"max_tokens": 0}, [], 0]]})
    with pytest.raises(msgspec.ValidationError, match="max_tokens"):  # SamplingParams validates
        decoder.decode(bad_params)
    assert isinstance(decoder.decode(msgspec.msgpack.encode(Stop())), Stop)


def test_multi_node_needs_a_shared_secret(monkeypatch):
    monkeypatch.delenv(SECRET_ENV, raising=False)
    with pytest.raises(ValueError, match=SECRET_ENV):
        group_secret(2)
    monkeypatch.setenv(SECRET_ENV, "short")
    with pytest.raises(ValueError, match="at least 16 characters"):
        group_secret(2)
    monkeypatch.setenv(SECRET_ENV, "x" * 40)
    assert group_secret(2) == "x" * 40
    a, b = group_secret(1), group_secret(1)  # one node: fresh per engine, whatever the environment says
    assert a != b and len(a) >= 64 and a != "x" * 40


def test_engine_refuses_strangers_at_start_up_and_keeps_working(tmp_path, monkeypatch, caplog):
    """During start-up someone on the machine connects to rank 0's step channel with the old
    pickle protocol (a payload that runs code) and with a guessed secret: both are refused and
    logged, nothing runs, the tokens are the one-rank engine's, and once the workers are in
    the port is closed."""
    path = make_tiny_model(tmp_path, "llama")
    marker = str(tmp_path / "pwned")
    real, strangers = leader.StepSender, []

    def sender_met_by_strangers(host: str, key: bytes, **kw) -> StepSender:
        sender = real(host, key, **kw)
        strangers.append(_in_thread(_pickle_peer, socket.create_connection((host, sender.port)), marker))
        strangers.append(_join(sender, 1, b"a guessed secret, 32 bytes......"))
        return sender
    monkeypatch.setattr(leader, "StepSender", sender_met_by_strangers)
    opts = dict(device="cpu", dtype="float32", max_total_tokens=1024, max_running_requests=8)
    prompts, params = [[5, 6, 7, 8, 9], [200, 3, 17]], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    with caplog.at_level(logging.WARNING, logger="tandem"):
        with LLM(str(path), tensor_parallel_size=2, **opts) as llm:
            with pytest.raises(ConnectionRefusedError):
                socket.create_connection(("127.0.0.1", llm.engine.parallel.sender.port), timeout=5)
            two = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    for t in strangers:
        t["thread"].join(10)
    assert not os.path.exists(marker)
    assert isinstance(strangers[1]["error"], AuthenticationError)
    assert sum("step channel: refused a connection" in r.getMessage() for r in caplog.records) == 2
    with LLM(str(path), tensor_parallel_size=1, **opts) as llm:
        assert [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == two
