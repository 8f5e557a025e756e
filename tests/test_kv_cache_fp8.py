"""kv_cache_dtype="fp8": the engine keeps its KV pools (target, draft, host tier, every rank's)
in e4m3 at 1 byte an element, and generates close to what the model-dtype pool gives.

The engine runs the torch reference here on the CPU (the kernels' own fp8 tests are in
test_kernels.py, test_cascade_attention.py and test_fused_ops.py) and the Triton kernels with
TANDEM_TEST_DEVICE=cuda."""
import pytest
import torch

from host_tier import assert_tiers_conserved, chat_specs, make_engine, run_chats, small_tiered_engine
from tandem import LLM, SamplingParams
from tandem.config import resolve_kv_cache_dtype
from tandem.memory.kv_cache import KVCache
from tiny_models import TEST_DEVICE, make_cycling_model, make_tiny_model
from workload import assert_kv_conserved

FP8 = torch.float8_e4m3fn


def _greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, **kw)


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 250, (int(torch.randint(5, 60, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("qwen3"), "qwen3")


def test_the_names_resolve_to_e4m3_or_the_models_dtype():
    assert resolve_kv_cache_dtype("auto", torch.bfloat16) == torch.bfloat16
    assert resolve_kv_cache_dtype("fp8", torch.bfloat16) == resolve_kv_cache_dtype("fp8_e4m3", torch.float32) == FP8
    with pytest.raises(ValueError, match="fp8_e5m2.*e4m3 only"):
        resolve_kv_cache_dtype("fp8_e5m2", torch.bfloat16)
    with pytest.raises(ValueError, match="one of auto, fp8, fp8_e4m3; got 'int8'"):
        resolve_kv_cache_dtype("int8", torch.bfloat16)


def test_a_bad_value_fails_before_the_model_loads(qwen3):
    with pytest.raises(ValueError, match="e4m3 only"):
        LLM(str(qwen3), device=TEST_DEVICE, kv_cache_dtype="fp8_e5m2")


def test_the_pool_is_e4m3_and_holds_twice_a_bf16_pools_tokens(qwen3):
    """The same byte budget holds 2x the tokens of a bf16 pool (the CPU pool comes from
    cpu_kv_cache_bytes; CUDA's from the memory plan, which divides by the same bytes per token)."""
    counts = {}
    for kv_dtype in ("auto", "fp8"):
        llm = LLM(str(qwen3), device="cpu", dtype="bfloat16", kv_cache_dtype=kv_dtype, cpu_kv_cache_bytes=1 << 20,
                  max_running_requests=512)
        engine = llm.engine
        counts[kv_dtype] = engine.kv_slots.count
        assert engine.kv.buffer.dtype == (FP8 if kv_dtype == "fp8" else torch.bfloat16)
        assert engine.kv.buffer.element_size() == (1 if kv_dtype == "fp8" else 2)
        assert engine.resolved_settings()["kv_cache_dtype"] == str(engine.kv.dtype).removeprefix("torch.")
        llm.close()
    assert counts["fp8"] == 2 * counts["auto"]


def test_greedy_outputs_and_logprobs_are_close_to_the_model_dtype_pools(tmp_path):
    """e4m3 KV moves attention a little: on a model with a clear next token (the cycling model,
    whose layers still count) most greedy tokens stay, and every prompt token's logprob (scored
    over the same history by both) moves by little. Seen on the CPU: 168 of 192 tokens, mean
    0.028, worst 0.18 (random tiny models, whose next tokens are near ties, keep far fewer)."""
    model, prompts = make_cycling_model(tmp_path), _prompts(12)
    outs = {}
    for kv_dtype in ("auto", "fp8"):
        with LLM(str(model), device=TEST_DEVICE, dtype="float32", kv_cache_dtype=kv_dtype) as llm:
            outs[kv_dtype] = llm.generate(prompts, _greedy(16, prompt_logprobs=0), use_tqdm=False)
    same = sum(x == y for a, b in zip(outs["auto"], outs["fp8"]) for x, y in zip(a.token_ids, b.token_ids))
    assert same >= 0.75 * 12 * 16, same
    gaps = torch.tensor([abs(next(iter(x.values())).logprob - next(iter(y.values())).logprob)
                         for a, b in zip(outs["auto"], outs["fp8"])
                         for x, y in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:])])
    assert gaps.max() < 0.4 and gaps.mean() < 0.06 and gaps.max() > 0, (gaps.max(), gaps.mean())


def test_prefix_cache_hits_read_the_same_fp8_kv(qwen3):
    prompts = _prompts(8, seed=1)
    with LLM(str(qwen3), device=TEST_DEVICE, dtype="float32", kv_cache_dtype="fp8") as llm:
        fresh = llm.generate(prompts, _greedy(12), use_tqdm=False)
        cached = llm.generate(prompts, _greedy(12), use_tqdm=False)
        assert_kv_conserved(llm.engine)
    assert sum(o.num_cached_tokens for o in cached) > 0
    assert [o.token_ids for o in cached] == [o.token_ids for o in fresh]


def test_the_host_tier_moves_an_fp8_pool_byte_for_byte(qwen3):
    """Histories evicted to the host tier and loaded back give what an unbounded fp8 pool gives:
    the host pool is e4m3 too and its copies move bytes."""
    rounds = chat_specs(conversations=6, turns=3, seed=3, vocab=250)
    want = run_chats(make_engine(qwen3, max_total_tokens=20000, kv_cache_dtype="fp8"), rounds)
    engine = small_tiered_engine(qwen3, kv_cache_dtype="fp8")
    host = engine.kv_tier.host
    assert host.data.dtype == FP8 and host.token_bytes == KVCache.bytes_per_token(
        len(engine.kv.k), *engine.kv.k[0].shape[1:], FP8)
    assert run_chats(engine, rounds) == want
    assert_tiers_conserved(engine, engine.stats())
    assert engine.stats()["host_cache_hit_tokens"] > 50  # histories came back from the host (80 seen)
    engine.close()


def test_a_draft_models_pool_is_fp8_too(tmp_path):
    """A model drafting for itself over fp8 pools: both pools e4m3, every proposal accepted
    (the draft reads what the target would), greedy output plain decoding's."""
    target = make_cycling_model(tmp_path)
    prompts, spec = _prompts(6, seed=2), {"model": str(target), "num_speculative_tokens": 3}
    runs = {}
    for name, config in (("plain", None), ("spec", spec)):
        with LLM(str(target), device=TEST_DEVICE, dtype="float32", kv_cache_dtype="fp8",
                 speculative_config=config, cuda_graph_max_batch=8) as llm:
            runs[name] = [o.token_ids for o in llm.generate(prompts, _greedy(20), use_tqdm=False)]
            if config is not None:
                assert llm.engine.draft_kv.buffer.dtype == llm.engine.kv.buffer.dtype == FP8
                s = llm.engine.stats()
                assert s["spec_decode_num_draft_tokens"] > 0
                assert s["spec_decode_num_accepted_tokens"] == s["spec_decode_num_draft_tokens"]
    assert runs["spec"] == runs["plain"]


@pytest.mark.skipif(TEST_DEVICE == "cuda" and torch.cuda.device_count() < 2, reason="tp=2 on CUDA needs 2 GPUs")
def test_tensor_parallel_ranks_each_keep_an_fp8_pool(tmp_path):
    """tp=2 (gloo on the CPU): each rank's pool is e4m3 (its share of the KV heads), and the
    outputs are tp=1's over the same pool type."""
    path = make_tiny_model(tmp_path, "qwen3", vocab_size=255)
    prompts = _prompts(3, seed=4)
    outs = {}
    for tp in (1, 2):
        with LLM(str(path), device=TEST_DEVICE, dtype="float32", kv_cache_dtype="fp8",
                 tensor_parallel_size=tp) as llm:
            assert llm.engine.kv.buffer.dtype == FP8
            outs[tp] = [o.token_ids for o in llm.generate(prompts, _greedy(10), use_tqdm=False)]
    assert outs[2] == outs[1]
