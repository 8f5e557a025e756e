#!/usr/bin/env bash
# H200 session for structured output (device tool): bash bench/gpu_grammar.sh
# Needs carried: .model/tokenizer (the built-in model's tokenizer, saved with save_pretrained) and
# .whl/ with xgrammar and the deps the GPU image lacks (cp312 manylinux), fetched with:
#   pip download --only-binary=:all: --no-deps --python-version 3.12 --implementation cp --abi cp312 \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
#     xgrammar==0.2.9 apache-tvm-ffi==0.1.15.post2 pydantic==2.14.4 pydantic-core==2.50.5 \
#     annotated-types==0.8.0 typing-inspection==0.4.5 jsonschema==4.26.0 \
#     jsonschema-specifications==2025.9.1 referencing==0.37.0 rpds-py==2026.9.1
set -u
export PYTHONUNBUFFERED=1 TANDEM_TEST_TOKENIZER=.model/tokenizer OMP_NUM_THREADS=4
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=.:/tmp/site
git rev-parse --short HEAD 2>/dev/null
what=${1:-all}  # tests | qwen3-0.6b | llama-3.1-8b | all (all fits one 10-minute device call)
if [ "$what" = tests ] || [ "$what" = all ]; then
  echo "=== GPU grammar tests"  # (not the mixed-batch test: it needs batch-invariant GPU kernels)
  TANDEM_TEST_DEVICE=cuda timeout 200 python3 -m pytest -q tests/test_gpu_grammar.py tests/test_grammar.py \
     -k "not neighbours" -m "gpu or not gpu" -p no:cacheprovider > "$OUT/gpu_grammar_tests.log" 2>&1
  echo "rc=$?"; grep -E "passed|failed|^FAILED|^E " "$OUT/gpu_grammar_tests.log" | tail -8
fi
for preset in qwen3-0.6b llama-3.1-8b; do
  [ "$what" = "$preset" ] || [ "$what" = all ] || continue
  echo "=== bench grammar $preset"
  timeout 180 python3 -m tandem.bench.grammar --preset "$preset" --tokenizer .model/tokenizer \
     --num-requests 128 --grammar-threads 8 --json "$OUT/grammar-$preset.json" 2>&1 | tail -12
done
