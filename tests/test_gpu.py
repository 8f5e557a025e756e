"""GPU-only checks of the overlap loop (run on the H200 through the device tool)."""
import pytest
import torch

from tandem import LLM, SamplingParams
from tandem.config import Experiments
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


@pytest.mark.parametrize("per_ring_slot", [True, False])
def test_graph_and_eager_decode_agree(tiny_text_model, per_ring_slot):
    """Graphs per ring slot, or one per bucket fed by a device copy from the ring slot
    (`decode_graph_per_ring_slot` off): the eager tokens either way."""
    specs = random_specs(40, 1000, seed=21)
    runs = []
    for graph in ("on", "off"):
        llm = LLM(str(tiny_text_model), device="cuda", dtype="float32", cuda_graph=graph,
                  experiments=Experiments(decode_graph_per_ring_slot=per_ring_slot))
        runs.append(run_workload(llm.engine, specs))
        if graph == "on":
            graphs = llm.engine.runner.graphs
            assert {ring for _, ring, _ in graphs.graphs} == ({0, 1} if per_ring_slot else {0})
    assert runs[0] == runs[1]
