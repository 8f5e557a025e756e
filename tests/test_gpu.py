"""GPU-only checks of the overlap loop (run on the H200 through the device tool)."""
import pytest
import torch

from tandem import LLM, SamplingParams
from workload import random_specs, run_workload, step_without_host_syncs

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def test_steady_decode_loop_has_no_hidden_sync(tiny_text_model):
    """Under sync-debug "error" every implicit host sync in the loop raises; the one
    sanctioned wait (copy_done) is exempt. Prefill, graph decode, eager mixed batches,
    sampling with top-p/top-k, logprobs and penalties all run inside the guard."""
    llm = LLM(str(tiny_text_model), device="cuda", dtype="float32", enable_mixed_batch=True,
              chunked_prefill_size=16)
    engine = llm.engine
    assert engine.runner.graphs is not None
    warm = [SamplingParams(max_tokens=8, temperature=0.8, top_p=0.9, top_k=20, logprobs=2,
                           presence_penalty=0.5, ignore_eos=True)]
    llm.generate([[5, 6, 7, 8] * 10], warm, use_tqdm=False)  # compile everything first
    params = [SamplingParams(max_tokens=24, temperature=t, top_p=0.9, top_k=20, logprobs=2,
                             presence_penalty=0.5 if t else 0.0, ignore_eos=True) for t in (0, 0.8)]
    for i, p in enumerate(params * 8):
        engine.add_request([5 + i, 6, 7, 8] * (3 + i), p, request_id=f"g{i}")
    step_without_host_syncs(engine)
    assert all(len(engine.output(f"g{i}").token_ids) == 24 for i in range(16))


def test_graph_and_eager_decode_agree(tiny_text_model):
    specs = random_specs(40, 1000, seed=21)
    runs = []
    for graph in ("on", "off"):
        llm = LLM(str(tiny_text_model), device="cuda", dtype="float32", cuda_graph=graph)
        runs.append(run_workload(llm.engine, specs))
    assert runs[0] == runs[1]
