"""`tandem bench spec-verify` on the CPU: the verify forward (k + 1 tokens per row over a
cached context) is laid out like the decode forward it is compared with — its first
position's logits equal the decode's, every position's equal the extend layout's — and the
report has every figure."""
import json

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
