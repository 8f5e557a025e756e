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


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("heads", [(16, 8, 128), (8, 1, 128)], ids=["qwen3-0.6b", "one-kv-head"])
@pytest.mark.parametrize("norm", [True, False], ids=["qk_norm", "no_norm"])
def test_decode_rope_in_kernel_matches_unfused_on_gpu(heads, norm, dtype):
    """Experiments.fused_rope_attention compiled: the decode kernel's in-kernel (norm,) RoPE and
    K/V store against the RoPE launch + decode attention, with and without the fused merge,
    one split and several, and replayed in a CUDA graph at other lengths. Compiled kernels may
    contract multiply-adds differently, so values are compared within a rounding, not bit for bit."""
    from test_kernels import TOL, _unfused, _unrotated_case

    from tandem.kernels import decode_attention
    from tandem.kernels.decode_attention import SplitCounters
    seq_lens = [1, 300, 4000, 0, 129]
    u, k_cache, v_cache, r2t, req_slots, lens, loc = _unrotated_case(heads, seq_lens, dtype, norm)
    scale = u.head_dim ** -0.5

    def same(a, b):
        torch.testing.assert_close(a.float(), b.float(), atol=TOL[dtype], rtol=TOL[dtype])

    for num_splits, counters in ((1, None), (8, None), (8, SplitCounters())):
        ref_k, ref_v = k_cache.clone(), v_cache.clone()
        expected = _unfused(u, ref_k, ref_v, r2t, req_slots, lens, loc, fused_kv_write=True, num_splits=num_splits)
        k, v = k_cache.clone(), v_cache.clone()
        out = decode_attention(u.q, k, v, r2t, req_slots, lens, scale, max(seq_lens), num_splits=num_splits,
                               counters=counters, rope=u, loc=loc)
        same(k, ref_k)
        same(v, ref_v)
        same(out, expected)
    # A CUDA graph captured once, replayed after the rows' lengths, positions and new slots moved.
    k, v = k_cache.clone(), v_cache.clone()
    counters = SplitCounters()
    static_out = torch.empty_like(u.q)
    run = lambda: decode_attention(u.q, k, v, r2t, req_slots, lens, scale, 4096, out=static_out,  # noqa: E731
                                   counters=counters, rope=u, loc=loc)
    run()  # warm-up: compiles, sizes the counters
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    lens.copy_(torch.tensor([1, 250, 3000, 0, 100], dtype=torch.int32))  # slots the table already lists
    u.positions.copy_((lens.long() - 1).clamp(min=0))
    loc.copy_(torch.tensor([int(r2t[s, n - 1]) if n else 0 for s, n in zip(req_slots.tolist(), lens.tolist())]))
    k[loc], v[loc] = float("nan"), float("nan")
    ref_k, ref_v = k.clone(), v.clone()
    graph.replay()
    expected = _unfused(u, ref_k, ref_v, r2t, req_slots, lens, loc, fused_kv_write=True)
    same(k, ref_k)
    same(v, ref_v)
    same(static_out, expected)


def test_fused_rope_attention_engine_same_greedy_tokens(tmp_path, builtin_tokenizer):
    """The engine on the GPU (CUDA graphs, Qwen3-style q/k norm), the experiment on and off."""
    from tandem.config import Experiments
    from tiny_models import make_tiny_model
    path = make_tiny_model(tmp_path, "qwen3", vocab_size=len(builtin_tokenizer), eos_token_id=2)
    builtin_tokenizer.save_pretrained(path)
    specs = random_specs(24, 1000, seed=5)
    runs = []
    for on in (False, True):
        llm = LLM(str(path), device="cuda", dtype="float32", experiments=Experiments(fused_rope_attention=on))
        assert llm.engine.backend.fused_rope_attention == on and llm.engine.runner.graphs is not None
        runs.append(run_workload(llm.engine, specs))
    assert runs[0] == runs[1]
