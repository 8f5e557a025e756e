#!/usr/bin/env bash
# The GPU suite's tests part in one call, without the built-in GGUF (no GPU-selected test loads it;
# the tests' tokenizer comes from .model/tokenizer).
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:.
nvidia-smi --query-gpu=name --format=csv,noheader
python3 -m tandem bench suite --parts ${2:-tests} --budget tests=$(( ${1:-420} - 15 )) --deadline ${1:-420} --commit $(cat devscripts/HEAD) --out $OUT --tokenizer .model/tokenizer ${WORKERS:+--test-workers $WORKERS} 2>&1 | tail -40
