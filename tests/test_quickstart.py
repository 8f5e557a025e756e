"""The README quick start works: the CLI and the Python API on the built-in model."""
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]


@pytest.mark.slow
def test_cli_generate_streams_the_golden_continuation():
    proc = subprocess.run([sys.executable, "-m", "tandem", "generate", "Once upon a time",
                           "--max-tokens", "16", "--temperature", "0", "--device", "cpu"],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    # transformers on the same dequantized weights (float32) continues this way (DESIGN.md §4)
    assert proc.stdout.startswith("Once upon a time, the city of Nova Haven was a thriving metropolis")


@pytest.mark.slow
def test_python_quick_start():
    code = """
from tandem import LLM, SamplingParams
llm = LLM(device="cpu")
outs = llm.generate(["Once upon a time", "The capital of France is"],
                    SamplingParams(max_tokens=12, temperature=0), use_tqdm=False)
print(outs[0].prompt_token_ids)
print(repr(outs[1].text), outs[1].finish_reason)
chat = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                SamplingParams(max_tokens=16, temperature=0), use_tqdm=False)
print(repr(chat[0].text))
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                          cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert lines[0] == "[6403, 1980, 253, 655]"
    assert "Paris" in lines[1]
    assert "Paris" in lines[2]
