"""The host tier's CPU replay on a modeled device clock (`tandem bench tier-replay --modeled`,
`tandem.bench.tier_clock`): steps and copies take modeled time, `copy_done` answers by it, the
forwards wait for the copies they depend on, and the wrappers leave the engine as it was."""
import json

import pytest

from tandem.bench.tier_clock import ClockModel, ModeledClock

TOY = ["--conversations", "4", "--turns", "3", "--turn-len", "48", "--output-len", "4", "--running", "2",
       "--pool", "256", "--full-pass-at", "5", "--modeled"]


def _replay(capsys, *extra: str) -> dict:
    from tandem.entrypoints.cli import bench_main
    assert bench_main(["tier-replay", *TOY, *extra]) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_slow_copies_stall_the_modeled_forwards_and_instant_ones_do_not(capsys):
    instant = _replay(capsys, "--host-tokens", "2048", "--copy-gb-s", "0")
    slow = _replay(capsys, "--host-tokens", "2048", "--copy-gb-s", "0.01")  # ~11 ms a token of Qwen3-0.6B's KV
    off = _replay(capsys, "--host-tokens", "0")
    for run in (instant, slow, off):
        assert run["outputs"] == 4 * 3 * 4
        assert run["modeled_s"] >= run["modeled_steps"] * ClockModel.step_ms / 1e3 - 1e-9
        ttft = run["modeled_ttft_s"]
        assert 0 < ttft["p50"] <= ttft["p90"] <= ttft["p99"] <= run["modeled_s"]
    assert instant["modeled_stall_s"] == 0 and instant["host_hit_tokens"] > 0
    assert slow["host_hit_tokens"] > 0 and slow["modeled_stall_s"] > 0  # a forward read a load still running
    assert slow["modeled_s"] > instant["modeled_s"]
    assert off["host_hit_tokens"] == 0 and off["modeled_stall_s"] == 0


def test_the_clock_models_copies_and_steps_and_close_restores_the_engine(tiny_text_model):
    from host_tier import make_engine
    engine = make_engine(tiny_text_model, max_total_tokens=300, host_kv_cache_gb=0.001)
    tier, host = engine.kv_tier, engine.prefix_cache.host
    clock = ModeledClock(engine, ClockModel(step_ms=2.0, prefill_us_per_token=0.0, copy_gb_s=1.0, token_bytes=10**6))
    gpu, hosted = engine.kv_slots.alloc(3), host.host_slots.alloc(3)
    first = tier.write_back(gpu, hosted)  # 3 MB at 1 GB/s: 3 ms, from modeled time 0
    second = tier.load(hosted[:1], gpu[:1])  # queued behind it on the one copy stream: ends at 4 ms
    assert clock.copy_end == pytest.approx({first: 0.003, second: 0.004})
    assert not host.copy_done(first) and not tier.done(second)
    assert tier.bytes_per_s("load") == 1e9 and engine.tier_pace.token_bytes == 10**6
    tier.require(second)
    tier.fence(engine.streams.forward)  # the next forward waits for the load
    assert clock.wait_until == pytest.approx(0.004)
    clock.now = 0.0035
    assert host.copy_done(first) and not host.copy_done(second)
    clock.close()
    for obj, name in ((tier, "_copy"), (tier, "fence"), (tier, "done"), (tier, "bytes_per_s"),
                      (engine.tier_pace, "tick"), (engine.runner, "launch")):
        assert name not in vars(obj), name
    assert host.copy_done == tier.done and engine.tier_pace.token_bytes != 10**6
    assert engine.scheduler.cfg.prefill_step_target_s < 3600
    engine.kv_slots.free(gpu)
    host.host_slots.free(hosted)
    engine.close()
