"""`tandem bench spec-verify` on the CPU: the verify forward (k + 1 tokens per row over a
cached context) is laid out like the decode forward it is compared with — its first
position's logits equal the decode's, every position's equal the extend layout's — and the
report has every figure."""
import json

import pytest
import torch

from tandem.bench import spec_verify


def test_verify_first_position_equals_decode_and_the_report_is_complete(tmp_path):
    out = tmp_path / "sv.json"
    assert spec_verify.main(["--preset", "tiny", "--device", "cpu", "--batch-sizes", "1,3", "--k", "3",
                             "--context", "40", "--iters", "2", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["batch"], r["k"], r["context"]) for r in rows] == [(1, 3, 40), (3, 3, 40)]
    for r in rows:
        assert r["first_position_max_diff"] < 1e-4, r
        assert r["layouts_max_diff"] < 1e-4, r  # a decode row per query == the extend kernel's causal mask
        assert r["decode_ms"] > 0 and r["verify_ms"] > 0 and r["ratio"] > 0


@pytest.mark.parametrize("value,message", [("3", "M bucket"), ("8", "needs CUDA")])
def test_force_fused_takes_an_m_bucket_and_needs_cuda(value, message, capsys):
    with pytest.raises(SystemExit):
        spec_verify.main(["--preset", "tiny", "--device", "cpu", "--batch-sizes", "1", "--context", "8",
                          "--iters", "1", "--force-fused", value])
    assert message in capsys.readouterr().err


@pytest.mark.gpu
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs CUDA")
def test_force_fused_measures_both_plan_sets_on_cuda(tmp_path):
    out = tmp_path / "sv.json"
    assert spec_verify.main(["--preset", "tiny", "--device", "cuda", "--dtype", "bfloat16", "--batch-sizes", "1",
                             "--context", "64", "--iters", "3", "--force-fused", "8", "--kernels",
                             "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["plans"] for r in rows] == ["tuned", "fused@8"]
    # Forced fused prologues at M = 8 drop the 5-row verify's norm and SiLU-mul launches.
    count = {(r["plans"], name): sum(n for _, n, _ in table) for r in rows for name, table in r["kernels"].items()}
    assert count[("fused@8", "verify")] < count[("tuned", "verify")] or count[("tuned", "verify")] == \
        count[("tuned", "decode")], count
    tuned, fused = rows
    # The fused prologues compute the same forward: the 5-row verify (M bucket 8, forced fused)
    # still agrees with the 1-row decode as closely as it did with the tuned plans, bf16 apart.
    assert fused["first_position_max_diff"] <= max(0.5, 4 * tuned["first_position_max_diff"]), rows
    assert fused["verify_ms"] > 0


def test_prints_the_tuners_choice_for_the_decode_and_verify_buckets(capsys):
    pytest.importorskip("triton")
    from tandem.kernels.small_m_gemm import GemmConfig
    cfg = GemmConfig(16, 256, 1, 4)
    results = {(960, 576, torch.bfloat16, 1, None): (cfg, 0.003, 0.005),
               (960, 576, torch.bfloat16, 1, "norm"): (cfg, 0.004, 0.006),
               (960, 576, torch.bfloat16, 8, None): (cfg, 0.003, 0.004),
               (960, 576, torch.bfloat16, 16, None): (None, 0.004, 0.004),
               (960, 576, torch.bfloat16, 16, "norm"): (None, 0.0071, 0.0071)}
    spec_verify._print_tuning(results, {1, 9})  # a k 8 verify runs at the M 16 bucket
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("small-M GEMM plans:") and "norm M=1 1/1, M=16 0/1" in lines[0]
    shapes = [line.strip() for line in lines[1:]]
    assert [line.split(":")[0].split()[0] for line in shapes] == ["M=1", "M=1", "M=16", "M=16"]
    assert "M=16 N=960 K=576 bfloat16 norm: baseline 7.1 us (baseline 7.1 us)" in shapes
