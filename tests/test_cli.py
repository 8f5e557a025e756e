"""The `tandem` command line on a tiny model."""
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parents[1]
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}


def _tandem(*args, stdin=None, timeout=300):
    return subprocess.run([sys.executable, "-m", "tandem", *args], input=stdin, capture_output=True,
                          text=True, timeout=timeout, cwd=ROOT, env=ENV)


def test_generate_streams_prompt_and_continuation(tiny_text_model):
    proc = _tandem("generate", "Hello there", "--model", str(tiny_text_model), "--device", "cpu",
                   "--max-tokens", "8", "--temperature", "0")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("Hello there") and len(proc.stdout) > len("Hello there\n")


def test_chat_answers_then_quits_on_empty_line(tiny_text_model):
    proc = _tandem("chat", "--model", str(tiny_text_model), "--device", "cpu", "--max-tokens", "6",
                   "--temperature", "0", stdin="Hi!\nAnd again?\n\n")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("assistant> ") == 2


def test_bench_latency_runs_on_cpu(tmp_path):
    out = tmp_path / "lat.json"
    proc = _tandem("bench", "latency", "--preset", "tiny", "--device", "cpu", "--batch-sizes", "1,4",
                   "--steps", "4", "--warmup", "1", "--prompt-len", "8", "--ttft-burst", "2",
                   "--experiment", "fused_kv_write=off", "--host-profile", "2", "--kv-cache-dtype", "fp8",
                   "--json", str(out))
    assert proc.returncode == 0, proc.stderr
    result = json.loads(out.read_text())
    rows = result["rows"]
    assert [(r["batch"], r["overlap"]) for r in rows] == [(1, True), (1, False), (4, True), (4, False)]
    assert all(r["tokens_per_s"] > 0 and r["step_ms"] > 0 for r in rows)
    assert "runner.py" in result["host_profile"] and "launch" in result["host_profile"]
    assert result["args"]["kv_cache_dtype"] == "fp8"  # the engine option's flag, in bench latency's parser


def test_unknown_command_and_bad_option_fail_clearly(tiny_text_model):
    assert _tandem("frobnicate").returncode == 2
    proc = _tandem("generate", "x", "--model", str(tiny_text_model), "--device", "cpu", "--temperature", "-1")
    assert proc.returncode != 0 and "temperature" in proc.stderr
