"""Diagnostics on the CPU: step timeline, `tandem profile`, the sync audit's bookkeeping,
sticky-error handling and launch-blocking. (GPU halves: test_gpu_diagnostics.py.)"""
import json
import logging
import os
import random
import textwrap
import warnings

import pytest
import torch

from tandem.bench.presets import preset_dir
from tandem.config import EngineConfig
from tandem.diagnostics import errors
from tandem.diagnostics.profile import profile_main, step_window
from tandem.diagnostics.sync_audit import (Frame, SyncAudit, SyncCollector, display_path, locate,
                                           sync_audit_main, _norm_roots)
from tandem.diagnostics.timeline import StepRecord, Timeline, cpu_lead_ms, read_timeline
from tandem.engine import Engine
from tandem.sampling import SamplingParams


@pytest.fixture(scope="module")
def tiny_preset():
    return preset_dir("tiny")


def _engine(path, **kw):
    cfg = EngineConfig(model=path, dummy_weights=True, device="cpu", max_total_tokens=4096,
                       max_running_requests=16, max_model_len=256, **{"timeline": True, **kw})
    return Engine(cfg)


def test_step_window_profiles_only_the_steps_asked_for(tiny_preset):
    engine = _engine(tiny_preset)
    engine.add_request([5, 6, 7, 8], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    calls = []
    with step_window(engine, first=2, count=3) as tables:
        while engine.has_unfinished():
            calls.append(len(tables))
            engine.step()
    assert calls[:6] == [0, 0, 0, 0, 0, 1]  # the table appears once step 4 (the window's last) returns
    assert len(tables) == 1 and "aten::" in tables[0]
    assert "step" not in vars(engine)  # the wrapper is gone


def test_host_step_window_profiles_the_python_of_those_steps(tiny_preset):
    engine = _engine(tiny_preset)
    engine.add_request([5, 6, 7, 8], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    with step_window(engine, first=2, count=3, host=True) as tables:
        while engine.has_unfinished():
            engine.step()
    assert len(tables) == 1
    assert "3    " in tables[0] and "engine.py" in tables[0] and "(_run_step)" in tables[0]  # 3 steps' calls
    assert "step" not in vars(engine)


# ---- step timeline ----
@pytest.mark.parametrize("overlap", [True, False])
def test_timeline_one_sane_record_per_step(tiny_preset, tmp_path, overlap):
    path = tmp_path / "steps.jsonl"
    engine = _engine(tiny_preset, timeline=str(path), disable_overlap=not overlap,
                     chunked_prefill_size=32, enable_mixed_batch=True)
    rng = random.Random(0)
    rids = []
    for i in range(6):  # staggered arrivals: prefill chunks, mixed and decode steps
        rids.append(engine.add_request([rng.randrange(3, 512) for _ in range(10 + 15 * i)],
                                       SamplingParams(max_tokens=5 + i, temperature=0, ignore_eos=True)))
        engine.step()
    while engine.has_unfinished():
        engine.step()
    tl = engine.timeline
    tl.close()
    recs = tl.records
    assert len(recs) == engine.step_id == tl.steps_recorded > 0
    assert [r.step for r in recs] == list(range(engine.step_id))
    for r in recs:
        assert r.schedule_ms >= 0 and r.launch_ms >= 0 and r.process_ms >= 0
        assert 0 <= r.host_wait_ms <= r.process_ms
        assert r.batch_size >= 1 and r.num_tokens >= r.batch_size
        assert r.context_tokens >= r.num_tokens and r.attn_pairs >= r.num_tokens
        assert r.host_done is not None and r.host_done >= r.launch_end >= r.host_start
        # the CPU has no device clock: no device times, no lead
        assert r.gpu_forward_ms is None and r.gpu_idle_before_ms is None and r.cpu_lead_ms is None
    assert all(a.host_start <= b.host_start for a, b in zip(recs, recs[1:]))
    assert any(r.is_decode for r in recs) and any(not r.is_decode for r in recs)
    lines = read_timeline(path)
    assert [d["step"] for d in lines] == list(range(engine.step_id))
    assert lines[-1]["process_ms"] == recs[-1].process_ms
    s = tl.summary()
    assert s["steps"] == engine.step_id and s["mean_host_ms"] > 0 and s["mean_host_wait_ms"] >= 0
    assert "gpu_busy_fraction" not in s
    assert sum(len(engine.output(r).token_ids) for r in rids) == sum(5 + i for i in range(6))


class FakeEvent:
    """A CUDA-event stand-in on a virtual device clock (ms)."""

    def __init__(self, t, ready=True):
        self.t, self.ready = t, ready

    def query(self):
        return self.ready

    def elapsed_time(self, other):
        assert self.ready and other.ready, "elapsed_time on an event that is not complete"
        return other.t - self.t


def _record(step, start, sched=0.1, launch=0.2):
    return StepRecord(step, 4, 4, True, 100, 100, start, sched, launch)


def test_timeline_device_fields_and_summary_from_events():
    tl = Timeline()
    # step 0: forward 0..2 ms; step 1: queued early, forward 2.005..4 (back to back);
    # step 2: queued late, forward 5..6 (the GPU idled 1 ms).
    recs = [_record(0, 10.0), _record(1, 10.001), _record(2, 10.010)]
    for r in recs:
        tl.add(r)
    ev = [(FakeEvent(0), FakeEvent(2)), (FakeEvent(2.005), FakeEvent(4)), (FakeEvent(5), FakeEvent(6))]
    # processing of step 0 happened after step 1 was launched: wait of 1.5 ms
    recs[0].process_ms, recs[0].host_wait_ms = 1.6, 1.5
    tl.completed(recs[0], *ev[0], None)
    recs[0].host_done = recs[1].launch_end + 1.5e-3  # pin the host clock for the check below
    tl._previous_done = recs[0].host_done
    tl.completed(recs[1], *ev[1], ev[0][1])
    tl.completed(recs[2], *ev[2], ev[1][1])
    assert recs[0].gpu_forward_ms == 2 and recs[0].gpu_idle_before_ms is None
    assert recs[1].gpu_idle_before_ms == pytest.approx(0.005)
    assert recs[1].cpu_lead_ms == pytest.approx(1.5)  # ahead: queued 1.5 ms before it was needed
    assert recs[2].gpu_idle_before_ms == pytest.approx(1.0)
    assert recs[2].cpu_lead_ms == pytest.approx(-1.0)  # behind: the GPU waited 1 ms
    s = tl.summary()
    assert s["gpu_busy_fraction"] == pytest.approx(4.995 / (4.995 + 1.005))
    assert s["mean_gpu_forward_ms"] == pytest.approx(4.995 / 3)
    assert s["mean_cpu_lead_ms"] == pytest.approx(0.25) and s["gpu_starved_steps"] == 1
    assert tl.summary(last=1)["steps"] == 1 and tl.summary(last=0)["steps"] == 0


def test_timeline_events_not_ready_are_never_read():
    tl = Timeline()
    r = _record(0, 1.0)
    tl.add(r)
    tl.completed(r, FakeEvent(0), FakeEvent(1, ready=False), None)  # elapsed_time would assert
    assert r.gpu_forward_ms is None and r.cpu_lead_ms is None


def test_cpu_lead_without_device_gap_uses_host_clock():
    r = _record(1, 5.0)
    r.gpu_idle_before_ms = 0.0
    assert cpu_lead_ms(r, r.launch_end + 0.002) == pytest.approx(2.0)
    assert cpu_lead_ms(r, None) is None


def test_timeline_bounded_memory():
    tl = Timeline(max_records=10)
    for i in range(55):
        tl.add(_record(i, float(i)))
    assert tl.steps_recorded == 55 and 10 <= len(tl.records) <= 20 and tl.records[-1].step == 54


def test_timeline_gives_each_step_the_collector_time_before_its_launch():
    """A collection is the step's whose launch it delayed: one between two launches is the
    later step's, even when the earlier step's record is added after it (the engine adds a
    record once its processing window is over); close() stops the timing."""
    import gc
    from time import perf_counter
    tl = Timeline()
    gc.disable()  # no automatic pass in between: only the one collected here
    try:
        first = _record(0, perf_counter(), 0.0, 0.0)
        gc.collect(1)  # in the window after the first launch: it delays the second
        second = _record(1, perf_counter(), 0.0, 0.0)
        tl.add(first)
        tl.add(second)
        third = _record(2, perf_counter(), 0.0, 0.0)
        tl.add(third)
    finally:
        gc.enable()
    assert first.gc_generation == -1 and first.gc_ms == 0.0
    assert second.gc_generation == 1 and second.gc_ms > 0
    assert third.gc_ms == 0.0 and third.gc_generation == -1
    tl.close()
    gc.collect(0)
    after = _record(3, perf_counter(), 0.0, 0.0)
    tl.add(after)
    assert after.gc_generation == -1 and tl._collector not in gc.callbacks


class _Holder:
    def __init__(self, n: int):
        self.tokens = list(range(1000, 1000 + n))


class _Slotted:
    __slots__ = ("key",)

    def __init__(self, n: int):
        self.key = list(range(2000, 2000 + n))


def test_gc_census_counts_the_elements_a_full_pass_walks_and_names_their_owners():
    from tandem.diagnostics.gc_census import census
    held = [_Holder(50_000), _Slotted(40_000)]
    out = census()
    assert out["elements"] >= 90_000 and out["by_type"]["list"][1] >= 90_000 and out["full_pass_ms"] > 0
    owners = out["largest_by_owner"]
    assert owners["_Holder.tokens"] >= 50_000 and owners["_Slotted.key"] >= 40_000
    assert len(held) == 2


# ---- tandem profile ----
def test_profile_writes_traces_and_png(tmp_path, capsys):
    from matplotlib.image import imread
    out = tmp_path / "prof"
    rc = profile_main(["--out", str(out), "--preset", "tiny", "--device", "cpu", "--num-requests", "3",
                       "--prompt-len", "8", "--max-tokens", "8", "--window", "5"])
    assert rc == 0
    for name in ("on", "off"):
        trace = json.loads((out / f"trace_overlap_{name}.json").read_text())
        marks = {e["name"] for e in trace["traceEvents"] if e.get("cat") == "user_annotation"}
        assert {"tandem::schedule", "tandem::launch", "tandem::process", "tandem::wait"} <= marks
        steps = read_timeline(out / f"steps_overlap_{name}.jsonl")
        assert [d["step"] for d in steps] == list(range(steps[0]["step"], steps[0]["step"] + len(steps)))
    img = imread(out / "timeline.png")
    assert img.ndim == 3 and img.shape[0] > 100 and img.shape[1] > 100
    assert float(img[..., :3].std()) > 0.01  # not a blank canvas
    summary = json.loads((out / "summary.json").read_text())
    assert summary["on"]["steps"] == summary["on"]["engine_steps"] - 1  # the last call only drains
    assert summary["window"]["overlap on"]["steps"] == 5
    assert "overlap off" in capsys.readouterr().out


# ---- sync audit ----
def test_sync_audit_without_cuda_exits_cleanly(capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert sync_audit_main(["--num-requests", "2"]) == 0
    assert "no CUDA device" in capsys.readouterr().out


def test_locate_picks_innermost_frame_in_roots(tmp_path):
    pkg = tmp_path / "tandem"
    roots = _norm_roots([pkg])
    frames = [Frame("/usr/lib/python3/warnings.py", 10, "_showwarnmsg"),
              Frame("/venv/torch/_tensor.py", 40, "__format__"),
              Frame(str(pkg / "runner.py"), 77, "launch"),
              Frame(str(pkg / "engine.py"), 205, "step"),
              Frame("/work/bench.py", 3, "<module>")]
    site, ours = locate(frames, roots)
    assert (site.filename, site.lineno, site.name) == (str(pkg / "runner.py"), 77, "launch")
    assert [f.name for f in ours] == ["step", "launch"]
    assert locate(frames[:2], roots) == (None, [])
    # a file next to the root whose name merely starts with it is not inside it
    assert locate([Frame(str(tmp_path / "tandem_extra.py"), 1, "f")], roots)[0] is None


def test_collector_counts_by_site_and_falls_back():
    c = SyncCollector()
    here = os.path.abspath(__file__)
    engine_py = os.path.join(os.path.dirname(os.path.dirname(here)), "tandem", "engine.py")
    for _ in range(3):
        c.record([Frame("/t/torch.py", 1, "x"), Frame(engine_py, 42, "step")])
    c.record([Frame("/elsewhere/a.py", 5, "f")], filename="/elsewhere/a.py", lineno=5)
    rep = c.report()
    assert [(s.where, s.count) for s in rep.sites] == [(display_path(engine_py) + ":42", 3), ("/elsewhere/a.py:5", 1)]
    assert rep.sites[0].where == "tandem/engine.py:42" and rep.total == 4
    text = rep.format()
    assert "4 host syncs at 2 sites" in text and "tandem/engine.py:42" in text
    assert SyncCollector().report().format().startswith("sync audit: 0 host syncs")


FAKE_TORCH = '''
import warnings
def item():
    warnings.warn("called a synchronizing CUDA operation", UserWarning)  # torch's own frame
def other():
    warnings.warn("something else", UserWarning)
'''

FAKE_LOOP = '''
import fake_torch
def step(n):
    for _ in range(n):
        fake_torch.item()  # SYNC-HERE
    fake_torch.other()
'''


def test_sync_audit_hook_attributes_warnings_to_our_line(tmp_path, monkeypatch):
    """End to end on the CPU: sync warnings raised inside a torch-like module are charged to
    the line in our roots that called it; other warnings pass through."""
    (tmp_path / "fake_torch.py").write_text(textwrap.dedent(FAKE_TORCH))
    ours = tmp_path / "ours"
    ours.mkdir()
    (ours / "fake_loop.py").write_text(textwrap.dedent(FAKE_LOOP))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.syspath_prepend(str(ours))
    import fake_loop
    line = next(i for i, s in enumerate(textwrap.dedent(FAKE_LOOP).splitlines(), 1) if "SYNC-HERE" in s)
    with warnings.catch_warnings(record=True) as outer:
        warnings.simplefilter("always")
        with SyncAudit(roots=[ours], force=True) as audit:
            fake_loop.step(5)
            fake_loop.step(2)
    rep = audit.report()
    assert [(os.path.basename(s.filename), s.lineno, s.count, s.function) for s in rep.sites] == \
        [("fake_loop.py", line, 7, "step")]
    assert "SYNC-HERE" in rep.sites[0].code
    assert [str(w.message) for w in outer] == ["something else"] * 2  # passed through


# ---- sticky errors, launch blocking ----
STICKY = [RuntimeError("CUDA error: an illegal memory access was encountered\nCUDA kernel errors "
                       "might be asynchronously reported at some other API call"),
          RuntimeError("CUDA error: device-side assert triggered"),
          RuntimeError("Triton Error [CUDA]: misaligned address"),
          RuntimeError("CUDA error: unspecified launch failure")]


@pytest.mark.parametrize("exc", STICKY, ids=lambda e: str(e)[:30])
def test_sticky_errors_recognized(exc):
    assert errors.is_sticky_cuda_error(exc)


def test_non_sticky_errors_are_not():
    assert not errors.is_sticky_cuda_error(ValueError("prompt is empty"))
    assert not errors.is_sticky_cuda_error(torch.cuda.OutOfMemoryError("CUDA out of memory."))
    assert not errors.is_sticky_cuda_error(None)

    class FakeAcceleratorError(RuntimeError):
        error_code = 2  # cudaErrorMemoryAllocation: recoverable

    assert not errors.is_sticky_cuda_error(FakeAcceleratorError("CUDA error: out of memory"))
    FakeAcceleratorError.error_code = 700
    assert errors.is_sticky_cuda_error(FakeAcceleratorError("CUDA error"))
    try:  # chained: a wrapper raised from the CUDA error
        try:
            raise STICKY[0]
        except RuntimeError as inner:
            raise KeyError("wrapper") from inner
    except KeyError as outer:
        assert errors.is_sticky_cuda_error(outer)


class StepDouble:
    """Engine.step's error path as the engine uses it (see the report for the exact change)."""

    def __init__(self, failures):
        self.fatal, self.failures, self.calls = errors.FatalErrorGuard(), list(failures), 0

    def step(self):
        self.fatal.check()
        try:
            self.calls += 1
            if self.failures:
                raise self.failures.pop(0)
            return []
        except Exception as exc:
            self.fatal.observe(exc)
            raise


def test_sticky_error_stops_engine_once(caplog):
    eng = StepDouble([STICKY[0], RuntimeError("CUDA error: an illegal memory access (cascade)")])
    with caplog.at_level(logging.ERROR, logger="tandem"):
        with pytest.raises(errors.EngineDeadError) as first:
            eng.step()
        for _ in range(3):
            with pytest.raises(errors.EngineDeadError) as later:
                eng.step()
    assert eng.calls == 1  # later steps fail fast, touching nothing
    assert first.value.__suppress_context__ and "illegal memory access was encountered" in str(first.value)
    assert str(later.value) == str(first.value)
    assert "asynchronously" not in first.value.first_error  # first line only
    errs = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errs) == 1 and errs[0].exc_info is not None and "sticky CUDA error" in errs[0].getMessage()
    assert eng.fatal.dead


def test_other_errors_pass_through_unchanged():
    boom = ValueError("bad request")
    eng = StepDouble([boom])
    with pytest.raises(ValueError) as info:
        eng.step()
    assert info.value is boom and not eng.fatal.dead
    assert eng.step() == []


def test_launch_blocking_sets_env_and_warns(monkeypatch):
    monkeypatch.delenv("CUDA_LAUNCH_BLOCKING", raising=False)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    with pytest.warns(RuntimeWarning, match="timings .* meaningless"):
        assert errors.enable_launch_blocking()
    assert os.environ["CUDA_LAUNCH_BLOCKING"] == "1" and errors.launch_blocking_active()
    assert Timeline().summary()["launch_blocking"] is True
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    with pytest.warns(RuntimeWarning) as got:
        assert not errors.enable_launch_blocking()
    assert any("no effect" in str(w.message) for w in got)


def test_timeline_recent_gauges_match_summary_window():
    tl = Timeline(recent_window=4)
    prev = None
    for i in range(10):
        r = _record(i, 10.0 + i * 0.01)
        r.process_ms, r.host_wait_ms = 0.5, 0.2
        tl.add(r)
        start, end = FakeEvent(i * 3.0 + (i % 3) * 0.5), FakeEvent(i * 3.0 + 2.0)
        tl.completed(r, start, end, prev)
        prev = end
    g, s = tl.recent(), tl.summary(skip=6)
    assert g["steps"] == 4 and g["mean_host_ms"] == pytest.approx(s["mean_host_ms"])
    fwd = sum(r.gpu_forward_ms for r in tl.records[6:])
    idle = sum(r.gpu_idle_before_ms for r in tl.records[6:])
    assert g["gpu_busy_fraction"] == pytest.approx(fwd / (fwd + idle))
    assert g["mean_cpu_lead_ms"] == pytest.approx(sum(r.cpu_lead_ms for r in tl.records[6:]) / 4)
    assert Timeline().recent() == {"steps": 0, "mean_host_ms": 0.0}


def test_step_records_count_tokens_context_and_pairs_of_every_kind_of_step():
    """A decode step's record takes one sum over its rows; prefill and verify rows each count
    their new tokens: context = start + n, pairs = n * start + n (n + 1) / 2 a row."""
    from tandem.engine import _step_record
    from tandem.request import Request
    from tandem.scheduler.batch import Row, ScheduledBatch

    def req():
        return Request("r", [1, 2, 3], SamplingParams(), seed=0, max_samples=8)

    def expected(rows, n_of):
        return (sum(n_of(r) for r in rows), sum(r.start + n_of(r) for r in rows),
                sum(n_of(r) * r.start + n_of(r) * (n_of(r) + 1) // 2 for r in rows))

    decode = [Row(req(), start, [9], None, 0) for start in (0, 5, 17, 130)]
    prefill = [Row(req(), 0, list(range(7)), list(range(7)), 0), Row(req(), 40, [1, 2], [5, 6], None)]
    verify = [Row(req(), 12, [3, 4, 5], None, 0, spec_k=3), Row(req(), 30, [], None, 0, spec_k=0)]
    for rows in (decode, prefill, decode[:2] + prefill, verify):
        rec = _step_record(ScheduledBatch(step=3, rows=rows), 0.0, 0.001, 0.002)
        assert (rec.num_tokens, rec.context_tokens, rec.attn_pairs) == expected(rows, lambda r: r.num_new)
