#!/usr/bin/env bash
# Batched H200 session (device tool): bash bench/gpu_final.sh A|B
#   A: fused-op bench, GPU tests, latency bench, Llama-3.1-8B offline, profile PNG
#   B: Qwen3-0.6B offline vs transformers generate_batch, serving benchmark at three rates
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1 TANDEM_TEST_TOKENIZER=.model/tokenizer OMP_NUM_THREADS=4
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
git rev-parse --short HEAD 2>/dev/null
case ${1:-A} in
A)
  echo "=== fused ops"; timeout 75 python3 bench/gpu_fused.py --out /tmp/fused 2>&1 | tail -22; cp /tmp/fused/gpu_fused.json "$OUT/" 2>/dev/null
  echo "=== GPU tests"
  TANDEM_TEST_DEVICE=cuda timeout 200 python3 -m pytest -q -x tests/test_gpu.py tests/test_gpu_diagnostics.py \
     "tests/test_engine.py::test_overlap_on_and_off_are_token_identical" tests/test_fused_ops.py -m "gpu or not gpu" \
     -p no:cacheprovider > "$OUT/gpu_tests.log" 2>&1; echo "rc=$?"; tail -4 "$OUT/gpu_tests.log"
  echo "=== latency"; timeout 110 python3 -m tandem.bench.latency --preset qwen3-0.6b --batch-sizes 1,16,64,256 \
     --steps 40 --json "$OUT/latency.json" 2>&1 | tail -16
  echo "=== offline llama-3.1-8b"; timeout 170 python3 -m tandem.bench.offline --preset llama-3.1-8b \
     --json "$OUT/offline-llama8b.json" 2>&1 | tail -14
  echo "=== profile"; timeout 80 python3 -m tandem.diagnostics.profile --preset qwen3-0.6b --num-requests 64 \
     --prompt-len 128 --max-tokens 32 --out /tmp/profile 2>&1 | tail -6
  cp /tmp/profile/timeline.png "$OUT/" 2>/dev/null; cp /tmp/profile/summary.json "$OUT/profile-summary.json" 2>/dev/null
  ;;
B)
  echo "=== GPU tests"
  TANDEM_TEST_DEVICE=cuda timeout 200 python3 -m pytest -q tests/test_gpu.py tests/test_gpu_diagnostics.py \
     "tests/test_engine.py::test_overlap_on_and_off_are_token_identical" \
     "tests/test_engine.py::test_broken_stash_is_caught_by_debug_future_map" -p no:cacheprovider > "$OUT/gpu_tests.log" 2>&1
  echo "rc=$?"; tail -4 "$OUT/gpu_tests.log"
  echo "=== latency"; timeout 110 python3 -m tandem.bench.latency --preset qwen3-0.6b --batch-sizes 1,16,64,256 \
     --steps 40 --json "$OUT/latency.json" 2>&1 | tail -16
  echo "=== offline qwen3-0.6b vs transformers"; timeout 330 python3 -m tandem.bench.offline --preset qwen3-0.6b \
     --compare-hf --hf-timeout 240 --json "$OUT/offline-qwen3.json" 2>&1 | tail -16
  echo "=== serve"
  D=$(python3 -c "from tandem.bench.presets import preset_dir; print(preset_dir('qwen3-0.6b'))")
  python3 -m tandem.server --model "$D" --dummy-weights --device cuda --max-model-len 2048 --port 8000 > /tmp/serve.log 2>&1 &
  SRV=$!; for i in $(seq 90); do curl -sf 127.0.0.1:8000/health >/dev/null && break; sleep 2; done
  timeout 200 python3 -m tandem.bench.serve --base-url http://127.0.0.1:8000 --rates 8,32,128 --num-prompts 150 \
     --input-len 100:1024 --output-len 100:512 --seed 0 --json "$OUT/serve-qwen3.json" 2>&1 | tail -14
  curl -s 127.0.0.1:8000/metrics | grep -E "^tandem_(gpu_busy|cpu_lead|host_ms|requests_running|kv_cache)" 
  kill -INT $SRV; wait $SRV; tail -3 /tmp/serve.log
  ;;
C)  # needs .whl carried (fastapi, uvicorn, pyzmq, msgspec, pydantic: absent on the GPU image)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=.:/tmp/site
  echo "=== GPU tests"
  TANDEM_TEST_DEVICE=cuda timeout 110 python3 -m pytest -q tests/test_gpu.py tests/test_gpu_diagnostics.py \
     -p no:cacheprovider > "$OUT/gpu_tests.log" 2>&1; echo "rc=$?"; grep -E "passed|failed|^FAILED" "$OUT/gpu_tests.log" | tail -8
  echo "=== serve"
  D=$(python3 -c "from tandem.bench.presets import preset_dir; print(preset_dir('qwen3-0.6b'))")
  python3 -m tandem.server --model "$D" --dummy-weights --device cuda --max-model-len 2048 --port 8000 > /tmp/serve.log 2>&1 &
  SRV=$!; for i in $(seq 60); do curl -sf 127.0.0.1:8000/health >/dev/null && break; sleep 1; done
  timeout 100 python3 -m tandem.bench.serve --base-url http://127.0.0.1:8000 --rates 16,128,1024 --num-prompts 120 \
     --input-len 100:1024 --output-len 64:256 --seed 0 --json "$OUT/serve-qwen3.json" 2>&1 | tail -12
  curl -s 127.0.0.1:8000/metrics | grep -E "^tandem_(gpu_busy|cpu_lead|host_ms|requests_running|kv_cache)"
  kill -INT $SRV; wait $SRV; tail -2 /tmp/serve.log
  ;;
esac
