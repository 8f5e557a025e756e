"""`python -m tandem.bench.decode_kernels`: where a decode step's device time goes, bf16 or FP8."""
import sys

import pytest

from tandem.bench import decode_kernels


@pytest.mark.parametrize("quant", [None, "fp8"])
def test_profiles_a_decode_step_by_kernel(monkeypatch, capsys, quant):
    built, real_engine = [], decode_kernels.Engine

    def engine(cfg):
        built.append(real_engine(cfg))
        return built[-1]

    monkeypatch.setattr(decode_kernels, "Engine", engine)
    monkeypatch.setattr(sys, "argv", ["decode_kernels", "--preset", "tiny", "--batch", "2", "--steps", "2",
                                      "--prompt-len", "8", *(["--quantization", quant] if quant else [])])
    decode_kernels.main()
    out = capsys.readouterr().out
    assert "batch 2:" in out and "ms of kernel time per step" in out
    assert len([line for line in out.splitlines() if line.startswith("| ") and "calls/step" not in line]) >= 5
    scales = [m.weight_scale for m in built[0].model.modules() if hasattr(m, "weight_scale")]
    assert scales and all((s is not None) == (quant == "fp8") for s in scales)
