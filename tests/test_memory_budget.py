"""KV pool sizing from total memory: the arithmetic (figures injected) and the profiling forward."""
import pytest
import torch

from tandem.attention import make_attention_backend
from tandem.config import EngineConfig
from tandem.engine import Engine
from tandem.memory.kv_cache import KVCache
from tandem.memory_budget import (GiB, graph_reserve, plan_kv_pool, profile_forward, profile_rows,
                                  request_buffers)

MiB = 2**20


def test_pool_is_total_times_utilization_minus_what_is_in_use():
    b = plan_kv_pool(total=140 * GiB, utilization=0.85, in_use=3 * GiB, weights=1 * GiB, activations=2 * GiB,
                     buffers=GiB // 2, cuda_graphs=GiB // 2, bytes_per_token=112 * 1024, min_tokens=40960)
    assert b.kv_pool == int(140 * GiB * 0.85) - 6 * GiB
    # 40 GiB more held by the process: the pool shrinks by exactly that, whatever is free.
    held = plan_kv_pool(140 * GiB, 0.85, 43 * GiB, 1 * GiB, 2 * GiB, GiB // 2, GiB // 2, 112 * 1024, 40960)
    assert b.kv_pool - held.kv_pool == 40 * GiB
    d = b.as_dict()
    assert d["utilization"] == 0.85 and d["total"] == 140.0 and d["kv_pool"] == pytest.approx(113.0)
    assert "gpu_memory_utilization 0.85" in b.describe(1000) and "KV pool" in b.describe(1000)


def test_pool_that_does_not_fit_fails_naming_the_option_and_the_need():
    with pytest.raises(ValueError) as err:
        plan_kv_pool(total=24 * GiB, utilization=0.5, in_use=10 * GiB, weights=9 * GiB, activations=1 * GiB,
                     buffers=0, cuda_graphs=512 * MiB, bytes_per_token=128 * 1024, min_tokens=131072)
    msg = str(err.value)
    assert "gpu_memory_utilization" in msg and "max_model_len" in msg
    assert "16.00 GiB (131072 tokens) are needed" in msg
    with pytest.raises(ValueError, match="gpu_memory_utilization must be in"):
        plan_kv_pool(GiB, 1.5, 0, 0, 0, 0, 0, 1, 1)


def test_an_fp8_pool_holds_twice_the_tokens_of_a_bf16_pool():
    """kv_cache_dtype="fp8": a byte an element, so the same pool holds 2x the tokens; and a
    request that did not fit a bf16 pool's memory fits (Qwen3-0.6B's shape: 28 layers, 8 KV
    heads of 128)."""
    per_token = {dt: KVCache.bytes_per_token(28, 8, 128, dt) for dt in (torch.bfloat16, torch.float8_e4m3fn)}
    assert per_token[torch.bfloat16] == 2 * per_token[torch.float8_e4m3fn] == 112 * 1024
    plan = lambda dt: plan_kv_pool(80 * GiB, 0.9, 2 * GiB, GiB, 3 * GiB, GiB, GiB, per_token[dt], 40960)  # noqa: E731
    tokens = {dt: plan(dt).kv_pool // n for dt, n in per_token.items()}
    assert tokens[torch.float8_e4m3fn] - 2 * tokens[torch.bfloat16] in (0, 1)  # 1: the bf16 pool's rounding
    with pytest.raises(ValueError, match="not enough device memory"):
        plan_kv_pool(24 * GiB, 0.5, 10 * GiB, 9 * GiB, GiB, 0, 0, per_token[torch.bfloat16], 12000)
    plan_kv_pool(24 * GiB, 0.5, 10 * GiB, 9 * GiB, GiB, 0, 0, per_token[torch.float8_e4m3fn], 12000)


def test_graph_reserve_is_one_shared_logits_buffer_plus_work():
    assert graph_reserve(0, 151936, GiB, 8192) == 0
    r = graph_reserve(256, 151936, 8 * GiB, 8192)
    assert r == 256 * 151936 * 4 + 256 * MiB  # not one buffer per bucket and ring slot


def test_request_buffers_count_table_and_penalty_state():
    assert request_buffers(255, 1000, 100) == 256 * (4000 + 500)


def test_profile_rows_fill_the_prefill_budget():
    assert profile_rows(8192, 3000) == [3000, 3000, 2192]
    assert profile_rows(100, 512) == [100]


@pytest.mark.parametrize("max_model_len", [64, 512])
def test_profiling_forward_runs_on_the_cpu(tiny_text_model, max_model_len):
    """The forward the CUDA sizing measures, at the largest prefill step (one or several rows)."""
    engine = Engine(EngineConfig(model=str(tiny_text_model), device="cpu", dtype="float32"))
    mc = engine.model_config
    scratch = profile_forward(engine.model, make_attention_backend("auto", torch.device("cpu")), mc.num_layers,
                              mc.num_kv_heads, mc.head_dim, torch.float32, torch.device("cpu"), 200,
                              max_model_len, mc.vocab_size, num_samples=8)
    assert scratch == 2 * mc.num_layers * 201 * mc.num_kv_heads * mc.head_dim * 4 + \
        (len(profile_rows(200, max_model_len)) + 1) * min(200, max_model_len) * 4
    assert engine.stats()["memory"] is None  # the CPU pool comes from cpu_kv_cache_bytes
    engine.close()
