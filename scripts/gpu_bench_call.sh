#!/usr/bin/env bash
# One device call: bench_step on the Qwen3-0.6B, Qwen3-1.7B and Qwen3.5-2B shapes, each with its kernel profile (the
# table the next speed round starts from; the Qwen3 shapes also with the path-gathering tree attention,
# --set attn_backend=flash_varlen, side by side with the default flash_split; SET overrides that), then the GPU tests.
# Knobs: T06 T17 T35 TT (timeouts, s), TEST_PATHS (pytest -m gpu paths; "tests": every GPU test). The profile is of the first case: ratio 1 tree for 0.6B, ratio 3.4 tree for 1.7B.
# Needs the carried .whl (tyro & co., fla-core) when the machine lacks them. Logs under $OUT.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site:$PWD
fi
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
source scripts/kernel_cache.sh  # kernel caches in .kernel-cache; autotune results packed into $OUT at exit
trap save_autotune_results EXIT
nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv | tee "$OUT/gpu.txt"
B="python3 scripts/bench_step.py"
timeout ${T06:-180} $B --shape Qwen3-0.6B --profile --ratio 1 3.4 --set ${SET:-attn_backend=flash_varlen} \
  --json "$OUT/q06.json" 2>&1 \
  | grep -v "^RESULT\|Loading\|Writing" | tee "$OUT/q06.log" | grep -v "^ \|^-\|^PROFILE\|Self " | tail -8
timeout ${T17:-240} $B --shape Qwen3-1.7B --check --profile --ratio 3.4 1 --set ${SET:-attn_backend=flash_varlen} \
  --json "$OUT/q17.json" 2>&1 \
  | grep -v "^RESULT\|Loading\|Writing" | tee "$OUT/q17.log" | grep -v "^ \|^-\|^PROFILE\|Self " | tail -12
timeout ${T35:-200} $B --shape Qwen3.5-2B --check --ratio 3.4 --modes tree plain --steps 3 --warmup 2 \
  --profile --json "$OUT/q35.json" 2>&1 | grep -v "^RESULT\|Loading\|Writing" | tee "$OUT/q35.log" \
  | grep -v "^ \|^-\|^PROFILE\|Self " | tail -10
timeout ${TT:-150} python3 -m pytest -q -m gpu ${TEST_PATHS:-tests/test_gpu_step.py tests/test_tree_split.py \
  tests/test_tree_attention.py} > "$OUT/gpu_tests.log" 2>&1  # the whole log: a failure's message is above its tail
grep -A 12 "^E " "$OUT/gpu_tests.log" | head -40; tail -4 "$OUT/gpu_tests.log"
