"""PEFT/LoRA end to end: the packed forward through a PEFT model, the adapter files, checkpoints that keep the
adapter, the start-up checks, and against one real `--enable-lora` vLLM CPU server: adapter sync (server logprobs
== the trainer's PEFT model), a rollout finishing under the version it started with, pruning of old versions,
merged sync, and the spec's LoRA example through the Python API."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys

import httpx
import pytest
import torch

from conftest import REPO, start_server
from grpo.lora import (AdapterVersions, LoraServerError, adapter_tensors, check_lora_server, choose_sync_mode,
                       packed_forward_module, server_lora_facts, wrap_policy)
from grpo.weight_sync import WeightSync, WeightSyncConfig
from test_tree_attention import _compare, random_row_samples
from test_weight_sync import TOKENS, load_model, reference_logprobs, server_prompt_logprobs

SERVER_RANK, SERVER_LORAS, STALENESS = 32, 4, 2  # keep = STALENESS + 1 = 3 versions, loads need 4 slots


def peft_model(model_dir, seed: int, r: int = 4, attn: str | None = None):
    """The tiny Qwen3 with a LoRA adapter whose B matrices are random (so it changes every output)."""
    import transformers as tf
    from peft import LoraConfig

    kwargs = {"attn_implementation": attn} if attn else {}
    base = tf.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, **kwargs)
    model = wrap_policy(base, LoraConfig(r=r, lora_alpha=2 * r, target_modules="all-linear"))
    perturb_adapter(model, seed)
    return model.eval()


def perturb_adapter(model, seed: int, scale: float = 0.1) -> None:
    """A stand-in for a training step: new values in every adapter tensor."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=generator) * scale)


# ---- no server -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["shared_prompt", "multi_turn"])
def test_packed_forward_through_peft_matches_per_sample(tiny_qwen3, kind):
    """Tree attention is installed through transformers' AttentionInterface, so it reaches the PEFT-wrapped
    decoder: packed logprobs and adapter gradients equal an eager per-sample forward of an identical model."""
    import random

    ref, tree = peft_model(tiny_qwen3, 0, attn="eager"), peft_model(tiny_qwen3, 0, attn="eager")
    samples = random_row_samples(random.Random(3), kind)
    _compare(ref, packed_forward_module(tree), samples, "sdpa")
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for n, p in tree.named_parameters() if "lora_" in n)
    assert all(p.grad is None for n, p in tree.named_parameters() if "lora_" not in n)


def test_adapter_tensors_are_peft_files(tiny_qwen3, tmp_path):
    """What adapter sync writes equals what PEFT's own save_pretrained writes, and loads back with PEFT."""
    from peft import PeftModel
    from safetensors.torch import load_file

    model = peft_model(tiny_qwen3, 1)
    model.save_pretrained(tmp_path / "peft")
    versions = AdapterVersions(tmp_path / ".vllm_lora", "t", keep=2)
    path = versions.write(5, adapter_tensors(model), model.peft_config["default"])
    assert path.name == "t-v5" and not list(tmp_path.glob(".vllm_lora/*.tmp"))
    ours, theirs = load_file(path / "adapter_model.safetensors"), load_file(tmp_path / "peft" /
                                                                            "adapter_model.safetensors")
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    reloaded = PeftModel.from_pretrained(load_model(tiny_qwen3), path).eval()
    torch.testing.assert_close(reference_logprobs(reloaded, TOKENS), reference_logprobs(model, TOKENS))


def test_versions_window_and_pruning(tmp_path):
    """keep=2: each load retires the version that left the window; its directory goes one sync later."""
    versions = AdapterVersions(tmp_path, "t", keep=2)
    retired_at = {}
    for v in range(1, 6):
        versions.write(v, {"w": torch.zeros(1)}, _StubConfig())
        retired_at[v] = versions.loaded_version(v)
        on_disk = sorted(int(p.name.split("-v")[1]) for p in tmp_path.iterdir())
        assert versions.loaded == list(range(max(1, v - 1), v + 1))
        assert on_disk == list(range(max(1, v - 2), v + 1))  # registered ones + the one unloaded just now
    assert retired_at == {1: [], 2: [], 3: [1], 4: [2], 5: [3]}


class _StubConfig:
    def save_pretrained(self, path):
        (__import__("pathlib").Path(path) / "adapter_config.json").write_text("{}")


def test_cli_fields_build_the_lora_config():
    from grpo.config import AsyncGRPOConfig
    from grpo.lora import peft_config_from_run

    assert peft_config_from_run(AsyncGRPOConfig()) is None
    cfg = peft_config_from_run(AsyncGRPOConfig(lora_r=8))
    assert (cfg.r, cfg.lora_alpha, cfg.target_modules, cfg.bias) == (8, 16.0, "all-linear", "none")
    cfg = peft_config_from_run(AsyncGRPOConfig(lora_r=4, lora_alpha=4, lora_target_modules=("q_proj", "v_proj")))
    assert (cfg.lora_alpha, set(cfg.target_modules)) == (4, {"q_proj", "v_proj"})


def test_wrap_policy_refuses_lm_head(tiny_qwen3):
    from peft import LoraConfig

    with pytest.raises(ValueError, match="lm_head"):
        wrap_policy(load_model(tiny_qwen3), LoraConfig(r=4, target_modules=["q_proj", "lm_head"]))


def test_all_linear_on_a_vlm_keeps_to_the_language_model(tiny_models):
    """PEFT's `all-linear` would also adapt the vision tower (dead weight for the text-only trainer, refused by
    vLLM's language-model-only server): every text linear layer gets an adapter, nothing else does, and targets
    that reach the vision tower are refused by name."""
    from peft import LoraConfig

    from grpo.lora import wrap_policy
    from grpo.model import load_policy

    path = str(tiny_models["qwen3_5"])
    model = wrap_policy(load_policy(path), LoraConfig(r=4, target_modules="all-linear"))
    adapted = {n.split(".lora_")[0].removeprefix("base_model.model.") for n, _ in model.named_parameters()
               if "lora_" in n}
    text_linears = {n for n, m in load_policy(path).named_modules()
                    if isinstance(m, torch.nn.Linear) and "language_model." in n}
    assert adapted == text_linears and any("linear_attn" in n for n in adapted)
    with pytest.raises(ValueError, match="outside the language model"):
        wrap_policy(load_policy(path), LoraConfig(r=4, target_modules=["qkv", "q_proj"]))  # `qkv`: vision attention


def test_checkpoint_keeps_the_adapter(tiny_qwen3, tmp_path):
    """A PEFT checkpoint is PEFT's adapter format (no full weights), and resumes adapter + optimizer exactly."""
    from grpo import checkpoint as ckpt

    model = peft_model(tiny_qwen3, 2).train()
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    ids = torch.arange(4, 20)[None]
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    path = ckpt.save_checkpoint(tmp_path, 3, model, None, optimizer, scheduler, {"prompt_index": 1})
    assert (path / "adapter_model.safetensors").exists() and (path / "adapter_config.json").exists()
    assert not (path / "model.safetensors").exists()

    fresh = peft_model(tiny_qwen3, 9)
    fresh_opt = torch.optim.AdamW([p for p in fresh.parameters() if p.requires_grad], lr=1e-2)
    ckpt.load_checkpoint(path, fresh, fresh_opt, torch.optim.lr_scheduler.LambdaLR(fresh_opt, lambda s: 1.0))
    for (name, p), q in zip(model.named_parameters(), fresh.parameters()):
        torch.testing.assert_close(q, p, rtol=0, atol=0, msg=name)
        if p.requires_grad:
            torch.testing.assert_close(fresh_opt.state[q]["exp_avg"], optimizer.state[p]["exp_avg"], rtol=0, atol=0)


def _facts(rank=None, loras=None, updating=True, dp=1) -> dict:
    return {"max_lora_rank": rank, "max_loras": loras, "runtime_updating": updating, "data_parallel_size": dp}


def test_start_checks_name_the_restart_flags(tiny_qwen3):
    model = peft_model(tiny_qwen3, 0, r=12)
    with pytest.raises(LoraServerError, match=r"--max-lora-rank 16 --max-loras 6"):
        check_lora_server(_facts(8, 6), rank=12, max_staleness=4)  # rank 12 needs the next allowed rank, 16
    with pytest.raises(LoraServerError, match=r"--max-loras 5 < max_staleness \+ 2 = 6"):
        check_lora_server(_facts(16, 5), rank=12, max_staleness=4)
    with pytest.raises(LoraServerError, match="VLLM_ALLOW_RUNTIME_LORA_UPDATING"):
        check_lora_server(_facts(16, 6, updating=False), rank=12, max_staleness=4)
    check_lora_server(_facts(16, 6), rank=12, max_staleness=4)  # max servable rank, not the served one
    assert choose_sync_mode("auto", model, _facts(), 4) == "merged"  # no --enable-lora
    assert choose_sync_mode("auto", model, _facts(16, 6), 4) == "adapter"
    assert choose_sync_mode("merged", model, _facts(16, 6), 4) == "merged"
    assert choose_sync_mode("auto", load_model(tiny_qwen3), _facts(16, 6), 4) is None  # full fine-tuning
    with pytest.raises(LoraServerError, match="without --enable-lora"):
        choose_sync_mode("adapter", model, _facts(), 4)
    with pytest.raises(LoraServerError, match="largest --max-lora-rank 512"):
        check_lora_server(_facts(8, 6), rank=600, max_staleness=4)


def _sharded_sync_tensors(rank: int, world: int, port: int, model_dir: str, out: str) -> None:
    """In each of 2 gloo ranks: FSDP2-shard the PEFT policy as train.py does; rank 0 saves what each sync sends."""
    import os

    from grpo.distributed import init_distributed, shard_model
    from grpo.lora import adapter_tensors
    from grpo.policy import PackedPolicy
    from grpo.weight_sync import build_plan

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    info = init_distributed()
    model = peft_model(model_dir, 3)
    shard_model(PackedPolicy(packed_forward_module(model), "sdpa", 1.0), info, mixed_precision=False)
    adapter, merged = adapter_tensors(model), dict(build_plan(model).iter_tensors())
    if rank == 0:
        torch.save({"adapter": adapter, "merged": merged}, out)
    torch.distributed.destroy_process_group()


def test_sharded_syncs_send_what_one_process_sends(tiny_qwen3, tmp_path):
    """Under FSDP2 (2 CPU ranks) the adapter export equals PEFT's own files and the merged weights equal PEFT's
    `merge_and_unload` exactly (PEFT's in-place merge is wrong on sharded parameters; the sync merges gathered
    tensors instead)."""
    import torch.multiprocessing as mp

    from grpo.vllm_server import free_port

    mp.spawn(_sharded_sync_tensors, args=(2, free_port(), str(tiny_qwen3), str(tmp_path / "two.pt")), nprocs=2)
    two = torch.load(tmp_path / "two.pt")
    model = peft_model(tiny_qwen3, 3)
    adapter = adapter_tensors(model)
    reference = model.merge_and_unload().state_dict()
    assert two["adapter"].keys() == adapter.keys() and two["merged"].keys() == reference.keys()
    for name, tensor in adapter.items():
        torch.testing.assert_close(two["adapter"][name], tensor, rtol=0, atol=0)
    for name, tensor in reference.items():
        torch.testing.assert_close(two["merged"][name], tensor, rtol=0, atol=1e-7, msg=name)


def test_serve_command_emits_the_lora_flags():
    """`rollout.py serve --server.lora-rank 12 --server.max-loras 6`: the next rank vLLM accepts, runtime updates
    on, one API server (vLLM 0.32 refuses runtime LoRA updates with more)."""
    from grpo.vllm_server import ServeConfig, serve_command

    argv, env = serve_command(ServeConfig(lora_rank=12, max_loras=6, api_server_count=8))
    joined = " ".join(argv)
    assert "--enable-lora --max-lora-rank 16 --max-loras 6" in joined and "--api-server-count" not in joined
    assert env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "1"
    assert "--enable-lora" not in serve_command(ServeConfig())[0]


# ---- one real --enable-lora server --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def lora_server(tiny_qwen3, tmp_path_factory):
    server = start_server(tiny_qwen3, tmp_path_factory.mktemp("lora_vllm"), lora_rank=SERVER_RANK,
                          max_loras=SERVER_LORAS)
    yield server
    server.stop()


def _server_facts(server) -> dict:
    return server_lora_facts(httpx.get(f"{server.base_url}/server_info", params={"config_format": "json"},
                                       timeout=60).json())


def _registered(server) -> set[str]:
    return {m["id"] for m in httpx.get(f"{server.base_url}/v1/models", timeout=60).json()["data"] if m.get("parent")}


@pytest.mark.vllm
def test_server_facts_and_restart_hints(lora_server, tiny_qwen3):
    """The real server's /server_info drives the check: what it was started with passes, a larger staleness
    window or rank is refused with the flags to restart with."""
    facts = _server_facts(lora_server)
    assert facts == _facts(SERVER_RANK, SERVER_LORAS)
    assert choose_sync_mode("auto", peft_model(tiny_qwen3, 0), facts, STALENESS) == "adapter"
    with pytest.raises(LoraServerError, match=f"--max-loras {STALENESS + 4}"):
        choose_sync_mode("auto", peft_model(tiny_qwen3, 0), facts, STALENESS + 2)
    with pytest.raises(LoraServerError, match="--max-lora-rank 64"):
        choose_sync_mode("auto", peft_model(tiny_qwen3, 0, r=48), facts, STALENESS)


@pytest.mark.vllm
def test_adapter_sync_versions_rollouts_and_pruning(lora_server, tiny_qwen3, tmp_path):
    """Each sync serves `<name>-v<N>` with exactly the trainer's PEFT logprobs; a rollout started under v1 keeps
    sampling from v1 after v2 is loaded; max_staleness + 1 versions stay registered, older ones are unloaded (a
    rollout still on one ends) and their directories pruned; the base model is untouched."""
    from grpo.config import AsyncGRPOConfig
    from grpo.losses import registered_losses
    from grpo.model import load_tokenizer
    from grpo.rollout_loop import AsyncRolloutLoop, _model_version
    from grpo.shared_state import LoopOptions
    from grpo.vllm_client import VLLMClient

    model = peft_model(tiny_qwen3, 10)
    versions = AdapterVersions(tmp_path / ".vllm_lora", "t", keep=STALENESS + 1)
    sync = WeightSync(lora_server.base_url, WeightSyncConfig(mode="cpu_file", timeout=120.0), adapter=versions)
    sync.init(model)
    base_before = server_prompt_logprobs(lora_server.base_url, str(tiny_qwen3), TOKENS)
    config = AsyncGRPOConfig(max_completion_length=6, loss=registered_losses()["clipped_surrogate"])  # no top-k
    loop = AsyncRolloutLoop(config, str(tiny_qwen3), [], [], load_tokenizer(str(tiny_qwen3)), [2], None,
                            LoopOptions(lora_name="t", client=VLLMClient(lora_server.base_url, str(tiny_qwen3),
                                                                          timeout=60)))

    async def turns_under_v1(between):
        _model_version.set(1)
        first = await loop.generate_one_turn(TOKENS)
        between()  # the trainer syncs v2 while the rollout runs its tools
        second = await loop.generate_one_turn(TOKENS + first.output_ids + [5, 6])
        return first, second

    expected = {}
    sync.sync(model, 1)
    expected[1] = reference_logprobs(model, TOKENS)

    def sync_v2():
        perturb_adapter(model, 11)
        sync.sync(model, 2)
        expected[2] = reference_logprobs(model, TOKENS)
    turn1, turn2 = asyncio.run(turns_under_v1(sync_v2))
    v1_model = peft_model(tiny_qwen3, 10)
    for turn in (turn1, turn2):
        ids = turn.prompt_ids + turn.output_ids
        torch.testing.assert_close(torch.tensor(turn.output_log_probs),
                                   reference_logprobs(v1_model, ids)[len(turn.prompt_ids) - 1:], atol=1e-4, rtol=0)
    for v in (1, 2):
        torch.testing.assert_close(server_prompt_logprobs(lora_server.base_url, f"t-v{v}", TOKENS), expected[v],
                                   atol=1e-4, rtol=0)
    assert (expected[2] - expected[1]).abs().max() > 1e-2

    for v in (3, 4, 5):
        perturb_adapter(model, 10 + v)
        sync.sync(model, v)
    assert {n for n in _registered(lora_server) if n.startswith("t-")} == {"t-v3", "t-v4", "t-v5"}
    assert sorted(p.name for p in (tmp_path / ".vllm_lora").iterdir()) == ["t-v2", "t-v3", "t-v4", "t-v5"]
    torch.testing.assert_close(server_prompt_logprobs(lora_server.base_url, "t-v5", TOKENS),
                               reference_logprobs(model, TOKENS), atol=1e-4, rtol=0)

    async def rollout_on_unloaded():
        _model_version.set(1)
        loop.client = VLLMClient(lora_server.base_url, str(tiny_qwen3), timeout=60)  # one client per event loop
        return await loop.generate_one([{"role": "user", "content": "hi"}], [])
    assert asyncio.run(rollout_on_unloaded()).turns == []  # its version left the window: the rollout ends
    torch.testing.assert_close(server_prompt_logprobs(lora_server.base_url, str(tiny_qwen3), TOKENS), base_before)
    sync.init(model)  # a restarted trainer unloads what its predecessor registered
    assert not {n for n in _registered(lora_server) if n.startswith("t-")}
    sync.close()


@pytest.mark.vllm
@pytest.mark.slow
def test_spec_lora_example_through_python_api(lora_server, tiny_qwen3, tmp_path):
    """The spec's example (`peft_config=LoraConfig(r=32, lora_alpha=64, target_modules="all-linear")`) trains
    through `train.main` with adapter sync; the server then serves the saved adapter."""
    from peft import PeftModel

    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, str(REPO / "tests" / "lora_example.py"), lora_server.base_url,
                           str(tiny_qwen3), str(out)], capture_output=True, text=True, timeout=900, cwd=REPO,
                          env=os.environ | {"PYTHONPATH": f"{REPO}:{REPO / 'tests'}"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    result = json.loads(proc.stdout.split("RESULT ", 1)[1])
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3] and all(r["perf/weight_sync_pause_s"] == 0.0 for r in rows)
    final = out / "checkpoint-3"
    assert (final / "adapter_config.json").exists() and json.loads(
        (final / "adapter_config.json").read_text())["r"] == 32
    served = f"grpo-v{result['model_version']}"
    assert served in _registered(lora_server)
    assert len(list((out / ".vllm_lora").iterdir())) <= STALENESS + 2
    trained = PeftModel.from_pretrained(load_model(tiny_qwen3), final).eval()
    torch.testing.assert_close(server_prompt_logprobs(lora_server.base_url, served, TOKENS),
                               reference_logprobs(trained, TOKENS), atol=1e-4, rtol=0)
    assert (reference_logprobs(trained, TOKENS) - reference_logprobs(load_model(tiny_qwen3), TOKENS)).abs().max() > 0


@pytest.mark.vllm
def test_merged_sync_serves_the_peft_model(lora_server, tiny_qwen3):
    """Without adapter sync the adapter is merged for the transfer and unmerged after: the server's base model then
    scores exactly like the PEFT model, and the trainer's model is unchanged by the sync. (Last in the module: it
    rewrites the server's base weights, restored at the end.)"""
    model = peft_model(tiny_qwen3, 20)
    before = reference_logprobs(model, TOKENS)
    adapter_before = {n: p.clone() for n, p in model.named_parameters() if "lora_" in n}
    sync = WeightSync(lora_server.base_url, WeightSyncConfig(mode="cpu_file", timeout=120.0))
    sync.init(model)
    sync.sync(model, 7)
    try:
        torch.testing.assert_close(server_prompt_logprobs(lora_server.base_url, str(tiny_qwen3), TOKENS), before,
                                   atol=1e-4, rtol=0)
        torch.testing.assert_close(reference_logprobs(model, TOKENS), before, atol=1e-6, rtol=0)
        assert all(torch.equal(p, adapter_before[n]) for n, p in model.named_parameters() if "lora_" in n)
    finally:
        with torch.no_grad():
            for n, p in model.named_parameters():
                if "lora_B" in n:
                    p.zero_()
        sync.sync(model, 8)  # a zero adapter merges to the original base
        sync.close()
    torch.testing.assert_close(server_prompt_logprobs(lora_server.base_url, str(tiny_qwen3), TOKENS),
                               reference_logprobs(load_model(tiny_qwen3), TOKENS), atol=1e-4, rtol=0)
