"""The fast GPU step (train.build_policy: FSDP2 bf16 mixed precision on one GPU, compiled norms/MLP/rotary, bf16
LM head) computes the same log-probs as per-sample forwards of an eager bf16 model, for dense and Gated DeltaNet
layers; and one real optimizer step runs with every piece on. Skipped without CUDA (`pytest -m gpu`)."""

from __future__ import annotations

import pytest
import torch


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["qwen3", "qwen3_5"])
def test_fast_path_packed_matches_per_sample(tiny_models, kind):
    from bench_step import check_packed_vs_unpacked

    from grpo.distributed import init_distributed

    result = check_packed_vs_unpacked(tiny_models[kind], init_distributed(), {})
    assert result["terms"] == 4 * 60
    # bf16 tolerance, measured: no worse than an eager bf16 per-sample forward against the same fp32 reference
    assert result["mean_abs_diff"] <= 1.5 * result["eager_bf16_mean_abs_diff"] + 1e-3, result
    assert result["max_abs_diff"] <= 2.0 * result["eager_bf16_max_abs_diff"] + 1e-2, result


@pytest.mark.gpu
def test_fast_step_trains(tiny_models):
    """Two steps on one batch through the real step: the loss moves and every piece reported itself on."""
    import dataclasses

    from bench_step import synthetic_groups

    from grpo.config import AsyncGRPOConfig
    from grpo.distributed import decoder_layers, init_distributed
    from grpo.losses import LossConfig, get_loss
    from train import StepPlan, build_policy, optimizer_step, train_micro_batch

    info = init_distributed()
    config = dataclasses.replace(AsyncGRPOConfig(model=str(tiny_models["qwen3"]), token_budget=4096),
                                 gradient_checkpointing="true", learning_rate=1e-3)
    model, policy, optimizer, scheduler, autocast = build_policy(config, info, 4096)
    assert all(layer.gradient_checkpointing for layer in decoder_layers(model))
    samples = [s for s, _ in zip(synthetic_groups(1000, True, config.num_sampler_logprobs, group_size=4,
                                                  prompt_len=100, completion_len=40), range(4))]
    plan = StepPlan([samples], sum(s.num_trained for s in samples))
    losses = []
    for _ in range(2):
        m = train_micro_batch(policy, samples, plan, get_loss(config.loss_name), LossConfig.from_run_config(config),
                              1, 1, autocast)
        grad_norm, _ = optimizer_step(policy, optimizer, scheduler, config.max_grad_norm)
        assert torch.isfinite(grad_norm)
        losses.append(m["loss"])
    assert losses[0] != losses[1]
