"""The host tier in the engine: greedy outputs with a small pool and a host tier equal an
unbounded pool's (every GPU slot and host slot conserved), preemption through the tier, its
size, figures, experiments and tensor-parallel ranks."""
import pytest

from tandem.config import EngineConfig
from tandem.engine import Engine
from tandem.sampling import SamplingParams
from host_tier import (assert_reset_empties_the_host_tier, assert_tiers_conserved, chat_specs, engine_bytes_per_token,
                       make_engine, run_chats, small_tiered_engine)
from workload import Spec, assert_kv_conserved, run_workload


@pytest.mark.slow
@pytest.mark.parametrize("overlap,host_tokens,ahead,held", [(True, 4096, True, 0), (False, 4096, True, 0),
                                                           (True, 300, True, 0), (True, 4096, False, 0),
                                                           (True, 4096, True, 1)])
def test_small_pool_with_host_tier_equals_unbounded_pool(tiny_text_model, overlap, host_tokens, ahead, held):
    """300 host tokens: the host tier evicts too (less than the working set). `ahead`: write-ahead
    and prefetch on (the default) or both off (copies only at eviction and admission). `held`:
    Experiments.host_kv_held_places."""
    from tandem.config import Experiments
    rounds = chat_specs(conversations=10, turns=4, seed=3)
    want = run_chats(make_engine(tiny_text_model, max_total_tokens=20000), rounds)
    exp = Experiments(host_kv_write_ahead=ahead, host_kv_prefetch=ahead, host_kv_held_places=held)
    engine = small_tiered_engine(tiny_text_model, host_tokens, disable_overlap=not overlap, timeline=True,
                                 experiments=exp)
    assert engine.scheduler.cfg.held_places == held
    prefetched, prefetch = [], engine.prefix_cache.prefetch
    engine.prefix_cache.prefetch = lambda *a, **k: prefetched.append(prefetch(*a, **k)) or prefetched[-1]
    written_ahead, write_ahead = [], engine.prefix_cache.write_ahead
    engine.prefix_cache.write_ahead = lambda *a, **k: written_ahead.append(write_ahead(*a, **k)) or written_ahead[-1]
    evicted_ahead, evict_ahead = [], engine.prefix_cache.evict_ahead
    engine.prefix_cache.evict_ahead = lambda *a, **k: evicted_ahead.append(evict_ahead(*a, **k)) or evicted_ahead[-1]
    got = run_chats(engine, rounds)
    # Write-ahead runs whenever the next plan may be short, prefetch whenever a waiting request's
    # match continues on the host and the pool holds more than the next plan keeps; evict-ahead
    # then frees what write-ahead copied.
    assert (sum(written_ahead) > 0) == ahead and (sum(prefetched) > 0) == ahead, (prefetched, written_ahead)
    assert (sum(evicted_ahead) > 0) == ahead, evicted_ahead
    assert got == want
    s = engine.stats()
    assert s["host_cache_hit_tokens"] > (500 if host_tokens > 1000 else 100), s  # histories came back
    records = engine.timeline.records
    loaded = sum(r.host_load_tokens for r in records)  # a prefetch may go unused: loads >= hits
    assert loaded >= s["host_cache_hit_tokens"] and s["host_load_bytes"] == loaded * engine.kv_tier.host.token_bytes
    assert s["host_write_back_bytes"] > 0
    # Preemption here depends on how many requests run at once (prefetch and the head's wait
    # for it change that): a preempted request's return through the host tier is pinned by
    # test_a_preempted_request_comes_back_through_the_host_tier.
    assert_tiers_conserved(engine, s)
    assert_reset_empties_the_host_tier(engine)
    engine.close()


@pytest.mark.parametrize("overlap", [True, False])
def test_a_preempted_request_comes_back_through_the_host_tier(tiny_text_model, overlap):
    """Two requests outgrow a 200-token pool: one is preempted, its KV is cached, part of it
    written back when the other's growth evicts it, and loaded back when it is admitted again.
    Outputs equal an unbounded pool's."""
    params = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
    specs = [Spec(f"r{i}", list(range(10 + 100 * i, 70 + 100 * i)), params) for i in range(2)]
    want = run_workload(make_engine(tiny_text_model, max_total_tokens=4000), specs)
    probe = make_engine(tiny_text_model, max_total_tokens=200)
    gb = 1000 * engine_bytes_per_token(probe) / 2**30
    probe.close()
    engine = make_engine(tiny_text_model, max_total_tokens=200, max_prefill_tokens=16, host_kv_cache_gb=gb,
                         disable_overlap=not overlap)
    assert run_workload(engine, specs) == want
    s = engine.stats()
    assert s["num_preemptions"] > 0 and s["host_cache_hit_tokens"] > 0, s
    assert_tiers_conserved(engine, s)
    engine.close()


def test_zero_host_tier_is_todays_cache(tiny_text_model):
    rounds = chat_specs(conversations=4, turns=2, seed=5)
    engine = make_engine(tiny_text_model, max_total_tokens=300, host_kv_cache_gb=0)
    assert engine.kv_tier is None and engine.prefix_cache.host is None
    run_chats(engine, rounds)
    s = engine.stats()
    assert s["host_cache_hit_tokens"] == s["host_write_back_bytes"] == s["host_cache_capacity_tokens"] == 0
    assert_kv_conserved(engine)


def test_negative_host_tier_is_refused(tiny_text_model):
    with pytest.raises(ValueError, match="host_kv_cache_gb must be >= 0"):
        make_engine(tiny_text_model, host_kv_cache_gb=-1)


def test_warm_up_leaves_no_host_tier_figures(tiny_text_model):
    engine = make_engine(tiny_text_model, max_total_tokens=200, max_prefill_tokens=64, max_running_requests=8,
                         host_kv_cache_gb=0.01, warm_up="on")
    s = engine.stats()
    assert s["host_cache_hit_tokens"] == s["host_load_bytes"] == s["host_write_back_bytes"] == 0
    assert s["host_cache_tokens"] == 0 and s["prefix_cache_tokens"] == 0


def test_the_engine_hands_the_tier_experiments_to_the_prefix_cache(tiny_text_model):
    from tandem.config import Experiments
    exp = Experiments(host_kv_prefetch_requests=7, host_kv_fifo_beyond_prefetch=True, host_kv_precise_fence=False)
    engine = make_engine(tiny_text_model, max_total_tokens=300, host_kv_cache_gb=0.001, experiments=exp)
    host = engine.prefix_cache.host
    assert (engine.prefix_cache.prefetch_requests, host.fifo_beyond_prefetch, host.admit_after_prefetch) == (7, True, True)
    assert not engine.kv_tier.precise and host.require == engine.kv_tier.require
    engine.close()
    assert make_engine(tiny_text_model, max_total_tokens=300, host_kv_cache_gb=0.001).kv_tier.precise


@pytest.mark.slow
def test_tensor_parallel_ranks_replay_the_host_tier_copies(tmp_path):
    """Two ranks (gloo): rank 0's plan carries its write-backs and loads, each rank moves its
    own shard; outputs equal one rank with an unbounded pool."""
    from tandem.entrypoints.ranks import build_engine
    from tiny_models import make_tiny_model
    path = make_tiny_model(tmp_path, "llama", vocab_size=1000)
    rounds = chat_specs(conversations=6, turns=3, seed=8)
    opts = dict(model=str(path), device="cpu", dtype="float32", max_running_requests=16)
    want = run_chats(Engine(EngineConfig(**opts, max_total_tokens=20000)), rounds)
    engine = build_engine(EngineConfig(**opts, tensor_parallel_size=2, max_total_tokens=300,
                                       chunked_prefill_size=48, max_prefill_tokens=96, host_kv_cache_gb=0.01))
    try:
        assert run_chats(engine, rounds) == want
        assert engine.stats()["host_cache_hit_tokens"] > 200
    finally:
        engine.close()
