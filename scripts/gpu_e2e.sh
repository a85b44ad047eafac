#!/usr/bin/env bash
# The whole loop on ONE GPU against a real vLLM server, in one device call (see README "GPU end to end").
#   MODEL=Qwen/Qwen3-0.6B bash scripts/gpu_e2e.sh   # a GPU machine with vllm installed
#   bash scripts/gpu_e2e.sh       # the offline device machine: vLLM bundle in .gpuvllm/, wheels in .whl/
# Builds a random-weight Qwen3-0.6B-shaped model, serves it (30 % of the GPU), trains train.py against it
# twice -- async (max_staleness 4) and synchronous (max_staleness 0) -- and checks the result from outside
# (scripts/gpu_e2e_check.py). Weight sync on one GPU uses this project's `cpu_file` backend (a safetensors file in
# /dev/shm, through vLLM's own pause/start/update/finish/resume routes): NCCL refuses two ranks on one device.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-outputs/gpu_e2e}; mkdir -p "$OUT"
STEPS=${STEPS:-20}; PORT=${PORT:-8000}
if [ -f .gpuvllm/device_serve.sh ]; then
  # An offline machine: vLLM comes as an unpacked bundle (vllm_serve / vllm_wait / vllm_stop come from it), extra
  # wheels from .whl/, and the project's vLLM plugin entry point is declared by hand for the bundle's site dir.
  . .gpuvllm/device_serve.sh || exit 1
  if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
  fi
  mkdir -p /tmp/site/async_grpo-0.1.0.dist-info
  printf 'Metadata-Version: 2.1\nName: async-grpo\nVersion: 0.1.0\n' > /tmp/site/async_grpo-0.1.0.dist-info/METADATA
  printf '[vllm.general_plugins]\ngrpo_cpu_weight_transfer = grpo.vllm_plugin:register\n' \
    > /tmp/site/async_grpo-0.1.0.dist-info/entry_points.txt
else  # a machine with `pip install -r requirements.txt && pip install -e .` done: vllm on PATH, plugin registered
  vllm_serve() { local m=$1 p=$2; shift 2; VLLM_SERVER_DEV_MODE=1 vllm serve "$m" --port "$p" --host 127.0.0.1 \
      --dtype bfloat16 --gpu-memory-utilization 0.3 --max-model-len 2048 "$@" > "$OUT/vllm_$p.log" 2>&1 &
    echo $! > "$OUT/vllm_$p.pid"; }
  vllm_wait() { for _ in $(seq "$2"); do curl -sf "http://127.0.0.1:$1/health" >/dev/null && return 0; sleep 1; done
    tail -40 "$OUT/vllm_$1.log"; return 1; }
  vllm_stop() { kill "$(cat "$OUT/vllm_$1.pid")" 2>/dev/null; }
fi
export PYTHONPATH="$PWD:${PYTHONPATH:-}" TOKENIZERS_PARALLELISM=false
MODEL=${MODEL:-}
KIND=${KIND:-qwen3-0.6b}  # or qwen3.5-tiny (SERVE_FLAGS="--language-model-only --enforce-eager")
if [ -z "$MODEL" ] && [ -f .gpuvllm/make_models.py ]; then  # random weights at a public shape, Qwen-style tokenizer
  python3 .gpuvllm/make_models.py /tmp/models "$KIND" --device cuda > "$OUT/make_models.log" 2>&1 \
    || { tail "$OUT/make_models.log"; exit 1; }
  MODEL=/tmp/models/$KIND
fi
[ -n "$MODEL" ] || { echo "set MODEL=<local model dir or hub id> (e.g. MODEL=Qwen/Qwen3-0.6B)"; exit 2; }
GPUVLLM_LOG_DIR=$OUT vllm_serve "$MODEL" "$PORT" --logprobs-mode processed_logprobs \
  --weight-transfer-config '{"backend": "cpu_file"}' --max-logprobs 20 ${SERVE_FLAGS:-}
T_SERVE=$SECONDS
vllm_wait "$PORT" "${SERVER_WAIT_S:-300}" || exit 1
echo "server healthy after $((SECONDS - T_SERVE)) s"
if [ -n "${CHECK_TREE:-}" ]; then  # the server's logprobs vs the trainer's tree-packed forward, initial weights
  python3 scripts/gpu_e2e_check.py --server "http://127.0.0.1:$PORT" --initial "$MODEL" --tree 2>&1 \
    | grep -v "Loading\|Writing" | tee "$OUT/check_tree.log" | tail -4
fi
[ -f .gpuvllm/bench.py ] && { python3 .gpuvllm/bench.py "$PORT" --out "$OUT/server_bench.json" > "$OUT/server_bench.log" 2>&1; tail -3 "$OUT/server_bench.log"; }
run() {  # run NAME MAX_STALENESS
  local t0=$SECONDS
  timeout "${RUN_TIMEOUT_S:-200}" python3 train.py --model "$MODEL" --dataset builtin:letters --reward-funcs letters \
    --vllm-server-base-url "http://127.0.0.1:$PORT" --weight-transfer cpu_file --num-generations 8 \
    --max-completion-length "${MAXLEN:-128}" --learning-rate 5e-5 --max-steps "$STEPS" --save-steps "$STEPS" \
    --max-staleness "$2" --output-dir "$OUT/$1" ${TRAIN_FLAGS:-} > "$OUT/$1.log" 2>&1
  local rc=$?
  echo "{\"wall_s\": $((SECONDS - t0)), \"rc\": $rc}" > "$OUT/$1/wall.json"
  echo "run $1 (max_staleness $2): rc $rc in $((SECONDS - t0)) s"; [ $rc -eq 0 ] || tail -30 "$OUT/$1.log"
}
check() {  # check NAME MAX_STALENESS [--compare RUN]: right after the run, while the server holds its weights
  python3 scripts/gpu_e2e_check.py --server "http://127.0.0.1:$PORT" --initial "$MODEL" --run "$OUT/$1" \
    --max-staleness "$2" --steps "$STEPS" "${@:3}" | tee "$OUT/check_$1.log"
}
run e2e_async 4 && check e2e_async 4
[ -n "${ASYNC_ONLY:-}" ] || { run e2e_sync 0 && check e2e_sync 0 --compare-with "$OUT/e2e_async"; }
vllm_stop "$PORT"
if [ -n "${THEN_BENCH:-}" ]; then  # the trainer step alone, once the server has released the GPU
  timeout 120 python3 scripts/bench_step.py $THEN_BENCH 2>&1 | grep -v "^RESULT\|Loading" | tee "$OUT/bench.log" | tail -8
fi
