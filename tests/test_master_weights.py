"""One process, bf16 compute, no FSDP2 (grpo/master_weights.py) against FSDP2 on a group of one: the same
training, step for step.

Both runs are `build_policy` (the trainer's own construction) from the same tiny checkpoint, with bf16 compute over
fp32 weights, then three optimizer steps of two micro-batches each through `train_micro_batch` and
`optimizer_step`. FSDP2's mixed precision casts the fp32 weights to bf16 for the forward and accumulates the bf16
gradients in fp32; the master-weights path does the same without FSDP2, so losses, gradient norms and the final
fp32 weights must agree to fp32 rounding. Also for the Qwen3.5 VLM checkpoint (Gated DeltaNet layers, a frozen
vision tower, tied embeddings). Runs in a spawned process: FSDP2 needs a process group.
"""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp

from test_train import random_samples


def _train(model_dir: str, one_process_fsdp: bool) -> dict:
    import contextlib

    from grpo.config import AsyncGRPOConfig
    from grpo.distributed import DistInfo
    from grpo.losses import get_loss
    from grpo.policy import build_policy
    from grpo.step import optimizer_step, train_micro_batch
    from grpo.step_metrics import resolve_metrics
    from grpo.step_plan import StepPlan

    config = AsyncGRPOConfig(model=model_dir, bf16=True, dtype="float32", compile_layers=False,
                             gradient_checkpointing="false", learning_rate=1e-3, max_grad_norm=1.0,
                             one_process_fsdp=one_process_fsdp)
    info = DistInfo(0, 1, 0, torch.device("cpu"))
    model, policy, optimizer, scheduler, _ = build_policy(config, info, 2048)
    before = {name: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
              for name, p in model.named_parameters()}
    losses, norms = [], []
    for step in range(3):
        samples = random_samples(step)
        halves = [[s for s in samples if s.group_id % 2 == h] for h in range(2)]
        plan = StepPlan([samples], sum(s.num_trained for s in samples))
        micro = [train_micro_batch(policy, half, plan, *get_loss("clipped_surrogate"), 1, 2, contextlib.nullcontext)
                 for half in halves]
        norm, _, stepped = optimizer_step(policy, optimizer, scheduler, config.max_grad_norm)
        assert stepped
        losses += [m["loss"] for m in resolve_metrics(micro)]
        norms.append(float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm))
    weights = {}
    for name, p in model.named_parameters():
        t = p.full_tensor() if hasattr(p, "full_tensor") else p
        weights[name] = t.detach().clone()
    assert all(t.dtype == torch.float32 for t in weights.values())  # the masters, between steps
    from grpo import master_weights

    sharded = any(hasattr(p, "full_tensor") for p in model.parameters())
    assert sharded == (master_weights.of(policy) is None) == one_process_fsdp  # which path ran
    return {"losses": [float(x) for x in losses], "norms": norms, "weights": weights, "before": before,
            "state_dict_dtypes": {str(t.dtype) for t in model.state_dict().values() if t.is_floating_point()}}


def _both(rank: int, model_dir: str, out: str) -> None:
    torch.save({"fsdp": _train(model_dir, True), "masters": _train(model_dir, False)}, out)


@pytest.mark.parametrize("kind", ["qwen3", "qwen3_5"])
def test_master_weights_train_like_one_process_fsdp2(tiny_models, tmp_path, kind):
    mp.spawn(_both, args=(str(tiny_models[kind]), str(tmp_path / "out.pt")), nprocs=1, join=True)
    got = torch.load(tmp_path / "out.pt")
    fsdp, masters = got["fsdp"], got["masters"]
    torch.testing.assert_close(masters["losses"], fsdp["losses"], atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(masters["norms"], fsdp["norms"], atol=1e-6, rtol=1e-5)
    assert masters["weights"].keys() == fsdp["weights"].keys()
    for name, w in fsdp["weights"].items():
        torch.testing.assert_close(masters["weights"][name], w, atol=1e-6, rtol=1e-5, msg=name)
        torch.testing.assert_close(masters["before"][name], fsdp["before"][name], atol=0, rtol=0, msg=name)
    moved = [n for n, w in fsdp["weights"].items() if not torch.equal(w, fsdp["before"][n])]
    assert len(moved) > len(fsdp["weights"]) // 2  # three steps at lr 1e-3 moved the trained weights
    assert masters["state_dict_dtypes"] == {"torch.float32"}


def test_a_dropped_policy_frees_its_weights(tiny_models):
    """The gradient hooks live on each parameter's C++ side, out of the garbage collector's sight: if they held the
    `MasterWeights` (and so every parameter), a policy built twice in one process (bench_step's variants, a test
    session) would keep the first model's masters, compute copies and gradients alive."""
    import contextlib
    import gc
    import weakref

    from grpo.config import AsyncGRPOConfig
    from grpo.distributed import DistInfo
    from grpo.losses import get_loss
    from grpo.policy import build_policy
    from grpo.step import train_micro_batch
    from grpo.step_plan import StepPlan

    config = AsyncGRPOConfig(model=str(tiny_models["qwen3"]), bf16=True, dtype="float32", compile_layers=False,
                             gradient_checkpointing="false", one_process_fsdp=False)
    model, policy, optimizer, scheduler, _ = build_policy(config, DistInfo(0, 1, 0, torch.device("cpu")), 2048)
    samples = random_samples(0)
    train_micro_batch(policy, samples, StepPlan([samples], sum(s.num_trained for s in samples)),
                      *get_loss("clipped_surrogate"), 1, 1, contextlib.nullcontext)
    params = [weakref.ref(p) for p in model.parameters()]
    del model, policy, optimizer, scheduler
    gc.collect()
    assert not [r for r in params if r() is not None]


def _guarded_steps(fused: bool) -> tuple[list, list, torch.Tensor, dict, int]:
    """Four steps of `optimizer_step` on a small module: finite, a NaN loss, NaN gradients, finite."""
    from grpo.step import optimizer_step

    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 1))
    optimizer = torch.optim.AdamW(module.parameters(), lr=0.05, weight_decay=0.1, fused=fused)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
    stepped, snapshots = [], []
    for step, fault in enumerate(["none", "nan_loss", "nan_grad", "none"]):
        x = torch.randn(8, 6, generator=torch.Generator().manual_seed(step))
        loss = module(x).pow(2).mean()
        loss.backward()
        if fault == "nan_grad":
            module[0].weight.grad[0, 0] = float("nan")
        reported = torch.tensor(float("nan")) if fault == "nan_loss" else loss.detach()
        stepped.append(optimizer_step(module, optimizer, scheduler, 1.0, [reported])[2])
        snapshots.append(torch.cat([p.detach().flatten().clone() for p in module.parameters()]))
    state = optimizer.state[module[0].weight]
    return stepped, snapshots, state["exp_avg"].clone(), {"step": float(state["step"])}, scheduler.last_epoch


def test_a_nonfinite_step_is_skipped_on_the_device_as_on_the_host():
    """The fused optimizer's skip (the verdict as `found_inf`, no host wait) == the host's skip of a plain AdamW:
    a NaN loss or NaN gradients leave weights, moments, step count and schedule as they were; finite steps agree."""
    fused, host = _guarded_steps(True), _guarded_steps(False)
    assert fused[0] == host[0] == [True, False, False, True]
    assert torch.equal(fused[1][1], fused[1][0]) and torch.equal(fused[1][2], fused[1][0])  # nothing moved
    assert not torch.equal(fused[1][3], fused[1][2])
    for got, ref in zip(fused[1], host[1]):
        torch.testing.assert_close(got, ref, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(fused[2], host[2], atol=1e-7, rtol=1e-6)
    assert fused[3] == host[3] == {"step": 2.0} and fused[4] == host[4] == 2

