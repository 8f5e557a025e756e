"""Tensor parallelism under torchrun (one process per rank; rank 0 is the engine): the same
greedy tokens as one rank, on one node and on two, and clear errors for settings that
disagree with torchrun's environment."""
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from tandem import LLM, SamplingParams
from tandem.bench.launch import free_port
from tandem.config import EngineConfig
from tandem.distributed.auth import SECRET_ENV
from tandem.distributed.launch import Launch
from tandem.distributed.runtime import WorkerDiedError
from tandem.distributed.torchrun import torchrun_env, torchrun_layout
from test_tensor_parallel import _children
from tiny_models import make_tiny_model
from torchrun_generate import OPTS, PROMPTS

TESTS = Path(__file__).resolve().parent
SECRET = "a shared secret for this test"
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS.parent), str(TESTS)]), SECRET_ENV: SECRET}
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]


def _tp1_tokens(path) -> list[list[int]]:
    with LLM(str(path), tensor_parallel_size=1, **OPTS) as llm:
        outs = llm.generate(PROMPTS, SamplingParams(max_tokens=8, temperature=0), use_tqdm=False)
    return [o.token_ids for o in outs]


def _torchrun_env(rank: int, world: int, port: int, **extra) -> dict[str, str]:
    """What torchrun sets for one process of a one-node job (set by hand)."""
    return {"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": str(world), "GROUP_RANK": "0", "GROUP_WORLD_SIZE": "1",
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "TORCHELASTIC_RUN_ID": "test",
            "TORCHELASTIC_RESTART_COUNT": "0", **extra}


def test_torchrun_one_node_matches_tp1(tmp_path):
    """`torchrun --standalone --nproc-per-node 2 script.py`: rank 0 generates, rank 1 serves."""
    path = make_tiny_model(tmp_path, "qwen3", vocab_size=255)
    out = tmp_path / "tokens.json"
    run = subprocess.run([*TORCHRUN, "--standalone", "--nproc-per-node", "2", str(TESTS / "torchrun_generate.py"),
                          str(path), str(out)], env=ENV, timeout=240, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-4000:]
    assert json.loads(out.read_text()) == _tp1_tokens(path)


def test_torchrun_two_nodes_matches_tp1(tmp_path):
    """Two torchrun agents (static rendezvous, one rank each) as two nodes on localhost; node 1
    runs `tandem serve --tp 2`, which under torchrun is a worker rank and opens no HTTP port."""
    path = make_tiny_model(tmp_path, "llama-mqa-headdim-llama3rope-tied", vocab_size=251)
    out, port = tmp_path / "tokens.json", free_port()
    node = [*TORCHRUN, "--nnodes", "2", "--nproc-per-node", "1", "--master-addr", "127.0.0.1",
            "--master-port", str(port)]
    node1 = subprocess.Popen([*node, "--node-rank", "1", "-m", "tandem.server", "--model", str(path), "--tp", "2",
                              "--device", "cpu", "--dtype", "float32", "--max-total-tokens", "4096",
                              "--max-running-requests", "16"], env=ENV)
    try:
        node0 = subprocess.run([*node, "--node-rank", "0", str(TESTS / "torchrun_generate.py"), str(path), str(out)],
                               env=ENV, timeout=240, capture_output=True, text=True)
        assert node0.returncode == 0, node0.stderr[-4000:]
        assert node1.wait(60) == 0
    finally:
        if node1.poll() is None:
            node1.kill()
            node1.wait()
    assert json.loads(out.read_text()) == _tp1_tokens(path)


def test_torchrun_serves_http_from_rank_0_and_stops_cleanly(tmp_path):
    """`torchrun -m tandem.server --tp 2`: rank 0 serves HTTP, rank 1 only steps; torchrun's
    SIGTERM to every rank lets rank 0 finish (rank 1 waits for its stop) and leaves nothing."""
    path = make_tiny_model(tmp_path, "llama")
    port = free_port()
    job = subprocess.Popen([*TORCHRUN, "--standalone", "--nproc-per-node", "2", "-m", "tandem.server", "--model",
                            str(path), "--tp", "2", "--device", "cpu", "--dtype", "float32", "--port", str(port),
                            "--max-total-tokens", "4096"], env=ENV, stderr=subprocess.PIPE, text=True)
    try:
        body = json.dumps({"model": "llama", "prompt": [5, 6, 7], "max_tokens": 5, "temperature": 0}).encode()
        deadline = time.monotonic() + 120
        while True:
            try:
                with urllib.request.urlopen(urllib.request.Request(
                        f"http://127.0.0.1:{port}/v1/completions", body, {"content-type": "application/json"})) as r:
                    reply = json.load(r)
                break
            except OSError:
                assert job.poll() is None and time.monotonic() < deadline, "the server did not come up"
                time.sleep(0.5)
        assert reply["usage"]["completion_tokens"] == 5
        job.terminate()
        _, err = job.communicate(timeout=60)
        assert " ERROR " not in err  # no rank ended before rank 0 had stopped it
    finally:
        if job.poll() is None:
            job.kill()
            job.wait()
    assert not _children()


def test_hand_set_torchrun_env_and_a_dead_rank_fails_generate(tmp_path, monkeypatch):
    """torchrun's variables set by hand (no agent: rank 0 hosts the store); killing rank 1,
    which this process did not start as a worker, fails generate through its closed channel."""
    path = make_tiny_model(tmp_path, "llama")
    port = free_port()
    rank1 = subprocess.Popen([sys.executable, str(TESTS / "torchrun_generate.py"), str(path), str(tmp_path / "x")],
                             env={**ENV, **_torchrun_env(1, 2, port)})
    monkeypatch.setenv(SECRET_ENV, SECRET)
    for k, v in _torchrun_env(0, 2, port).items():
        monkeypatch.setenv(k, v)
    try:
        llm = LLM(str(path), tensor_parallel_size=2, **OPTS)
        assert llm.engine.parallel.procs == {}  # torchrun's job, not ours
        ids = [o.token_ids for o in llm.generate(PROMPTS, SamplingParams(max_tokens=8, temperature=0),
                                                 use_tqdm=False)]
        monkeypatch.undo()  # the reference run: one rank, no torchrun
        assert ids == _tp1_tokens(path)
        threading.Timer(1.0, os.kill, (rank1.pid, signal.SIGKILL)).start()
        started = time.monotonic()
        with pytest.raises(WorkerDiedError, match="rank 1 closed its step channel"):
            llm.generate([[5, 6, 7]] * 64, SamplingParams(max_tokens=500, temperature=0, ignore_eos=True),
                         use_tqdm=False)
        assert time.monotonic() - started < 10
        llm.close()
    finally:
        if rank1.poll() is None:
            rank1.kill()
        rank1.wait()
    assert not _children()


@pytest.mark.parametrize("env,overrides,match", [
    (dict(WORLD_SIZE="4", LOCAL_WORLD_SIZE="4"), {}, r"torchrun started 4 processes \(WORLD_SIZE\) but "
                                                     r"tensor_parallel_size=2"),
    ({}, dict(master_port=1), "master_port=1 disagrees with torchrun's environment"),
    ({}, dict(nnodes=2), "nnodes=2 disagrees with torchrun's environment"),
    ({}, dict(master_addr="10.0.0.9"), "master_addr=10.0.0.9 disagrees"),
    (dict(GROUP_WORLD_SIZE="2", WORLD_SIZE="2", LOCAL_WORLD_SIZE="2"), {}, "same --nproc-per-node"),
])
def test_settings_that_disagree_with_torchrun_are_clear_errors(monkeypatch, env, overrides, match):
    monkeypatch.setenv(SECRET_ENV, SECRET)
    cfg = EngineConfig(tensor_parallel_size=2, launch=Launch(**overrides))
    with pytest.raises(ValueError, match=match):
        torchrun_layout(cfg, torchrun_env({**_torchrun_env(0, 2, 29500), **env}))


def test_torchrun_needs_the_operators_secret_even_on_one_node(tmp_path, monkeypatch):
    """torchrun starts the ranks, so no fresh secret can reach them: the LLM refuses before
    starting anything."""
    path = make_tiny_model(tmp_path, "llama")
    monkeypatch.delenv(SECRET_ENV, raising=False)
    for k, v in _torchrun_env(0, 2, free_port()).items():
        monkeypatch.setenv(k, v)
    with pytest.raises(ValueError, match=f"started by torchrun needs .*{SECRET_ENV}"):
        LLM(str(path), tensor_parallel_size=2, **OPTS)
    with pytest.raises(ValueError, match=r"\(WORLD_SIZE\) but tensor_parallel_size=4"):  # checked first
        LLM(str(path), tensor_parallel_size=4, **{**OPTS, "max_running_requests": 8})
    assert not _children()


def test_one_rank_ignores_torchrun(tmp_path, monkeypatch):
    """tensor_parallel_size=1 under torchrun: an independent engine per process."""
    assert torchrun_env({}) is None
    path = make_tiny_model(tmp_path, "llama")
    expected = _tp1_tokens(path)
    for k, v in _torchrun_env(1, 2, 1).items():  # no store at port 1: touching it would fail
        monkeypatch.setenv(k, v)
    assert _tp1_tokens(path) == expected


def test_a_worker_ranks_start_up_failure_is_one_clear_error_on_rank_0(tmp_path, monkeypatch):
    """Rank 1 holds another secret: it fails to start, says so through the store, and waits
    until rank 0 has read it (torchrun would stop rank 0 once rank 1 exits)."""
    path = make_tiny_model(tmp_path, "llama")
    port = free_port()
    rank1 = subprocess.Popen([sys.executable, str(TESTS / "torchrun_generate.py"), str(path), str(tmp_path / "x")],
                             env={**ENV, **_torchrun_env(1, 2, port), SECRET_ENV: "another secret, not the group's"})
    monkeypatch.setenv(SECRET_ENV, SECRET)
    for k, v in _torchrun_env(0, 2, port).items():
        monkeypatch.setenv(k, v)
    try:
        with pytest.raises(RuntimeError, match="rank 1 failed to start: AuthenticationError"):
            LLM(str(path), tensor_parallel_size=2, **OPTS)
        assert rank1.wait(30) == 1
    finally:
        if rank1.poll() is None:
            rank1.kill()
            rank1.wait()
    assert not _children()


@pytest.mark.parametrize("flag", [["--dp", "2"], ["--restart-engine"]])
def test_serve_refuses_more_engines_under_torchrun(monkeypatch, capsys, flag):
    from tandem.server.cli import main
    for k, v in _torchrun_env(0, 2, 1).items():
        monkeypatch.setenv(k, v)
    assert main(["--tp", "2", "--device", "cpu", *flag]) == 2
    assert "do not work with --tp > 1 under torchrun" in capsys.readouterr().err
