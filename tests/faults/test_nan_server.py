"""A server that was sent NaN weights: its 400 is named (NaN/inf logprobs, restart), and once clean weights are
synced a run against it trains (the stale NaN KV-cache blocks that still fail some requests are retried)."""

from __future__ import annotations

import asyncio

import pytest

from conftest import start_server

from .harness import named_error
from .test_run_faults import records, run, train_cmd


def nan_then_clean_sync(base_url: str, model_dir, nan: bool) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    from grpo.weight_sync import WeightSync, WeightSyncConfig

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    sync = WeightSync([base_url], WeightSyncConfig(mode="cpu_file", timeout=120))
    sync.init(model)
    if nan:
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(float("nan"))
    sync.sync(model, 2 if nan else 3)
    sync.close()


def generate_once(base_url: str, model_dir) -> None:
    from grpo.vllm_client import VLLMClient

    async def go():
        client = VLLMClient(base_url, str(model_dir), timeout=60, max_retries=1)
        await client.generate(list(range(5, 45)), max_tokens=8, num_logprobs=1)

    asyncio.run(go())


@pytest.mark.vllm
def test_nan_weights_on_the_server_are_named_and_a_clean_sync_recovers(tiny_qwen3, tmp_path):
    """debefe5: `400 … Out of range float values are not JSON compliant` named nothing, was never retried, and
    ended the next valid runs against the same server (which still failed some requests after clean weights)."""
    server = start_server(tiny_qwen3, tmp_path)  # its own: the NaN blocks it keeps must not reach other tests
    try:
        nan_then_clean_sync(server.base_url, tiny_qwen3, nan=True)
        named_error(120, generate_once, "nan/inf logprobs", "restart", base_url=server.base_url,
                    model_dir=tiny_qwen3)
        nan_then_clean_sync(server.base_url, tiny_qwen3, nan=False)
        out = tmp_path / "run"
        result = run(train_cmd(server.base_url, out, "--max-steps", "4"), timeout=400)
        assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
        assert records(out, "metrics.jsonl")[-1]["step"] == 4
    finally:
        server.stop()
