#!/usr/bin/env bash
# One device call for Qwen3.5 on a GPU (docs/results.md, 2026-12-02 GPU entry): the GDN kernels alone (scripts/bench_gdn.py),
# the GPU tests and the real trainer step (scripts/bench_step.py, Qwen3.5-2B shape, tree and plain), first WITHOUT
# fla-core, then WITH it (FLA_WHEELS: a folder of wheels with fla-core; FLA refuses its gated backward on Triton
# >= 3.4, < 3.7.1 on Hopper, so there the step runs FLA's backward with its chunk_bwd_dqkwg step in torch,
# grpo/kernels/gdn_dqkwg.py, if that passes its check against the torch kernel, else the torch backward; never a crash).
#   bash scripts/gpu_qwen35_call.sh        # logs and JSON under $OUT
# Knobs (env): TEST_PATHS="tests/test_gpu_step.py" (pytest -m gpu paths)  FLA_GDN=1 (bench_gdn in the fla phase too)  TESTS=0 (skip pytest -m gpu)  CONV=1 (bench_gdn --conv)  FLA_WHEELS=.whlfla  PHASES="nofla fla"  STEPS=3  RATIOS="3.4 1"  GDN_VARIANTS="torch torch-compiled"
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
source scripts/kernel_cache.sh  # kernel caches in .kernel-cache; autotune results packed into $OUT at exit
trap save_autotune_results EXIT
if ls .whl/*.whl >/dev/null 2>&1; then  # an offline machine: tyro & co. as carried wheels
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || exit 1
fi
BASE_PATH=/tmp/site:$PWD:$PWD/scripts
nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, \
'transformers', transformers.__version__)" | tee -a "$OUT/gpu.txt"
STEPS=${STEPS:-3}; RATIOS=${RATIOS:-3.4 1}
for PHASE in ${PHASES:-nofla fla}; do
  export PYTHONPATH=$BASE_PATH
  if [ "$PHASE" = fla ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site_fla \
      "${FLA_WHEELS:-.whlfla}"/*.whl || { echo "no fla-core wheel in ${FLA_WHEELS:-.whlfla}"; exit 1; }
    export PYTHONPATH=/tmp/site_fla:$BASE_PATH
    python3 -c "import fla; print('fla', fla.__version__)"
  fi
  if [ "$PHASE" = nofla ] || [ -n "${FLA_GDN:-}" ]; then
  echo "== $PHASE: bench_gdn"
  timeout "${T_GDN:-150}" python3 scripts/bench_gdn.py --variants ${GDN_VARIANTS:-torch torch-compiled} \
    $([ "$PHASE" = fla ] && echo fla fla-own fla-one-pass) $([ -n "${CONV:-}" ] && echo --conv) --compile --json "$OUT/gdn_$PHASE.json" 2>&1 | tee "$OUT/gdn_$PHASE.log" | tail -12
  fi
  if [ "${TESTS:-1}" != 0 ]; then
  echo "== $PHASE: pytest -m gpu"
  timeout "${T_TESTS:-150}" python3 -m pytest -q -m gpu -p no:cacheprovider ${TEST_PATHS:-tests/test_gpu_step.py} 2>&1 \
    | tee "$OUT/tests_$PHASE.log" | tail -6
  fi
  echo "== $PHASE: bench_step Qwen3.5-2B"
  timeout "${T_STEP:-200}" python3 scripts/bench_step.py --shape Qwen3.5-2B --check --ratio $RATIOS --modes tree plain \
    --steps "$STEPS" --warmup 2 ${STEP_FLAGS:-} --json "$OUT/step_$PHASE.json" 2>&1 \
    | grep -v "^RESULT\|Loading\|Writing" | tee "$OUT/step_$PHASE.log" | grep -v "^ \|^PROFILE\|Self " | tail -14
done
