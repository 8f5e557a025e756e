#!/usr/bin/env bash
# One device-tool call: GPU tests and benchmarks, short table on stdout, full logs under $OUT.
# Usage (device tool): bash bench/gpu_check.sh [parts...]   parts: kernels engine kbench latency
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1 TANDEM_TEST_TOKENIZER=.model/tokenizer
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
parts=${*:-kernels engine kbench latency}
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
for p in $parts; do
  echo "=== $p"
  case $p in
    kernels) timeout 300 python3 -m pytest -q -x tests/test_kernels.py 2>&1 | tee "$OUT/kernels.log" | tail -5 ;;
    engine) TANDEM_TEST_DEVICE=cuda timeout 400 python3 -m pytest -q -x tests/test_engine.py -m "not slow" 2>&1 | tee "$OUT/engine.log" | tail -8 ;;
    gpu) TANDEM_TEST_DEVICE=cuda timeout 300 python3 -m pytest -q -x tests/test_gpu.py 2>&1 | tee "$OUT/gpu.log" | tail -8 ;;
    kbench) timeout 240 python3 bench/gpu_kernels.py --out "$OUT" 2>&1 | tail -30 ;;
    latency) timeout 400 python3 -m tandem.bench.latency --preset qwen3-0.6b --batch-sizes 1,16,64,256 --steps 50 --json "$OUT/latency.json" 2>&1 | tail -12 ;;
  esac
done
