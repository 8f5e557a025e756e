#!/usr/bin/env bash
# Batched H200 session D (device tool), one part per argument:
#   tests   GPU tests: prefix cache and overlap equivalence on CUDA, sync guard
#   prefix  `tandem bench prefix` cache on vs off: shared-prefix, multi-turn, standard (Qwen3-0.6B),
#           shared-prefix (Llama-3.1-8B)
#   serve   `tandem bench serve` from a cold server (warm-up at start): 16 then 128 req/s, for
#           mixed batches off / on with a 4096- or 2048-token prefill share per mixed step
# Carry .model (the built-in tokenizer, saved) for the tests.
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1 TANDEM_TEST_TOKENIZER=.model/tokenizer OMP_NUM_THREADS=4
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
git log -1 --format=%h 2>/dev/null
for part in "$@"; do
  echo "=== $part"
  case $part in
    tests)
      TANDEM_TEST_DEVICE=cuda timeout 240 python3 -m pytest -q -x tests/test_prefix_cache.py tests/test_gpu.py \
        "tests/test_engine.py::test_overlap_on_and_off_are_token_identical" -m "gpu or not gpu" -p no:cacheprovider \
        > "$OUT/gpu_tests.log" 2>&1; echo "rc=$?"; grep -E "passed|failed|^FAILED|Error" "$OUT/gpu_tests.log" | tail -6 ;;
    prefix)
      for w in shared multiturn standard; do
        timeout 200 python3 -m tandem.bench.prefix --preset qwen3-0.6b --workload $w --compare --max-running-requests 512 \
          --json "$OUT/prefix-qwen3-$w.json" 2>&1 | tail -4
      done
      timeout 240 python3 -m tandem.bench.prefix --preset llama-3.1-8b --workload shared --compare --max-running-requests 512 \
        --json "$OUT/prefix-llama8b-shared.json" 2>&1 | tail -4 ;;
    final)  # the merged tree: GPU tests of every issue, then decode latency (kernels + warm start)
      TANDEM_TEST_DEVICE=cuda timeout 300 python3 -m pytest -q tests/test_gpu.py tests/test_gpu_memory.py \
        tests/test_gpu_grammar.py tests/test_small_m_gemm.py tests/test_prefix_cache.py tests/test_step_faults.py \
        "tests/test_engine.py::test_overlap_on_and_off_are_token_identical" -m "gpu or not gpu" -s -p no:cacheprovider \
        > "$OUT/gpu_final_tests.log" 2>&1; echo "rc=$?"; grep -E "passed|failed|^FAILED|^memory:" "$OUT/gpu_final_tests.log" | tail -12
      timeout 120 python3 -m tandem.bench.latency --preset qwen3-0.6b --batch-sizes 1,16,64 --steps 40 \
        --json "$OUT/latency-final.json" 2>&1 | tail -8 ;;
    serve)
      D=$(python3 -c "from tandem.bench.presets import preset_dir; print(preset_dir('qwen3-0.6b'))")
      for cfg in ${SERVE_CONFIGS:-off:4096 on:4096 on:2048}; do
        mixed=${cfg%%:*}; chunk=${cfg##*:}; flag=""; [ "$mixed" = on ] && flag="--enable-mixed-batch"
        t0=$(date +%s.%N)
        python3 -m tandem.server --model "$D" --dummy-weights --device cuda --max-model-len 2048 --port 8000 \
          --chunked-prefill-size "$chunk" $flag > "$OUT/serve-$mixed-$chunk.log" 2>&1 &
        SRV=$!; for i in $(seq 120); do curl -sf 127.0.0.1:8000/health >/dev/null && break; sleep 1; done
        echo "--- mixed $mixed, chunk $chunk: ready after $(python3 -c "import time; print(round(time.time() - $t0, 1))") s"
        grep -o "warm-up: [0-9.]*s" "$OUT/serve-$mixed-$chunk.log"
        timeout 100 python3 -m tandem.bench.serve --base-url http://127.0.0.1:8000 --rates 16,128 --num-prompts 120 \
          --input-len 100:1024 --output-len 100:512 --seed 0 --json "$OUT/serve-$mixed-$chunk.json" 2>&1 | tail -5
        kill -INT $SRV; wait $SRV
      done ;;
  esac
done
