#!/usr/bin/env bash
# Issue 23 item 2 A/B on one machine: new (this tree) vs old (devscripts/old/tandem = 0793ab6), tier on; new tier off.
set -u
DEADLINE=$(( $(date +%s) + ${1:-540} ))
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
nvidia-smi --query-gpu=name,memory.used --format=csv,noheader
ROOT=$(pwd)
BASE="--preset qwen3-0.6b --device cuda --workload multiturn --conversations 64 --turns 8 --system-len 1024 --question-len 1024 --output-len 128 --max-running-requests 12 --max-total-tokens 147456"
i=0
for run in ${RUNS:-new-on old-on young-on new-off new-on young-on old-on}; do
  i=$((i+1))
  left=$(( DEADLINE - $(date +%s) ))
  need=95; case $run in *-off) need=65;; esac
  if [ $left -lt $need ]; then echo "skip $i-$run: $left s left"; continue; fi
  case $run in
    young-on) extra="--host-kv-cache-gb 48 --experiment shadow_young_min_tokens=256";;
    *-on) extra="--host-kv-cache-gb 48";;
    *-off) extra="--host-kv-cache-gb 0";;
  esac
  case $run in
    new-*|young-*) dir=$ROOT;;
    old-*) dir=$ROOT/devscripts/old;;
  esac
  t0=$(date +%s)
  (cd $dir && PYTHONPATH=/tmp/site timeout $((left - 5)) python3 -m tandem bench prefix $BASE $extra --json $OUT/$i-$run.json > $OUT/$i-$run.log 2>&1)
  echo "$i-$run rc=$? $(( $(date +%s) - t0 )) s"
  python3 - "$OUT/$i-$run.json" <<'PY'
import json, sys
try:
    rows = json.load(open(sys.argv[1]))
except Exception as e:
    print("  no json", e); sys.exit()
for r in (rows if isinstance(rows, list) else [rows]):
    tok = round(r["output_tokens"] / r["wall_s"])
    ids = r.get("idle_steps") or {}
    print("  ", tok, "tok/s", {k: round(r[k], 4) if isinstance(r.get(k), float) else r.get(k) for k in ("ttft_p50_ms", "ttft_p99_ms", "gpu_busy", "host_hit_rate", "tier_stall_s", "host_ms_per_step", "gpu_idle_s_by_tenth")})
    print("   idle", ids.get("causes"), "gc_s", ids.get("gc_s"), "passes", ids.get("gc_passes"))
PY
done
