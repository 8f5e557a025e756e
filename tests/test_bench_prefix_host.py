"""`tandem bench prefix --workload multiturn --host-kv-cache-gb ...` at a tiny size on the CPU:
histories evicted between turns come back from the host tier, and the row reports it."""
import json

from tandem.bench.prefix import format_table, main

ARGS = ["--workload", "multiturn", "--preset", "tiny", "--device", "cpu", "--dtype", "float32",
        "--conversations", "5", "--turns", "3", "--system-len", "60", "--question-len", "30", "--output-len", "4",
        "--max-running-requests", "2", "--max-total-tokens", "300"]


def _row(capsys, *extra: str) -> dict:
    assert main(ARGS + list(extra)) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_multiturn_rows_with_and_without_the_host_tier(capsys):
    on = _row(capsys, "--host-kv-cache-gb", "0.05")
    off = _row(capsys)
    assert on["host_hit_rate"] > 0.3 and on["hit_rate"] > off["hit_rate"]
    assert abs(on["gpu_hit_rate"] + on["host_hit_rate"] - on["hit_rate"]) < 1e-9 and on["gpu_hit_rate"] >= 0
    assert on["load_gb_s"] > 0 and on["write_back_gb_s"] > 0
    assert off["host_hit_rate"] == 0 and off["load_gb_s"] is None
    assert on["output_tokens"] == off["output_tokens"] == 5 * 3 * 4
    table = format_table([on, off], "host tier")
    assert "host tier on/off: throughput x" in table and "host_hit_rate" in table


def test_the_row_says_where_the_time_and_the_slowest_requests_went(capsys):
    """By tenths of the steps: the mean batch (the device's idle seconds only on CUDA); and the
    requests at TTFT p99 with their turn and the plans they waited for prefetch."""
    row = _row(capsys, "--host-kv-cache-gb", "0.05")
    assert row["gpu_idle_s_by_tenth"] is None  # no device timings on the CPU
    batch = row["batch_by_tenth"]
    assert len(batch) == 10 and all(1 <= b <= 2 for b in batch)  # --max-running-requests 2
    slowest = row["slowest"]
    assert slowest and slowest[0][0] == max(t for t, _, _ in slowest) >= row["ttft_p99_ms"] - 0.05  # rounded to 0.1 ms
    assert row["ttft_p50_ms"] <= row["ttft_p90_ms"] <= row["ttft_p99_ms"]
    assert all(0 <= turn < 3 and waits >= 0 for _, turn, waits in slowest)
    assert [t for t, _, _ in slowest] == sorted((t for t, _, _ in slowest), reverse=True)
    kinds = row["by_kind"]
    assert kinds["prefill"]["steps"] > 0 and kinds["decode"]["steps"] > 0
    assert kinds["prefill"]["steps"] + kinds["decode"]["steps"] == row["steps"]
    assert kinds["decode"]["idle_s"] == 0 and kinds["decode"]["forward_ms"] is None  # the CPU has no device timings
    assert kinds["prefill"]["schedule_ms"] > 0 and kinds["prefill"]["launch_ms"] > 0
    # Prefill steps after a decode step are planned in the wait before them (plan_ahead): their
    # plans' [median, p90] ms; no decode step is.
    prefill = kinds["prefill"]
    assert 0 < prefill["planned_ahead"] <= prefill["steps"] and 0 < prefill["plan_ahead_ms"][0] <= prefill["plan_ahead_ms"][1]
    assert kinds["decode"]["planned_ahead"] == 0 and kinds["decode"]["plan_ahead_ms"] is None


def test_phase_timers_split_each_iterations_host_time_by_phase(capsys):
    """`--phase-timers`: per phase, [median, mean] ms per iteration, for prefill-planning
    iterations, the ones before them and decode-only ones; the wrappers are gone afterwards."""
    row = _row(capsys, "--host-kv-cache-gb", "0.05", "--phase-timers")
    phases = row["phases"]
    assert phases["iterations"] >= row["steps"] and phases["prefill_iterations"] == row["by_kind"]["prefill"]["steps"]
    prefill, decode = phases["prefill"], phases["decode"]
    assert prefill["Scheduler.schedule"][1] >= prefill["Scheduler._plan"][1] >= prefill["Scheduler._prefill_rows"][1] > 0
    assert prefill["PrefixCache.admit"][1] > 0 and prefill["ModelRunner.launch"][1] > 0
    assert prefill["iteration"][1] >= prefill["Scheduler.schedule"][1] + prefill["ModelRunner.launch"][1]
    assert "KVTierCopier._copy" in prefill or "KVTierCopier._copy" in phases["before_prefill"]
    assert decode["ModelRunner.launch"][1] > 0 and decode["iteration"][0] < prefill["iteration"][0]
    # The staging's pieces: inside the launch's (or the wait's, when staged ahead) `_stage`.
    assert prefill["ModelRunner._stage"][1] >= prefill["InputStager.stage"][1] > 0
    assert prefill["ModelRunner.launch"][1] >= prefill["ModelRunner._stage"][1]
    assert any(p.get("Engine._move_between_tiers", [0, 0])[1] > 0 for p in (prefill, decode))
    assert any("Engine.add_request" in p for p in (prefill, decode, phases["before_prefill"]))  # the next turns
    assert any(p.get("Scheduler.prepare_waiting", [0, 0])[1] > 0 for p in (prefill, decode, phases["before_prefill"]))
    slow = phases["slowest"]  # whole iterations, the longest (with the caller's time before them) first
    assert len(slow) == 6 and all("iteration" in it for it in slow)
    totals = [it["iteration"] + it.get("caller", 0.0) for it in slow]  # each rounded to 0.01 ms
    assert all(a >= b - 0.02 for a, b in zip(totals, totals[1:])) and any("caller" in it for it in slow)
    assert _row(capsys, "--host-kv-cache-gb", "0.05")["phases"] is None  # off by default


def test_phase_timers_leave_the_engine_as_it_was(tmp_path):
    from tandem.config import EngineConfig
    from tandem.diagnostics.phases import phase_timers
    from tandem.engine import Engine
    from tandem.sampling import SamplingParams
    from tiny_models import make_tiny_model

    engine = Engine(EngineConfig(model=str(make_tiny_model(tmp_path, "llama")), device="cpu", dtype="float32"))
    parts = (engine, engine.scheduler, engine.prefix_cache, engine.prefix_cache.tree, engine.runner)
    before = [set(vars(part)) for part in parts]
    with phase_timers(engine) as log:
        assert "schedule" in vars(engine.scheduler) and "_run_step" in vars(engine)  # wrapped for the block
        engine.add_request([1, 2, 3, 4], SamplingParams(max_tokens=3, temperature=0.0))
        while engine.has_unfinished():
            engine.step()
    assert [set(vars(part)) for part in parts] == before  # every wrapper removed
    kinds = [it.get("kind") for it in log.iterations]
    assert kinds[0] == "prefill" and "decode" in kinds
    assert all(it["iteration"] >= it.get("Scheduler.schedule", 0.0) for it in log.iterations)
    engine.close()


def _record(step: int, decode: bool, start_ms: float, plan: float, done_ms: float | None, idle: float | None = None,
            forward: float | None = None, stall: float | None = None):
    from tandem.diagnostics.timeline import StepRecord
    return StepRecord(step, 8 if decode else 2, 8 if decode else 4096, decode, 0, 0, host_start=start_ms / 1e3,
                      schedule_ms=plan, launch_ms=1.0, gpu_forward_ms=forward, gpu_idle_before_ms=idle,
                      host_done=None if done_ms is None else done_ms / 1e3, gpu_tier_stall_ms=stall)


def test_prefill_gaps_split_the_idle_before_a_prefill_that_follows_a_decode():
    """idle = stall + (result before D -> plan) + plan + prologue - D; only prefill steps right
    after a decode count, the first tenth of the steps is left out, and the CPU has none."""
    from tandem.bench.prefix import prefill_gaps
    records = [_record(i, True, 10.0 * i, 0.1, 10.0 * i + 9, idle=0.0, forward=4.0) for i in range(10)]
    # P1 (result at 109 ms), D (4 ms on the GPU), then P2 planned at 110 ms for 2 ms; idle 3.5 ms with 0.5 of stall:
    # prologue = 3.5 - 0.5 - 1 - 2 + 4 = 4 ms.
    records += [_record(10, False, 100.0, 2.0, 109.0, idle=0.0, forward=30.0),
                _record(11, True, 101.0, 0.1, 113.0, idle=0.0, forward=4.0),
                _record(12, False, 110.0, 2.0, 150.0, idle=3.5, forward=30.0, stall=0.5),
                _record(13, False, 150.5, 1.0, 180.0, idle=0.0, forward=30.0)]  # after a prefill: not counted
    gaps = prefill_gaps(records)
    assert gaps["steps"] == 2 and gaps["idled"] == 1 and gaps["idle_s"] == 0.004  # P1 (after D 9) did not idle
    assert gaps["where_idle"] == {"idle": 3.5, "stall": 0.5, "result_to_plan": 1.0, "plan": 2.0,
                                  "decode_forward": 4.0, "prologue": 4.0, "launch": 1.0, "plan_ahead": 0.0,
                                  "stage_ahead": 0.0}
    assert gaps["all"]["idle"] == 1.75 and gaps["all"]["plan"] == 2.0
    cpu = [_record(i, i % 2 == 0, 10.0 * i, 0.1, 10.0 * i + 9) for i in range(20)]
    assert prefill_gaps(cpu) is None


def test_idle_steps_split_the_idle_by_what_ran_before_each_step():
    """After the first tenth: an idle step whose iteration ran the collector is "gc", one that
    waited for a tier copy "tier_stall", any other "other"; the worst come first."""
    from tandem.bench.prefix import idle_steps
    records = [_record(i, True, 5.0 * i, 0.1, 5.0 * i + 4, idle=9.0 if i == 0 else 0.0, forward=4.0)
               for i in range(10)]  # the first step's 9 ms is in the first tenth: left out
    records[3].gc_ms, records[3].gc_generation = 0.5, 0  # a pass that idled nothing
    records[5].gpu_idle_before_ms, records[5].gc_ms, records[5].gc_generation = 2.0, 6.0, 1
    records[7].gpu_idle_before_ms, records[7].gpu_tier_stall_ms = 1.0, 1.0
    records[8].gpu_idle_before_ms = 0.5
    out = idle_steps(records)
    assert out["causes"] == {"gc": {"steps": 1, "idle_s": 0.002}, "tier_stall": {"steps": 1, "idle_s": 0.001},
                             "other": {"steps": 1, "idle_s": 0.0005}}
    assert out["gc_s"] == 0.0065 and out["gc_passes"] == {"0": 1, "1": 1}
    # step 5 queued at 26.1 ms (25 + 0.1 + 1.0), step 4's result seen at 24 ms: after it, the overlap broken
    assert out["worst"][0] == [2.0, "decode", 6.0, 1, 0.0, 5.0, 4.0, None, None, 8, 0.1, 1.0, 2.1]
    records[6].host_start, records[5].host_done = 0.028, 0.0295  # queued at 29.1 ms, while step 5 ran
    records[6].gpu_idle_before_ms = 3.0
    assert idle_steps(records)["worst"][0][-1] == -0.4
    assert [w[0] for w in out["worst"]] == [2.0, 1.0, 0.5]
    assert idle_steps([_record(i, True, 5.0 * i, 0.1, 5.0 * i + 4) for i in range(10)]) is None


def test_gc_census_at_a_step_of_the_measured_run(capsys):
    """`--gc-census-at`: the census comes with the row (the requests' token lists among the
    owners), the step wrapper is gone afterwards, and without the flag there is none."""
    row = _row(capsys, "--host-kv-cache-gb", "0.05", "--gc-census-at", "3")
    got = row["gc_census"]
    assert got["objects"] > 0 and got["elements"] > 0 and got["full_pass_ms"] > 0
    assert any(owner.startswith(("Request.", "Node.", "Turn.")) for owner in got["largest_by_owner"])
    assert _row(capsys, "--host-kv-cache-gb", "0.05")["gc_census"] is None


def test_tier_stalls_add_up_the_forwards_waits_by_cause():
    from tandem.bench.prefix import tier_stalls
    records = [_record(i, True, 10.0 * i, 0.1, 10.0 * i + 9, idle=0.0, forward=4.0, stall=s)
               for i, s in enumerate([None, 1.5, 0.25, 2.0])]
    for r, cause, mb in zip(records, [None, "load", "slot_reuse", "load"], [None, 100.0, 20.0, 150.5]):
        r.tier_stall_cause, r.tier_stall_pending_mb = cause, mb
    assert tier_stalls(records) == {"load": {"steps": 2, "ms": 3.5, "pending_mb": 250.5},
                                    "slot_reuse": {"steps": 1, "ms": 0.25, "pending_mb": 20.0}}
    assert tier_stalls(records[:1]) == {}


def test_step_records_are_written_as_json_lines(capsys, tmp_path):
    path = tmp_path / "steps.jsonl"
    row = _row(capsys, "--host-kv-cache-gb", "0.05", "--step-records", str(path))
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(lines) > row["steps"] and {"schedule_ms", "host_done", "gpu_tier_stall_ms"} <= set(lines[-1])
    assert row["prefill_gaps"] is None  # the CPU has no device timings


def test_tier_replay_times_the_plans_in_the_wait_and_the_collector(capsys):
    """`tandem bench tier-replay` at toy sizes: prefill plans made in the wait, their staging,
    the collector's passes and the two timed full passes; the probes leave the engine as it was
    (the run's outputs all arrive, the hits come from both tiers)."""
    from tandem.entrypoints.cli import bench_main
    assert bench_main(["tier-replay", "--conversations", "4", "--turns", "3", "--turn-len", "48", "--output-len", "4",
                       "--running", "2", "--pool", "256", "--host-tokens", "2048", "--full-pass-at", "5"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["outputs"] == 4 * 3 * 4 and out["hit_tokens"] > 0 and 0 < out["host_hit_tokens"] <= out["hit_tokens"]
    assert out["prefill_plans"]["n"] > 0 and out["stage_ahead"]["n"] == out["prefill_plans"]["n"]
    assert out["long_match_plans"] == {"n": 0}  # no 4k-token prefix at these sizes
    assert out["census_mid"]["full_pass_ms"] > 0 and out["census_mid"]["elements"] > 0 and out["full_pass_end_ms"] > 0
    assert set(out["gc_passes"]) == {"0", "1", "2"} and out["gc_passes"]["2"]["n"] >= 1  # the timed ones at least
