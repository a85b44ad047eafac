"""Shared fixtures: tiny local models (real architectures, random weights) and one real vLLM CPU server per session.

Markers: `vllm` tests talk to a real vLLM server (deselect with `-m "not vllm"`); `gpu` tests need CUDA and are
skipped on CPU machines; `slow` tests run for more than a minute. `quick` is given here, not written on tests: every
test that is none of those, no fault-suite test, builds no tiny model (`tiny_models` and what depends on it) and is
not a tree-GDN kernel check (`tests/test_gdn*.py`: Triton interpreter, torch.compile and gradcheck runs, 1-15 min on
2 cores).
`pytest -m quick` is the tier to run before a commit (README); CI runs everything.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def pytest_configure(config):
    config.addinivalue_line("markers", "vllm: needs a real vLLM server (CPU build is enough)")
    config.addinivalue_line("markers", "gpu: needs a CUDA device")
    config.addinivalue_line("markers", "slow: takes more than a minute")
    config.addinivalue_line("markers", "faults: the fault and bad-input suite (tests/faults), against real vLLM servers")
    config.addinivalue_line("markers", "quick: given by conftest.py to every test that needs no server, no GPU and no "
                                       "tiny model and is not slow (`pytest -m quick`, the pre-commit tier)")


NOT_QUICK_MARKERS = ("vllm", "gpu", "slow", "faults")
KERNEL_CHECKS = "test_gdn"  # module prefix of the tree-GDN kernel checks


def pytest_collection_modifyitems(config, items):
    import torch

    for item in items:
        if (not any(m in item.keywords for m in NOT_QUICK_MARKERS)
                and "tiny_models" not in getattr(item, "fixturenames", ())
                and not item.path.name.startswith(KERNEL_CHECKS)):
            item.add_marker(pytest.mark.quick)
    if not torch.cuda.is_available():
        skip = pytest.mark.skip(reason="needs a CUDA device")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_models() -> dict[str, Path]:
    """Paths of the tiny qwen3, qwen3_5 and qwen3_moe checkpoints (built once, cached in REPO/.tiny)."""
    from make_tiny_model import make

    return make(REPO / ".tiny")


@pytest.fixture(scope="session")
def tiny_qwen3(tiny_models) -> Path:
    return tiny_models["qwen3"]


def start_server(model_dir: Path, tmp_dir: Path, **overrides):
    """A real vLLM CPU server for `model_dir` (fp32, small KV cache, dev mode, plugin weight transfer)."""
    from grpo.vllm_server import ServeConfig, free_port, launch

    cfg = ServeConfig(**{"model": str(model_dir), "port": free_port(), "max_model_len": 512, "dtype": "float32",
                         "cpu": True, "weight_transfer_backend": "cpu_file", **overrides})
    return launch(cfg, log_path=tmp_dir / f"vllm_{cfg.port}.log")


@pytest.fixture(scope="session")
def vllm_server(tiny_qwen3, tmp_path_factory):
    """One shared server for the tiny Qwen3. Tests must not make it fail (error-path tests start their own)."""
    server = start_server(tiny_qwen3, tmp_path_factory.mktemp("vllm"))
    yield server
    server.stop(timeout=5)


def restore_weights(server, model_dir: Path) -> None:
    """Push the checkpoint's own weights back into a server (one cpu_file sync, which also flushes its prefix cache)."""
    import torch
    import transformers as tf

    from grpo.weight_sync import WeightSync, WeightSyncConfig

    model = tf.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    sync = WeightSync(server.base_url, WeightSyncConfig(mode="cpu_file", timeout=120.0))
    try:
        sync.init(model)
        sync.sync(model, version=1)
    finally:
        sync.close()


@pytest.fixture(scope="module")
def scratch_server(vllm_server, tiny_qwen3):
    """The shared tiny-Qwen3 server lent to a module whose tests replace its weights (training runs, syncs of
    perturbed models): the checkpoint's weights go back in at the module's end, so later tests see the checkpoint
    again. Saves a server start (~25 s on 2 cores) a module."""
    yield vllm_server
    restore_weights(vllm_server, tiny_qwen3)
