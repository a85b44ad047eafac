#!/usr/bin/env bash
# CPU quick start: install, build the tiny local model (a Qwen3 with tied embeddings, like the Qwen3-0.6B/1.7B and
# SmolLM2 checkpoints users train), start a real vLLM CPU server next to it, and train the model on the built-in
# `letters` task (reward = fraction of letters in the completion; a random policy scores
# ~0.13). Logs: outputs/quickstart/ (metrics.jsonl, TensorBoard, vllm.log). Extra arguments go to train.py.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
PY=.venv/bin/python
OUT=${OUT:-outputs/quickstart}
PORT=${PORT:-8011}
mkdir -p "$OUT"
MODEL=.tiny/qwen3_tied
$PY scripts/make_tiny_model.py --out .tiny --kinds qwen3_tied
setsid $PY rollout.py serve --server.model "$MODEL" --server.cpu --server.port "$PORT" --server.max-model-len 512 \
  --server.dtype float32 --server.weight-transfer-backend cpu_file >"$OUT/vllm.log" 2>&1 &
SERVER=$!
trap 'kill -TERM -- -$SERVER 2>/dev/null || kill $SERVER 2>/dev/null || true' EXIT
echo "[quickstart] vLLM server starting (pid $SERVER, log $OUT/vllm.log)"
for _ in $(seq 240); do
  curl -sf "http://127.0.0.1:$PORT/health" >/dev/null && break
  kill -0 $SERVER 2>/dev/null || { tail -40 "$OUT/vllm.log"; echo "server died"; exit 1; }
  sleep 1
done
$PY train.py --model "$MODEL" --dataset builtin:letters --reward-funcs letters \
  --vllm-server-base-url "http://127.0.0.1:$PORT" --num-generations 16 --max-completion-length 12 \
  --learning-rate 1e-3 --max-steps 80 --save-steps 40 --output-dir "$OUT" "$@"
$PY scripts/summarize_run.py "$OUT/metrics.jsonl"
