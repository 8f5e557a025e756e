"""Tensor parallelism on the CPU (gloo): two ranks give the one-rank model's tokens and
logprobs; overlap on == off; a dead worker fails the engine at once; nothing is left behind."""
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from tandem import LLM, SamplingParams
from tandem.distributed.runtime import WorkerDiedError
from tandem.entrypoints.ranks import build_engine
from tandem.config import EngineConfig
from tandem.distributed.launch import Launch
from tiny_models import make_cycling_model, make_tiny_model
from workload import random_specs, run_workload

# One rank's share of the CPU each: the tests run on small shared machines.
OPTS = dict(device="cpu", dtype="float32", max_total_tokens=4096, max_running_requests=16)


def _children() -> list[int]:
    """Live child processes of this process (from /proc; zombies are reaped by Popen.wait).
    Python's multiprocessing resource tracker is not counted: an earlier test's spawned engine
    process starts it once, and it lives as long as the test process by design."""
    me, kids = str(os.getpid()), []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
                cmdline = open(f"/proc/{pid}/cmdline", "rb").read()
            except OSError:
                continue
            if fields[1] == me and fields[0] != "Z" and b"multiprocessing.resource_tracker" not in cmdline:
                kids.append(int(pid))
    return kids


def _run(path, tp: int, prompts, params) -> list:
    """Outputs of the prompts run twice: the second time their prefixes come from the cache."""
    with LLM(str(path), tensor_parallel_size=tp, **OPTS) as llm:
        fresh = llm.generate(prompts, params, use_tqdm=False)
        cached = llm.generate(prompts, params, use_tqdm=False)
    assert [o.token_ids for o in cached] == [o.token_ids for o in fresh]
    assert sum(o.num_cached_tokens for o in cached) > 0
    return cached


# A single KV head (replicated on both ranks), an odd vocab (padded), qkv bias + tied
# embeddings, q/k norm: the shapes sharding has to get right.
@pytest.mark.parametrize("variant,overrides", [
    ("llama-mqa-headdim-llama3rope-tied", dict(vocab_size=251)),
    ("qwen2", {}),
    ("qwen3", dict(vocab_size=255)),
])
def test_tp2_matches_tp1(tmp_path, variant, overrides):
    path = make_tiny_model(tmp_path, variant, **overrides)
    prompts = [[5, 6, 7, 8, 9], list(range(3, 60)), [200, 3, 17]]
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, logprobs=5)
    one, two = _run(path, 1, prompts, params), _run(path, 2, prompts, params)
    for a, b in zip(one, two):
        assert a.token_ids == b.token_ids
        for la, lb in zip(a.logprobs, b.logprobs):  # {token id: Logprob}, the chosen token first
            assert list(la) == list(lb)
            for x, y in zip(la.values(), lb.values()):
                assert abs(x.logprob - y.logprob) <= 1e-4 * max(1.0, abs(x.logprob))
    assert not _children()


def test_tp2_overlap_on_equals_off(tmp_path):
    """Preemption (small pool), chunked prefill, aborts, seeded sampling: same either way."""
    path = make_tiny_model(tmp_path, "llama", vocab_size=1000)
    specs = random_specs(40, 1000, seed=3)
    runs = {}
    for overlap in (True, False):
        engine = build_engine(EngineConfig(model=str(path), tensor_parallel_size=2, disable_overlap=not overlap,
                                           chunked_prefill_size=16, **{**OPTS, "max_total_tokens": 500}))
        try:
            runs[overlap] = run_workload(engine, specs)
            assert engine.scheduler.num_preemptions > 0
        finally:
            engine.close()
    assert runs[True] == runs[False]
    assert not _children()


@pytest.mark.slow
@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_tp2_speculative_decoding_matches_tp1(tmp_path, method):
    """Speculation under tensor parallelism: every rank keeps the token history, lengths and
    (for a draft model, run whole on every rank) the draft's KV and draws, and reaches the same
    verdicts. Greedy and seeded sampled outputs equal one rank's; greedy equals plain decoding."""
    path = make_cycling_model(tmp_path / "target")
    spec = ({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3} if method == "ngram" else
            {"model": str(make_cycling_model(tmp_path / "draft", seed=5, num_hidden_layers=1)),
             "num_speculative_tokens": 3})
    prompts = [[5, 6, 7, 8, 9], list(range(3, 60)), [200, 3, 17], [40, 41]]
    params = [SamplingParams(max_tokens=30, temperature=0, ignore_eos=True),
              SamplingParams(max_tokens=25, temperature=0.9, seed=3, ignore_eos=True)]
    runs = {}
    for tp, speculative in ((1, None), (1, spec), (2, spec)):
        with LLM(str(path), tensor_parallel_size=tp, speculative_config=speculative, **OPTS) as llm:
            outs = llm.generate(prompts * 2, params * 4, use_tqdm=False)
            runs[tp, speculative is not None] = [o.token_ids for o in outs]
            if speculative is not None:
                assert llm.engine.stats()["spec_decode_num_accepted_tokens"] > 20
    assert runs[2, True] == runs[1, True]
    assert runs[1, True][::2] == runs[1, False][::2]  # the greedy rows
    assert not _children()


def test_killed_worker_fails_generate_fast_and_close_leaves_nothing(tmp_path):
    path = make_tiny_model(tmp_path, "llama")
    llm = LLM(str(path), tensor_parallel_size=2, **OPTS)
    worker = llm.engine.parallel.procs[1]
    killer = threading.Timer(1.0, os.kill, (worker.pid, signal.SIGKILL))
    killer.start()
    started = time.monotonic()
    with pytest.raises(WorkerDiedError, match="rank 1 .* died .*SIGKILL"):
        llm.generate([[5, 6, 7]] * 64, SamplingParams(max_tokens=500, temperature=0, ignore_eos=True),
                     use_tqdm=False)  # ~32k tokens (within the 512-token context): outlasts the kill
    assert time.monotonic() - started < 10
    with pytest.raises(WorkerDiedError):  # later calls fail at once, too
        llm.generate([[5]], SamplingParams(max_tokens=2), use_tqdm=False)
    llm.close()
    assert not _children()


def test_close_stops_workers(tiny_text_model):
    llm = LLM(str(tiny_text_model), tensor_parallel_size=2, **OPTS)
    assert len(_children()) == 1
    llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3), use_tqdm=False)
    with pytest.raises(ValueError, match="constraint.*tensor_parallel_size"):
        llm.generate(["a"], SamplingParams(max_tokens=3, regex="[ab]+"), use_tqdm=False)
    llm.close()
    llm.close()  # idempotent
    assert not _children()


def test_bad_shapes_are_clear_errors(tmp_path):
    path = make_tiny_model(tmp_path, "llama")  # 4 heads, 2 KV heads
    with pytest.raises(ValueError, match="tensor_parallel_size=3 does not divide the model's 4 attention heads"):
        LLM(str(path), tensor_parallel_size=3, **OPTS)
    with pytest.raises(ValueError, match="tensor_parallel_size=8 does not divide"):
        LLM(str(path), tensor_parallel_size=8, **OPTS)
    assert not _children()


def test_two_nodes_on_localhost(tmp_path, monkeypatch):
    """--nnodes 2: node 1 runs `tandem serve --node-rank 1` (its ranks only), rank 0 the engine;
    both hold the same TANDEM_TP_SECRET."""
    path = make_tiny_model(tmp_path, "qwen2")
    monkeypatch.setenv("TANDEM_TP_SECRET", "a shared secret for this test")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    node1 = subprocess.Popen(
        [sys.executable, "-m", "tandem.server", "--model", str(path), "--device", "cpu", "--dtype", "float32",
         "--tp", "2", "--nnodes", "2", "--node-rank", "1", "--master-addr", "127.0.0.1", "--master-port",
         str(port), "--max-total-tokens", "4096", "--max-running-requests", "16"],
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])})
    try:
        prompts, params = [[5, 6, 7, 8, 9], [200, 3, 17]], SamplingParams(max_tokens=8, temperature=0)
        with LLM(str(path), tensor_parallel_size=2, launch=Launch(nnodes=2, master_port=port), **OPTS) as llm:
            assert _children() == [node1.pid]  # rank 1 lives on the other "node"
            two = llm.generate(prompts, params, use_tqdm=False)
        assert node1.wait(30) == 0
    finally:
        if node1.poll() is None:
            node1.kill()
    one = _run(path, 1, prompts, params)
    assert [o.token_ids for o in one] == [o.token_ids for o in two]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_tp2_on_cuda_with_graphs_matches_tp1(tmp_path):
    """NCCL, the all-reduces and the logits all-gather captured in the decode graphs."""
    path = make_tiny_model(tmp_path, "qwen3")
    opts = dict(device="cuda", dtype="float32", max_total_tokens=4096, max_running_requests=16)
    prompts = [[5, 6, 7, 8, 9], list(range(3, 60)), [200, 3, 17]]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    runs = {}
    for tp in (1, 2):
        with LLM(str(path), tensor_parallel_size=tp, **opts) as llm:
            assert llm.engine.runner.graphs is not None
            runs[tp] = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert runs[1] == runs[2]
    assert not _children()
