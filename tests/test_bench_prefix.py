"""`tandem bench prefix` runs on the CPU at a tiny size: the shared-prefix and n-sample
workloads with cascade attention on and off, and the three-way comparison's table."""
import json

from tandem.bench import prefix

TINY = ["--preset", "tiny", "--device", "cpu", "--dtype", "float32", "--system-len", "300",
        "--question-len", "5", "--output-len", "6", "--max-running-requests", "16"]


def _row(capsys, argv: list[str]) -> dict:
    assert prefix.main(argv) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_shared_workload_with_cascade_on_and_off(capsys):
    shared = TINY + ["--workload", "shared", "--groups", "2", "--per-group", "4"]
    on = _row(capsys, shared + ["--cascade", "on"])
    off = _row(capsys, shared + ["--cascade", "off"])
    assert on["cascade"] == "on" and on["cascade_steps"] > 0 and off["cascade_steps"] == 0
    assert on["requests"] == off["requests"] == 8 and on["output_tokens"] == off["output_tokens"] == 48
    assert on["hit_rate"] > 0.5


def test_samples_workload_groups_the_n_samples(capsys):
    row = _row(capsys, TINY + ["--workload", "samples", "--prompts", "2", "--n", "4", "--cascade", "on"])
    assert row["requests"] == 8 and row["output_tokens"] == 48
    assert row["cascade_steps"] > 0


def test_compare_cascade_table():
    rows = [dict(workload="shared", cache=c, cascade=k, requests=8, output_tok_s=t, ttft_p50_ms=1.0,
                 ttft_p99_ms=2.0, hit_rate=0.5, host_ms_per_step=0.1, gpu_busy=None, cascade_steps=s, wall_s=1.0)
            for c, k, t, s in ((False, "off", 100.0, 0), (True, "off", 200.0, 0), (True, "auto", 400.0, 9))]
    table = prefix.format_table(rows)
    assert "x4.00 of cache off, x2.00 of cache on without cascade" in table
    assert prefix._without_compare(["--compare-cascade", "--cascade", "on", "--n", "3"]) == ["--n", "3"]
