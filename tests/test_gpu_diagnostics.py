"""GPU halves of the diagnostics (run on the H200 through the device tool): the sync audit
finds a planted `.item()` at its file:line and nothing in the real loop; the timeline's device
fields; `tandem profile` on CUDA; a sticky CUDA error stops the engine once, cleanly."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tandem import LLM, SamplingParams
from tandem.diagnostics.profile import profile_main
from tandem.diagnostics.sync_audit import SyncAudit, sync_audit_main
from tandem.diagnostics.timeline import read_timeline

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

PROMPTS = [[5 + i, 6, 7, 8] * (3 + i) for i in range(8)]
MARK = "PLANTED" + "-SYNC"  # the marker comment on the planted line (spelled apart here)


def _engine(model, **kw):
    llm = LLM(str(model), device="cuda", dtype="float32", **kw)
    warm = SamplingParams(max_tokens=6, temperature=0.8, top_p=0.9, top_k=20, logprobs=2,
                          presence_penalty=0.5, ignore_eos=True)
    llm.generate(PROMPTS[:3], warm, use_tqdm=False)  # compile kernels, fill the allocator cache
    return llm.engine


def _run(engine, tag, max_tokens=16):
    params = [SamplingParams(max_tokens=max_tokens, temperature=t, top_p=0.9, top_k=20, logprobs=2,
                             presence_penalty=0.5 if t else 0.0, ignore_eos=True) for t in (0, 0.8)]
    rids = [engine.add_request(p, params[i % 2], request_id=f"{tag}{i}") for i, p in enumerate(PROMPTS)]
    while engine.has_unfinished():
        engine.step()
    for rid in rids:
        assert len(engine.output(rid).token_ids) == max_tokens
        engine.release(rid)


def _planted_line() -> int:
    lines = Path(__file__).read_text().splitlines()
    return next(i for i, s in enumerate(lines, 1) if s.rstrip().endswith("# " + MARK))


def test_sync_audit_flags_a_planted_item(tiny_text_model):
    engine = _engine(tiny_text_model)
    launch = engine.runner.launch

    def launch_with_item(batch, **kwargs):  # test double: the runner, plus a host read of a device value
        pending = launch(batch, **kwargs)
        engine.future_map.buf[0].item()  # PLANTED-SYNC
        return pending

    engine.runner.launch = launch_with_item
    first = engine.step_id
    with SyncAudit(roots=[__file__]) as audit:
        _run(engine, "p")
    del engine.runner.launch
    report = audit.report()
    print(report.format())
    assert [(Path(s.filename).name, s.lineno, s.function) for s in report.sites] == \
        [(Path(__file__).name, _planted_line(), "launch_with_item")]
    assert report.sites[0].count == engine.step_id - first  # once per launched step
    assert f"test_gpu_diagnostics.py:{_planted_line()}" in report.format()


def test_sync_audit_real_loop_is_clean(tiny_text_model):
    engine = _engine(tiny_text_model, enable_mixed_batch=True, chunked_prefill_size=16)
    with SyncAudit() as audit:
        _run(engine, "c")
    report = audit.report()
    assert report.sites == [], report.format()


@pytest.mark.whole_gpu  # the preset's pool is sized from the whole device
def test_sync_audit_cli_on_the_preset(capsys):
    """The real loop at the qwen3-0.6b shape (dummy bf16 weights): zero syncs, exit 0."""
    rc = sync_audit_main(["--num-requests", "8", "--prompt-len", "48", "--max-tokens", "16"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "0 host syncs" in out


def test_timeline_device_fields_on_cuda(tiny_text_model, tmp_path):
    path = tmp_path / "steps.jsonl"
    engine = _engine(tiny_text_model, timeline=str(path))
    # Warm-up steps (CUDA) ran before the timeline existed: step numbers start past them.
    first, first_step = len(engine.timeline.records), engine.step_id
    torch.cuda.set_sync_debug_mode("error")  # reading the events must not sync
    try:
        _run(engine, "t")
    finally:
        torch.cuda.set_sync_debug_mode(0)
    engine.timeline.close()
    recs = engine.timeline.records[first:]
    assert [r.step for r in recs] == list(range(first_step, engine.step_id))
    for r in recs:
        assert r.gpu_forward_ms is not None and r.gpu_forward_ms > 0
        assert r.gpu_idle_before_ms is not None and r.gpu_idle_before_ms >= 0
        assert r.cpu_lead_ms is not None
    s = engine.timeline.summary(skip=first)
    assert 0 < s["gpu_busy_fraction"] <= 1 and "mean_cpu_lead_ms" in s
    assert len(read_timeline(path)) == len(engine.timeline.records)  # every recorded step is in the file


def test_profile_on_cuda(tiny_text_model, tmp_path):
    from matplotlib.image import imread
    out = tmp_path / "prof"
    assert profile_main(["--out", str(out), "--model", str(tiny_text_model), "--dtype", "float32",
                         "--num-requests", "8", "--prompt-len", "16", "--max-tokens", "24"]) == 0
    for name in ("on", "off"):
        events = json.loads((out / f"trace_overlap_{name}.json").read_text())["traceEvents"]
        assert any(e.get("cat") == "kernel" for e in events)
        steps = read_timeline(out / f"steps_overlap_{name}.jsonl")
        assert all(d["gpu_forward_ms"] is not None for d in steps)
    summary = json.loads((out / "summary.json").read_text())
    assert 0 < summary["window"]["overlap on"]["gpu_busy"] <= 1
    assert imread(out / "timeline.png").shape[0] > 100


STICKY_SCRIPT = r'''
import json, logging, os, sys
import torch
from tandem import LLM, SamplingParams
from tandem.diagnostics.errors import EngineDeadError
logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
os.environ["TANDEM_DEBUG_FUTURE_MAP"] = "1"  # read when the engine is built
llm = LLM(sys.argv[1], device="cuda", dtype="float32")
engine = llm.engine
for i in range(4):
    engine.add_request([5 + i, 6, 7, 8] * 3, SamplingParams(max_tokens=64, temperature=0, ignore_eos=True))
for _ in range(3):
    engine.step()  # prefill, then decodes in flight
with torch.cuda.stream(engine.streams.forward):
    engine.future_map.buf[1:].fill_(-1)  # planted bug: the next decode reads tokens nobody wrote
seen = []
for _ in range(8):
    try:
        engine.step()
    except EngineDeadError as exc:
        seen.append("dead: " + str(exc))
    except Exception as exc:
        seen.append("OTHER " + type(exc).__name__ + ": " + str(exc).splitlines()[0])
print("RESULT " + json.dumps({"seen": seen, "dead": engine.fatal.dead}), flush=True)
sys.stderr.flush()
os._exit(0)  # skip destructors on a dead context
'''


def test_sticky_error_stops_the_engine_once(tiny_text_model, tmp_path):
    """A device-side assert (sticky) in the FutureMap's debug check: the engine logs the first
    error once, raises EngineDeadError, and every later step fails fast the same way.
    Needs the engine hook (Engine.fatal, see tandem/diagnostics/errors.py)."""
    script = tmp_path / "sticky.py"
    script.write_text(STICKY_SCRIPT)
    proc = subprocess.run([sys.executable, str(script), str(tiny_text_model)], capture_output=True, check=False,
                          text=True, timeout=300, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    result = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("RESULT "))[7:])
    assert result["dead"], (proc.stdout, proc.stderr[-3000:])
    assert result["seen"] and all(s.startswith("dead: ") for s in result["seen"]), result
    assert "device-side assert triggered" in result["seen"][0]
    assert len(set(result["seen"])) == 1
    assert proc.stderr.count("sticky CUDA error") == 1, proc.stderr[-3000:]
    assert proc.stderr.count("Traceback (most recent call last)") == 1, proc.stderr[-3000:]


def test_graph_launch_probe_measures_every_pattern(capsys):
    """`python3 -m tandem.bench.graph_launch` on the tiny preset: a row per pattern, a positive
    host time for each bucket."""
    from tandem.bench.graph_launch import main
    assert main(["--preset", "tiny", "--bucket", "1", "--bucket", "4"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ") and "pattern" not in line]
    assert len(rows) == 6
    for row in rows:
        assert all(float(cell) > 0 for cell in row.strip("| ").split(" | ")[1:])


def test_collector_runs_in_the_wait_for_a_step_still_running(tiny_text_model):
    """With the experiment on, the host's wait for a step the device is still running holds a
    collector pass (the device kept busy by a sleep queued on the forward stream before it);
    the outputs are the plain run's."""
    import gc
    from tandem.config import Experiments
    prompt, params = [5, 6, 7, 8] * 8, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    plain = LLM(str(tiny_text_model), device="cuda", dtype="float32")
    want = plain.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    plain.close()
    engine = _engine(tiny_text_model, experiments=Experiments(collect_in_shadow=True))
    engine.collector.min_tokens = 1
    seen = []

    def on_gc(phase, info):
        if phase == "start":
            seen.append(info["generation"])
    rid = engine.add_request(prompt, params)
    with torch.cuda.stream(engine.streams.forward):
        torch.cuda._sleep(200_000_000)  # ~0.1 s of device time ahead of the step
    gc.callbacks.append(on_gc)
    try:
        while engine.has_unfinished():
            engine.step()
    finally:
        gc.callbacks.remove(on_gc)
    assert engine.collector.passes >= 1 and {1, 2} & set(seen)
    assert engine.output(rid).token_ids == want
