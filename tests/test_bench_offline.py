"""`tandem bench offline`: the harness runs on the CPU, its numbers are well-formed, and the
roofline counts bytes and FLOPs as DESIGN.md §5 says."""
import json
import math

import pytest
import torch

from tandem.bench import offline
from tandem.bench.offline import make_workload, run_tandem
from tandem.bench.presets import PRESETS, preset_dir
from tandem.bench.roofline import Hardware, ModelCost, measure_hardware, model_cost, roofline, step_bytes, step_flops
from tandem.config import EngineConfig
from tandem.diagnostics.timeline import StepRecord
from tandem.engine import Engine
from tandem.entrypoints.llm import LLM

SMALL = ["--preset", "tiny", "--num-requests", "16", "--min-len", "8", "--max-len", "48", "--device", "cpu"]


def _rec(step, batch, tokens, decode, context, pairs, **kw):
    r = StepRecord(step, batch, tokens, decode, context, pairs, 0.0, 0.0, 0.0)
    for k, v in kw.items():
        setattr(r, k, v)
    return r


COST = ModelCost(weight_bytes=1000, lm_head_bytes=200, embed_row_bytes=8, body_params=500,
                 lm_head_params=100, kv_bytes_per_token=16, num_layers=2, num_heads=4, head_dim=8)
# A prefill of two prompts (6 and 4 tokens, from position 0), then one decode step of both.
PREFILL = _rec(0, 2, 10, False, 10, 6 * 7 // 2 + 4 * 5 // 2)  # pairs 21 + 10
DECODE = _rec(1, 2, 2, True, 7 + 5, 7 + 5)


def test_step_counts_by_hand():
    # weights + lm_head + gathered embedding rows + KV read + KV written
    assert step_bytes(PREFILL, COST) == 1000 + 200 + 10 * 8 + 10 * 16 + 10 * 16 == 1600
    assert step_bytes(DECODE, COST) == 1000 + 200 + 2 * 8 + 12 * 16 + 2 * 16 == 1440
    # 2 x body x tokens + 2 x lm_head x sampled rows + 4 x pairs x heads x head_dim x layers
    assert step_flops(PREFILL, COST) == 2 * 500 * 10 + 2 * 100 * 2 + 4 * 31 * 4 * 8 * 2 == 18336
    assert step_flops(DECODE, COST) == 2 * 500 * 2 + 2 * 100 * 2 + 4 * 12 * 4 * 8 * 2 == 5472


def test_rows_that_do_not_sample_skip_the_lm_head():
    chunk = _rec(0, 1, 10, False, 10, 55, num_sampled=0)  # a chunk that does not finish its prompt
    assert step_bytes(chunk, COST) == 1000 + 10 * 8 + 10 * 16 + 10 * 16
    assert step_flops(chunk, COST) == 2 * 500 * 10 + 4 * 55 * 4 * 8 * 2


def test_roofline_sums_per_step_floors():
    hw = Hardware(bandwidth=1000.0, matmul_flops=10000.0, dtype="float32", device="cpu",
                  copy_bytes=0, matmul_n=0)
    rl = roofline([PREFILL, DECODE], COST, hw)
    # prefill: max(1.6 s memory, 1.8336 s compute); decode: max(1.44 s, 0.5472 s)
    assert rl.steps == 2 and rl.bytes == 3040 and rl.flops == 18336 + 5472
    assert math.isclose(rl.prefill_time_s, 1.8336) and math.isclose(rl.decode_time_s, 1.44)
    assert math.isclose(rl.time_s, 1.8336 + 1.44) and rl.memory_bound_steps == 1


@pytest.mark.parametrize("tied", [True, False])
def test_model_cost_counts_the_model(tmp_path, tied):
    cfg = dict(PRESETS["tiny"], tie_word_embeddings=tied)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    engine = Engine(EngineConfig(model=str(tmp_path), dummy_weights=True, device="cpu", dtype="float32",
                                 cuda_graph="off"))
    cost = model_cost(engine.model, engine.model_config, torch.float32)
    total = sum(p.numel() for p in engine.model.parameters())
    vocab, hidden = cfg["vocab_size"], cfg["hidden_size"]
    assert cost.lm_head_params == vocab * hidden and cost.lm_head_bytes == 4 * vocab * hidden
    embed = vocab * hidden * (1 if tied else 2)  # tied: one matrix is both
    assert cost.body_params == total - embed
    assert cost.weight_bytes == 4 * cost.body_params
    assert cost.embed_row_bytes == (0 if tied else 4 * hidden)
    assert cost.kv_bytes_per_token == 2 * 2 * cfg["num_key_value_heads"] * (hidden // 4) * 4
    assert (cost.num_layers, cost.num_heads, cost.head_dim) == (2, 4, 16)
    # An e4m3 pool (kv_cache_dtype="fp8") reads a byte an element: the roofline's KV bytes too.
    assert model_cost(engine.model, engine.model_config, torch.float8_e4m3fn).kv_bytes_per_token * 4 == \
        cost.kv_bytes_per_token


def test_workload_is_seeded_and_in_range():
    a, b = make_workload(32, 512, 100, 1024, seed=3), make_workload(32, 512, 100, 1024, seed=3)
    assert a == b and a != make_workload(32, 512, 100, 1024, seed=4)
    assert all(100 <= len(p) <= 1024 for p in a.prompts) and all(100 <= n <= 1024 for n in a.output_lens)
    assert all(0 <= t < 512 for p in a.prompts for t in p)
    assert a.input_tokens == sum(map(len, a.prompts)) and a.output_tokens == sum(a.output_lens)
    assert make_workload(4, 512, 10, 20, output_len=7).output_lens == [7] * 4


def test_timeline_tokens_match_the_workload():
    """Every prompt token and every sampled token but the last is fed once: the counts the
    roofline uses add up to the workload."""
    llm = LLM.from_config(EngineConfig(model=preset_dir("tiny"), dummy_weights=True, device="cpu",
                                       timeline=True, max_prefill_tokens=64, chunked_prefill_size=32))
    engine = llm.engine
    wl = make_workload(12, engine.model_config.vocab_size, 5, 80, seed=1)
    for overlap in (True, False):
        first = len(engine.timeline.records)
        row = run_tandem(llm, wl, overlap, progress=False)
        recs = engine.timeline.records[first:]
        assert row.output_tokens == wl.output_tokens and row.steps == len(recs)
        assert sum(r.num_tokens for r in recs) == wl.input_tokens + wl.output_tokens - wl.num_requests
        assert sum(r.num_tokens for r in recs if r.is_decode) == wl.output_tokens - wl.num_requests


def test_measure_hardware_cpu():
    hw = measure_hardware(torch.device("cpu"), torch.float32, copy_bytes=4 << 20, matmul_n=128)
    assert hw.bandwidth > 1e8 and hw.matmul_flops > 1e8 and hw.device == "cpu"


def _check_rows(rows, requests):
    wl_in, wl_out = None, None
    for r in rows:
        assert r["requests"] == requests
        wl_in, wl_out = wl_in or r["input_tokens"], wl_out or r["output_tokens"]
        assert (r["input_tokens"], r["output_tokens"]) == (wl_in, wl_out)
        assert r["wall_s"] > 0 and r["output_tok_s"] > 0 and r["total_tok_s"] > r["output_tok_s"]
        if r["engine"] == "tandem":
            assert r["steps"] > 0 and r["bytes"] > 0 and r["flops"] > 0 and r["roofline_s"] > 0
            assert 0 < r["roofline_fraction"] <= 1.5


def test_offline_harness_cpu(tmp_path, capsys):
    out = tmp_path / "offline.json"
    assert offline.main(SMALL + ["--json", str(out)]) == 0
    data = json.loads(out.read_text())
    rows = data["rows"]
    assert [(r["engine"], r["overlap"]) for r in rows] == [("tandem", True), ("tandem", False)]
    wl = make_workload(16, PRESETS["tiny"]["vocab_size"], 8, 48, seed=0)
    assert (rows[0]["input_tokens"], rows[0]["output_tokens"]) == (wl.input_tokens, wl.output_tokens)
    assert data["workload"]["output_tokens"] == wl.output_tokens
    _check_rows(rows, 16)
    assert data["hardware"]["bandwidth"] > 0 and data["hardware"]["matmul_flops"] > 0
    table = capsys.readouterr().out
    assert "| tandem | on | 16 |" in table and "overlap on / off" in table and "CPU figures" in table


def test_offline_takes_the_kv_cache_dtype(tmp_path):
    """`--kv-cache-dtype fp8` (the engine option) reaches the engine and the record says so."""
    out = tmp_path / "offline.json"
    assert offline.main(SMALL + ["--no-overlap-off", "--kv-cache-dtype", "fp8", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["engine"]["kv_cache_dtype"] == "float8_e4m3fn" and data["args"]["kv_cache_dtype"] == "fp8"
    _check_rows(data["rows"], 16)


def test_offline_compare_hf_cpu(tmp_path, capsys):
    out = tmp_path / "offline.json"
    args = SMALL + ["--num-requests", "8", "--no-overlap-off", "--compare-hf", "--json", str(out)]
    assert offline.main(args) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["engine"] for r in rows] == ["tandem", "transformers"]
    _check_rows(rows, 8)
    assert "transformers continuous batching" in capsys.readouterr().out
