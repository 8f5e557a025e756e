"""close() gives back what the engine started: the grammar compiler's threads, under
tensor parallelism the worker processes, and in the server the engine process and its IPC
files."""
import asyncio
import os
import threading
import time

from tandem import LLM, SamplingParams
from tandem.config import EngineConfig
from tandem.server.client import EngineClient
from tandem.server.metrics import Metrics
from tiny_models import TEST_DEVICE, make_tiny_model


def _grammar_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("tandem-grammar")]


def _gone_within(predicate, seconds: float = 5.0) -> bool:
    deadline = time.monotonic() + seconds
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.02)
    return predicate()


def test_close_ends_the_grammar_threads(tiny_text_model):
    llm = LLM(str(tiny_text_model), device=TEST_DEVICE, dtype="float32")
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=8, temperature=0, regex="(yes|no)"),
                       use_tqdm=False)[0]
    assert out.text in ("yes", "no")
    assert _grammar_threads()  # the compile ran in the pool
    # Held past close(), as anything might (a frozen cycle, a caller): dropping the engine's
    # reference alone would let the threads live as long as this one.
    grammar = llm.engine.grammar
    llm.close()
    # The pool is shut down (idle threads leave at once; queued compilations are cancelled).
    assert _gone_within(lambda: not _grammar_threads()), [t.name for t in _grammar_threads()]
    del grammar


def test_close_ends_the_tensor_parallel_workers(tmp_path):
    path = make_tiny_model(tmp_path, "llama")
    llm = LLM(str(path), device="cpu", dtype="float32", tensor_parallel_size=2, max_total_tokens=256,
              max_running_requests=4)
    workers = list(llm.engine.parallel.procs.values())
    assert len(workers) == 1 and workers[0].poll() is None
    llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)
    llm.close()
    assert workers[0].poll() == 0  # stopped by rank 0 and reaped: exit code 0, no zombie
    assert not os.path.exists(f"/proc/{workers[0].pid}")


def test_server_client_close_ends_the_engine_process_and_removes_its_ipc_files(tmp_path):
    path = make_tiny_model(tmp_path, "llama")
    cfg = EngineConfig(model=str(path), device="cpu", dtype="float32", max_total_tokens=256,
                       max_running_requests=4)

    async def start_and_close():
        client = EngineClient(cfg, max_waiting=8, metrics=Metrics())
        await client.start()
        ipc_dir, proc = client._dir, client.proc
        assert os.listdir(ipc_dir)  # the two sockets
        await client.close()
        return ipc_dir, proc

    ipc_dir, proc = asyncio.run(start_and_close())
    assert not os.path.exists(ipc_dir)
    assert proc.exitcode == 0
