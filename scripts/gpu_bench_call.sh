#!/usr/bin/env bash
# One device call: GPU tests of the fast step, then bench_step on the three shapes. Logs under $OUT.
# Needs the carried .whl (tyro & co.) when the machine lacks them.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site:$PWD
fi
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv | tee "$OUT/gpu.txt"
timeout 90 python3 -m pytest -q -m gpu tests/test_gpu_step.py 2>&1 | tail -25 | tee "$OUT/gpu_tests.log"
B="python3 scripts/bench_step.py"
timeout 200 $B --shape Qwen3-1.7B --check --ratio 1 3.4 --json "$OUT/q17.json" 2>&1 | grep -v "^RESULT\|Loading" | tee "$OUT/q17.log" | tail -12
timeout 110 $B --shape Qwen3-1.7B --skip-defaults --ratio 1 --modes tree --set compile_layers=false \
  --set gradient_checkpointing=true --json "$OUT/q17_var.json" 2>&1 | grep -v "^RESULT\|Loading" | tee "$OUT/q17_var.log" | tail -6
timeout 130 $B --shape Qwen3.5-2B --check --ratio 3.4 --steps 3 --warmup 2 --json "$OUT/q35.json" 2>&1 | grep -v "^RESULT\|Loading" | tee "$OUT/q35.log" | tail -8
timeout 90 $B --shape Qwen3-0.6B --ratio 1 3.4 --json "$OUT/q06.json" 2>&1 | grep -v "^RESULT\|Loading" | tee "$OUT/q06.log" | tail -6
