"""`tandem bench grammar` runs on the CPU with tiny shapes (the H200 run uses the same code)."""
import json
import os

import pytest

from tandem.bench import grammar

pytest.importorskip("xgrammar")


def test_grammar_bench_dry_run(tmp_path, capsys):
    out = tmp_path / "grammar.json"
    argv = ["--preset", "tiny", "--num-requests", "2", "--prompt-len", "8", "--max-tokens", "160",
            "--device", "cpu", "--grammar-threads", "1", "--repeat", "2", "--json", str(out)]
    if os.environ.get("TANDEM_TEST_TOKENIZER"):
        argv += ["--tokenizer", os.environ["TANDEM_TEST_TOKENIZER"]]
    assert grammar.main(argv) == 0
    report = json.loads(out.read_text())
    rows = {(r["constrained"], r["overlap"], r["mask_overlap"]): r for r in report["rows"]}
    assert set(rows) == {(True, True, True), (False, True, True), (True, True, False), (True, False, True),
                         (False, False, True)}
    assert rows[(True, True, False)]["valid"] == 2
    for r in rows.values():  # two runs each, the reported one the slower (the lower middle of two)
        assert len(r["runs_tok_s"]) == 2 and r["output_tok_s"] == pytest.approx(min(r["runs_tok_s"]), abs=0.1)
    rows = {(c, o): r for (c, o, m), r in rows.items() if m}
    for overlap in (True, False):
        c, u = rows[(True, overlap)], rows[(False, overlap)]
        assert c["valid"] == 2 and c["output_tokens"] == u["output_tokens"] > 0
        assert c["grammar_ms_per_step"] > 0 and u["grammar_ms_per_step"] == 0
        assert 0 < c["host_ms_per_step"] and c["steps"] > 0
    assert report["constrained_tokens_identical_overlap_on_off"] is True
    assert "constrained / unconstrained output tok/s" in capsys.readouterr().out


def test_median_row_is_the_middle_run_and_keeps_every_runs_rate():
    runs = [grammar.GrammarRow(True, True, True, 4, 100, wall, 10, 1.0, 0.5, 0.1, None, 4) for wall in (1.0, 0.5, 2.0)]
    row = grammar.median_row(runs)
    assert row.wall_s == 1.0 and row.runs_tok_s == [100.0, 200.0, 50.0]
