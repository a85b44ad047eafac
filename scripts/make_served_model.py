"""A random-weight model at a public shape that a vLLM server can serve: the widths of `bench_step.SHAPES[shape]`
grafted onto the config of a small model directory of the same family (`--like`), whose tokenizer, chat template,
processor and generation config files are copied beside it. The GPU end-to-end run uses it to serve and train the
Qwen3.5-2B shape with no Hub access.

    python scripts/make_served_model.py Qwen3.5-2B /tmp/models/qwen3.5-2b --like /tmp/models/qwen3.5-tiny
"""

from __future__ import annotations

import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_step import SHAPES  # noqa: E402

_WEIGHT_FILES = ("config.json", "model.safetensors", "model.safetensors.index.json")


def grafted_config(shape: str, like: Path):
    """`like`'s config (token ids, rope, vision tower) with the text widths of `shape`."""
    import transformers as tf

    cfg = tf.AutoConfig.from_pretrained(like)
    widths = dict(SHAPES[shape][1])
    data = cfg.to_dict()
    if "text_config" in data:  # a VLM (Qwen3.5): widths go to the language model, the vision tower projects to it
        data["text_config"].update(widths)
        data["vision_config"]["out_hidden_size"] = widths["hidden_size"]
        data["tie_word_embeddings"] = widths["tie_word_embeddings"]
    else:
        data.update(widths)
    return type(cfg).from_dict(data)


def make(shape: str, out: Path, like: Path, device: str | None = None) -> Path:
    import torch
    import transformers as tf

    if (out / "config.json").exists():
        return out
    t0 = time.time()
    cfg = grafted_config(shape, like)
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    with torch.device(device):
        model = getattr(tf, cfg.architectures[0])(cfg).to(torch.bfloat16)
    model.save_pretrained(out)
    for path in like.iterdir():
        if path.is_file() and path.name not in _WEIGHT_FILES and not path.name.startswith("model-"):
            shutil.copy(path, out / path.name)
    params = sum(p.numel() for p in model.parameters())
    print(f"{shape}: {params / 1e9:.2f} B parameters -> {out} in {time.time() - t0:.0f} s", flush=True)
    return out


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("shape", choices=sorted(SHAPES))
    parser.add_argument("out", type=Path)
    parser.add_argument("--like", type=Path, required=True, help="a model directory of the same family")
    parser.add_argument("--device", default=None)
    args = parser.parse_args()
    make(args.shape, args.out, args.like, args.device)
