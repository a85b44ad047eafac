#!/usr/bin/env bash
# The whole loop on ONE GPU against a real vLLM server, in one device call (README "One GPU").
#   MODEL=Qwen/Qwen3-0.6B bash scripts/gpu_e2e.sh   # a GPU machine with vllm installed
#   bash scripts/gpu_e2e.sh       # the offline device machine: vLLM bundle in .gpuvllm/, wheels in .whl/
# Builds a random-weight Qwen3-0.6B-shaped model, serves it on 127.0.0.1 (30 % of the GPU) with vLLM's CUDA-IPC
# weight-transfer engine, and per workload trains train.py against it twice back to back -- async (max_staleness
# 4) and synchronous (max_staleness 0) -- checking each run from outside (scripts/gpu_e2e_check.py: the server's
# logprobs equal the final checkpoint's), then measures generation and training alone and together
# (scripts/gpu_overlap.py), and prints the report: steady-state step times (warm-up steps apart), weight-sync
# seconds, S = sync/async step, G, T, G_c, T_c, L, L_c, and the acceptance targets.
# Knobs (env):
#   MPS=off|shared|split   CUDA MPS daemon for server + trainers (split: CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=50 each);
#                          started here (root), stopped at exit
#   WORKLOADS="fixed"      any of: fixed (every completion MAXLEN tokens), longtail (10 % to MAXLEN, the rest short)
#   TRAIN=1 BENCH=1        the async+sync runs / the overlap bench, per workload (BENCH="fixed": that workload only;
#                          TRAIN likewise)
#   STEPS=20 MAXLEN=384 TOKEN_BUDGET=16384 GRAD_ACCUM=2 WARMUP=3 (steps left out of the steady state)
#   WEIGHT_TRANSFER=ipc    or cpu_file (the previous one-GPU path: safetensors through /dev/shm), auto
#   IPC_BACKEND=ipc_inplace  the server's backend for ipc: vLLM's receiver without its layerwise reload
#                          (grpo/vllm_ipc_inplace.py, unquantized models; 0.04 s a sync's update on the 0.6B shape),
#                          or ipc: vLLM's own (0.14-0.15 s there; quantized models)
#   GPU_UTIL=0.3           the server's --gpu-memory-utilization
#   API_SERVERS=8          the server's API server processes, as `rollout.py serve` starts them (one process: async
#                          pauses of 0.24 s mean, up to 4 s; eight: 0.03-0.04 s). Only `vllm serve`, the CLI, spawns
#                          several: with the bundle, >1 starts it through vllm.entrypoints.cli.main
#   AFTER_PORT=8000        start this server only once the server on that port is healthy (two runs on one GPU:
#                          vLLM aborts when free memory changes while it sizes its KV cache)
#   GPU_TESTS=1            also `pytest -m gpu tests/test_gpu_ipc.py` against the server (needs pytest there;
#                          GRPO_IPC_SYNCS, GRPO_IPC_BUCKET_MB: its syncs and bucket size). Side by side, in one call:
#                          for B in ipc ipc_inplace; do OUT=$OUT/$B IPC_BACKEND=$B GPU_TESTS=1 TRAIN=0 BENCH=0 \
#                            GRPO_IPC_SYNCS=20 GRPO_IPC_BUCKET_MB=2048 bash scripts/gpu_e2e.sh; done
#   CHECK_TREE=1 SERVER_BENCH=1 THEN_BENCH="..." TRAIN_FLAGS="..." SERVE_FLAGS="..." (as before)
#   EXTRA_SITE=/tmp/site_fla  a folder put first on the trainer's and the checks' PYTHONPATH (not the server's):
#                          e.g. fla-core, to run the loop with it installed
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-outputs/gpu_e2e}; mkdir -p "$OUT"
RUNS=${RUNS:-/tmp/gpu_e2e_runs}; rm -rf "$RUNS"; mkdir -p "$RUNS"  # checkpoints stay here; metrics are copied to OUT
STEPS=${STEPS:-20}; PORT=${PORT:-8000}; MAXLEN=${MAXLEN:-384}; TOKEN_BUDGET=${TOKEN_BUDGET:-16384}
GRAD_ACCUM=${GRAD_ACCUM:-2}; WARMUP=${WARMUP:-3}; WORKLOADS=${WORKLOADS:-fixed}; MPS=${MPS:-off}
API_SERVERS=${API_SERVERS:-8}
WEIGHT_TRANSFER=${WEIGHT_TRANSFER:-ipc}; export GPUVLLM_GPU_UTIL=${GPU_UTIL:-${GPUVLLM_GPU_UTIL:-0.3}}
T_START=$SECONDS

cleanup() {
  declare -F vllm_stop >/dev/null && vllm_stop "$PORT"
  if [ -n "${MPS_STARTED:-}" ]; then echo quit | nvidia-cuda-mps-control && echo "MPS daemon stopped"; fi
  declare -F save_autotune_results >/dev/null && save_autotune_results
  echo "total $((SECONDS - T_START)) s"
}
trap cleanup EXIT
case $MPS in
  off) ;;
  shared|split)  # the daemon and every client (server, trainers) must agree on these two directories
    export CUDA_MPS_PIPE_DIRECTORY=${CUDA_MPS_PIPE_DIRECTORY:-/tmp/mps_pipe} CUDA_MPS_LOG_DIRECTORY=${CUDA_MPS_LOG_DIRECTORY:-/tmp/mps_log}
    mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
    nvidia-cuda-mps-control -d || { echo "MPS daemon did not start (needs root and nvidia-cuda-mps-control)"; exit 1; }
    MPS_STARTED=1; echo "MPS daemon started ($MPS)"
    [ "$MPS" = split ] && export CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=50 ;;
  *) echo "MPS must be off, shared or split (got $MPS)"; exit 2 ;;
esac

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
  if [ "$API_SERVERS" -gt 1 ]; then  # the bundle's vllm_serve runs the one-process api_server module
    vllm_serve() { local model=$1 port=$2; shift 2
      date +%s.%N > "$GPUVLLM_RUN_DIR/vllm_$port.start"
      python3 -m vllm.entrypoints.cli.main serve "$model" --port "$port" --host 127.0.0.1 --dtype bfloat16 \
        --gpu-memory-utilization "$GPUVLLM_GPU_UTIL" --max-model-len "${GPUVLLM_MAX_LEN:-2048}" \
        --attention-backend "${GPUVLLM_ATTN:-TRITON_ATTN}" --api-server-count "$API_SERVERS" "$@" \
        > "$GPUVLLM_LOG_DIR/vllm_$port.log" 2>&1 &
      echo $! > "$GPUVLLM_RUN_DIR/vllm_$port.pid"; echo "vllm pid $! on port $port, $API_SERVERS API servers"; }
  fi
  # vLLM 0.26's ipc_engine.py imports ray at the top, for its trainer-side ray send mode only (the bundle has no
  # ray). The server side never calls it: a placeholder module lets the engine load.
  if ! python3 -c "import ray" 2>/dev/null; then
    mkdir -p /tmp/site/ray
    printf '%s\n' '"""Placeholder: vLLM 0.26 ipc_engine imports ray at module level; only its ray send mode uses it."""' \
      'def is_initialized():' '    return False' > /tmp/site/ray/__init__.py
  fi
else  # a machine with `pip install -r requirements.txt && pip install -e .` done: vllm on PATH, plugin registered
  vllm_serve() { local m=$1 p=$2; shift 2; VLLM_SERVER_DEV_MODE=1 vllm serve "$m" --port "$p" --host 127.0.0.1 \
      --dtype bfloat16 --gpu-memory-utilization "$GPUVLLM_GPU_UTIL" --max-model-len 2048 \
      --api-server-count "$API_SERVERS" "$@" > "$OUT/vllm_$p.log" 2>&1 &
    echo $! > "$OUT/vllm_$p.pid"; }
  vllm_wait() { for _ in $(seq "$2"); do curl -sf "http://127.0.0.1:$1/health" >/dev/null && return 0; sleep 1; done
    tail -40 "$OUT/vllm_$1.log"; return 1; }
  vllm_stop() { kill "$(cat "$OUT/vllm_$1.pid")" 2>/dev/null; }
fi
export PYTHONPATH="$PWD:$PWD/scripts:${PYTHONPATH:-}" TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1  # logs land as written: a call cut short keeps them
source scripts/kernel_cache.sh  # kernel caches in .kernel-cache; autotune results packed into $OUT at exit
TRAINER_PATH=${EXTRA_SITE:+$EXTRA_SITE:}$PYTHONPATH  # the trainer's and the checks' path (not the server's)
MODEL=${MODEL:-}; MODELS=${MODELS:-/tmp/models}  # where random-weight models are built (one per concurrent run)
KIND=${KIND:-qwen3-0.6b}  # or qwen3.5-tiny, qwen3.5-2b (SERVE_FLAGS="--language-model-only --enforce-eager")
if [ -z "$MODEL" ] && [ -f .gpuvllm/make_models.py ]; then  # random weights at a public shape, Qwen-style tokenizer
  SMALL=$KIND; [ "$KIND" = qwen3.5-2b ] && SMALL=qwen3.5-tiny  # its tokenizer and config, at the 2B widths
  python3 .gpuvllm/make_models.py "$MODELS" "$SMALL" --device cuda > "$OUT/make_models.log" 2>&1 \
    || { tail "$OUT/make_models.log"; exit 1; }
  if [ "$KIND" = qwen3.5-2b ]; then
    python3 scripts/make_served_model.py Qwen3.5-2B "$MODELS/qwen3.5-2b" --like "$MODELS/qwen3.5-tiny" \
      2>&1 | tail -1 | tee -a "$OUT/make_models.log" || exit 1
  fi
  MODEL=$MODELS/$KIND
fi
[ -n "$MODEL" ] || { echo "set MODEL=<local model dir or hub id> (e.g. MODEL=Qwen/Qwen3-0.6B)"; exit 2; }

BACKEND=${IPC_BACKEND:-ipc_inplace}; [ "$WEIGHT_TRANSFER" = cpu_file ] && BACKEND=cpu_file
# ipc: the server unpickles the trainer's CUDA-IPC handles, so it gets the switch and listens on 127.0.0.1 only
[ "$BACKEND" != cpu_file ] && export VLLM_ALLOW_INSECURE_SERIALIZATION=1
if [ -n "${AFTER_PORT:-}" ]; then
  for _ in $(seq 600); do python3 -c "import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=2)" \
    "http://127.0.0.1:$AFTER_PORT/health" 2>/dev/null && break; sleep 1; done
  echo "server on port $AFTER_PORT healthy: starting this one"
fi
GPUVLLM_LOG_DIR=$OUT vllm_serve "$MODEL" "$PORT" --logprobs-mode processed_logprobs \
  --weight-transfer-config "{\"backend\": \"$BACKEND\"}" --max-logprobs 20 ${SERVE_FLAGS:-}
unset VLLM_ALLOW_INSECURE_SERIALIZATION
T_SERVE=$SECONDS
vllm_wait "$PORT" "${SERVER_WAIT_S:-300}" || exit 1
echo "server healthy after $((SECONDS - T_SERVE)) s"
URL="http://127.0.0.1:$PORT"

# What `--weight-transfer auto` decides for this server, and why (the runs below pass WEIGHT_TRANSFER explicitly)
python3 - "$URL" <<'PY' 2>&1 | grep -v Warning | tee "$OUT/transfer_choice.log"
import sys
from grpo.ipc_transfer import choose_transfer, device_uuid, nvml_uuids, server_view, trainer_visible_device
from grpo.vllm_client import VLLMControl
control = VLLMControl(sys.argv[1], timeout=60)
try:
    version = control.version()
except Exception as exc:
    version = f"unknown ({exc})"
view = server_view(sys.argv[1], control.server_info(), control.world_size(), device_uuid(0), trainer_visible_device(0),
                   nvml_uuids())
print(f"vLLM {version}; backend {view.backend}; same GPU as this process: {view.same_gpu} ({view.detail})")
try:
    choice = choose_transfer("auto", True, [view])
    print(f"auto would choose: {choice.mode} ({choice.reason})")
except ValueError as exc:
    print(f"auto refuses: {exc}")
PY
printf '{"mps": "%s", "weight_transfer": "%s", "server_backend": "'"$BACKEND"'", "api_servers": '"$API_SERVERS"', "gpu_util": %s, "max_len": %s, "token_budget": %s, "grad_accum": %s, "steps": %s}\n' \
  "$MPS" "$WEIGHT_TRANSFER" "$GPUVLLM_GPU_UTIL" "$MAXLEN" "$TOKEN_BUDGET" "$GRAD_ACCUM" "$STEPS" > "$OUT/setup.json"

if [ -n "${CHECK_TREE:-}" ]; then  # the server's logprobs vs the trainer's tree-packed forward, initial weights
  PYTHONPATH=$TRAINER_PATH python3 scripts/gpu_e2e_check.py --server "$URL" --initial "$MODEL" --tree 2>&1 \
    | grep --line-buffered -v "Loading\|Writing" | tee "$OUT/check_tree.log" | tail -4
fi
if [ -n "${SERVER_BENCH:-}" ] && [ -f .gpuvllm/bench.py ]; then
  python3 .gpuvllm/bench.py "$PORT" --out "$OUT/server_bench.json" > "$OUT/server_bench.log" 2>&1; tail -3 "$OUT/server_bench.log"
fi
if [ -n "${GPU_TESTS:-}" ]; then  # before the runs: its syncs overwrite the served weights, every run's cold sync too
  if python3 -c "import pytest" 2>/dev/null; then
    GRPO_IPC_VLLM_URL=$URL GRPO_IPC_VLLM_MODEL=$MODEL timeout 300 python3 -m pytest -q -s -m gpu -p no:cacheprovider \
      tests/test_gpu_ipc.py 2>&1 | tee "$OUT/gpu_tests.log" | grep -E "RESULT|passed|failed|skipped|Error" | tail -6
  else
    echo "GPU_TESTS: pytest is not installed here (add its wheel to .whl/)"
  fi
fi

run() {  # run WORKLOAD NAME MAX_STALENESS
  local t0=$SECONDS dir=$RUNS/$1/$2 loop=()
  [ "$1" = longtail ] && loop=(--loop-cls gpu_overlap:LongTailLoop)
  mkdir -p "$OUT/$1/$2" "$dir"  # the metrics as they are written, for an archiver that follows links (tar -h)
  ln -sf "$dir/metrics.jsonl" "$OUT/$1/$2/metrics.jsonl"
  PYTHONPATH=$TRAINER_PATH timeout "${RUN_TIMEOUT_S:-300}" python3 train.py --model "$MODEL" --dataset builtin:letters --reward-funcs letters \
    --vllm-server-base-url "$URL" --weight-transfer "$WEIGHT_TRANSFER" --num-generations 8 \
    --max-completion-length "$MAXLEN" --token-budget "$TOKEN_BUDGET" --gradient-accumulation-steps "$GRAD_ACCUM" \
    --learning-rate 5e-5 --max-steps "$STEPS" --save-steps "$STEPS" --max-staleness "$3" --output-dir "$dir" \
    "${loop[@]}" ${TRAIN_FLAGS:-} > "$OUT/$1/$2.log" 2>&1
  local rc=$?
  echo "{\"wall_s\": $((SECONDS - t0)), \"rc\": $rc}" > "$dir/wall.json"
  rm -f "$OUT/$1/$2/metrics.jsonl"; cp "$dir/wall.json" "$dir/metrics.jsonl" "$OUT/$1/$2/" 2>/dev/null
  grep -m1 "weight transfer:" "$OUT/$1/$2.log"
  echo "run $1/$2 (max_staleness $3): rc $rc in $((SECONDS - t0)) s"; [ $rc -eq 0 ] || tail -30 "$OUT/$1/$2.log"
  return $rc
}
check() {  # check WORKLOAD NAME MAX_STALENESS [--compare-with RUN]: right after the run, while the server holds its weights
  PYTHONPATH=$TRAINER_PATH python3 scripts/gpu_e2e_check.py --server "$URL" --initial "$MODEL" --run "$RUNS/$1/$2" --max-staleness "$3" \
    --steps "$STEPS" "${@:4}" 2>&1 | grep --line-buffered -v "Loading\|Writing" | tee "$OUT/$1/check_$2.log"
}
for W in $WORKLOADS; do
  mkdir -p "$OUT/$W"
  if [ "${TRAIN:-1}" = 1 ] || [[ " ${TRAIN:-} " == *" $W "* ]]; then
    run "$W" async 4 && check "$W" async 4
    [ -n "${ASYNC_ONLY:-}" ] || { run "$W" sync 0 && check "$W" sync 0 --compare-with "$RUNS/$W/async"; }
  fi
  if [ "${BENCH:-1}" = 1 ] || [[ " ${BENCH:-} " == *" $W "* ]]; then
    timeout "${BENCH_TIMEOUT_S:-240}" python3 scripts/gpu_overlap.py --server "$URL" --model "$MODEL" --workload "$W" \
      --max-len "$MAXLEN" --token-budget "$TOKEN_BUDGET" --grad-accum "$GRAD_ACCUM" --in-flight 4 \
      --reps "${BENCH_REPS:-4}" --warmup "${BENCH_WARMUP:-2}" --json "$OUT/$W/overlap.json" > "$OUT/$W/overlap.log" 2>&1
    grep "^OVERLAP" "$OUT/$W/overlap.log" || tail -20 "$OUT/$W/overlap.log"
  fi
done
python3 scripts/gpu_e2e_check.py --report "$OUT" --warmup "$WARMUP" | tee "$OUT/report.txt"
vllm_stop "$PORT"
if [ -n "${THEN_BENCH:-}" ]; then  # the trainer step alone, once the server has released the GPU
  timeout 120 python3 scripts/bench_step.py $THEN_BENCH 2>&1 | grep -v "^RESULT\|Loading" | tee "$OUT/bench.log" | tail -8
fi
