#!/usr/bin/env bash
# Two hosts without a scheduler, 8 GPUs each. Each host runs a vLLM server on GPUs 0-3 and one trainer node on
# GPUs 4-7; the two trainer nodes meet at a c10d rendezvous on host A and train with HSDP (2 replicas x 4 shards:
# parameters sharded inside a host, gradients all-reduced across hosts). Global rank 0 (host A) runs the rollout
# worker against both servers and pushes every weight version to both.
#
#   host A:  HOST_A=10.0.0.1 HOST_B=10.0.0.2 OUTPUT_DIR=/nfs/run1 bash scripts/two_hosts.sh a
#   host B:  HOST_A=10.0.0.1 HOST_B=10.0.0.2 OUTPUT_DIR=/nfs/run1 bash scripts/two_hosts.sh b
#   DRY_RUN=1 HOST_A=... HOST_B=... bash scripts/two_hosts.sh a     # print this host's commands, run nothing
#
# Commands per host (what the script runs; DRY_RUN=1 prints them with the values filled in):
#   CUDA_VISIBLE_DEVICES=0,1,2,3 python rollout.py serve --server.model $MODEL --server.host 0.0.0.0 ...
#   CUDA_VISIBLE_DEVICES=4,5,6,7 python -m torch.distributed.run --nnodes 2 --nproc-per-node 4 \
#       --rdzv-backend c10d --rdzv-endpoint $HOST_A:29500 --rdzv-id $RUN_ID train.py --model $MODEL \
#       --vllm-server-base-url http://$HOST_A:8000 http://$HOST_B:8000 --hsdp-replicas auto --output-dir $OUTPUT_DIR
#
# A RECIPE: verified here only as 2 "hosts" on one CPU machine (docs/results.md says what ran where);
# tests/test_launch_recipes.py checks that the commands it builds parse with rollout.py's and train.py's CLIs.
# OUTPUT_DIR must be one filesystem both hosts mount at the same path (NFS, ...): rank 0 writes the checkpoints,
# every rank reads them on resume; the trainer checks this at start and fails naming the host that cannot see it.
set -euo pipefail
ROLE=${1:?usage: bash scripts/two_hosts.sh a|b   (a = the host of HOST_A, b = HOST_B)}
: "${HOST_A:?set HOST_A (address of host a, reachable from host b)}" "${HOST_B:?set HOST_B}"
MODEL=${MODEL:-Qwen/Qwen3.5-2B}
OUTPUT_DIR=${OUTPUT_DIR:-$PWD/outputs/two_hosts}
RUN_ID=${RUN_ID:-grpo-two-hosts}
VLLM_PORT=${VLLM_PORT:-8000}
RDZV_PORT=${RDZV_PORT:-29500}
SERVER_GPUS=${SERVER_GPUS:-0,1,2,3}
TRAINER_GPUS=${TRAINER_GPUS:-4,5,6,7}
TRAIN_ARGS=${TRAIN_ARGS:-}
DRY_RUN=${DRY_RUN:-0}
PYTHON=${PYTHON:-python}
cd "$(dirname "$0")/.."
case "$ROLE" in a) HOST=$HOST_A ;; b) HOST=$HOST_B ;; *) echo "role must be a or b, got $ROLE" >&2; exit 2 ;; esac

run() {  # DRY_RUN=1 prints the command (shell-quoted, one line) instead of running it
  if [ "$DRY_RUN" = 1 ]; then printf '%q ' "$@"; echo; else "$@"; fi
}

n_server_gpus=$(awk -F, '{print NF}' <<< "$SERVER_GPUS")
n_trainer_gpus=$(awk -F, '{print NF}' <<< "$TRAINER_GPUS")
serve=(env CUDA_VISIBLE_DEVICES="$SERVER_GPUS" "$PYTHON" rollout.py serve --server.model "$MODEL" --server.host 0.0.0.0
       --server.port "$VLLM_PORT" --server.dtype float32 --server.extra-args=--data-parallel-size="$n_server_gpus")
if [ "$DRY_RUN" = 1 ]; then
  run "${serve[@]}"
else
  mkdir -p "$OUTPUT_DIR"
  "${serve[@]}" > "$OUTPUT_DIR/vllm_$HOST.log" 2>&1 &
  server=$!
  trap 'kill $server 2>/dev/null || true' EXIT  # the server stops with this script
fi
# train.py waits for both servers to be ready (--vllm-server-timeout) before its cold weight sync
# shellcheck disable=SC2086  # TRAIN_ARGS is split into flags on purpose
run env CUDA_VISIBLE_DEVICES="$TRAINER_GPUS" "$PYTHON" -m torch.distributed.run --nnodes 2 \
  --nproc-per-node "$n_trainer_gpus" --rdzv-backend c10d --rdzv-endpoint "$HOST_A:$RDZV_PORT" --rdzv-id "$RUN_ID" \
  train.py --model "$MODEL" --vllm-server-base-url "http://$HOST_A:$VLLM_PORT" "http://$HOST_B:$VLLM_PORT" \
  --hsdp-replicas auto --output-dir "$OUTPUT_DIR" $TRAIN_ARGS
