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
    from grpo.losses import loss_function
    from train import StepPlan, build_policy, optimizer_step, resolve_metrics, train_micro_batch

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
        m = resolve_metrics([train_micro_batch(policy, samples, plan, loss_function(config.loss), config.loss, 1, 1,
                                               autocast, config.max_completion_length)])[0]
        grad_norm, _ = optimizer_step(policy, optimizer, scheduler, config.max_grad_norm)
        assert torch.isfinite(grad_norm)
        losses.append(m["loss"])
    assert losses[0] != losses[1]


@pytest.mark.gpu
def test_fla_varlen_recurrence_matches_padded_torch_levels():
    """The varlen FLA kernel per trie level == transformers' torch kernel on padded levels: outputs and the
    gradients of q, k, v, g, beta (bf16 inputs; tolerance relative to the values' scale)."""
    import random

    fla = pytest.importorskip("fla.ops.gated_delta_rule")
    from test_gdn import multi_level, _sample
    from transformers.models.qwen3_5 import modeling_qwen3_5

    from grpo.gdn import plan_tree_scan, tree_chunk_gated_delta_rule, tree_varlen_gated_delta_rule
    from grpo.trie import pack_samples

    row = pack_samples([_sample(t) for t in multi_level(random.Random(7))]).to("cuda")
    plan = plan_tree_scan(row.token_pred, row.cu_seqlens_q, row.seg_parent, 4)
    n, h_k, h_v, d = row.input_ids.shape[0], 2, 4, 64
    gen = torch.Generator(device="cuda").manual_seed(0)
    inputs = [torch.randn(n, h_k, d, device="cuda", generator=gen), torch.randn(n, h_k, d, device="cuda", generator=gen),
              torch.randn(n, h_v, d, device="cuda", generator=gen),
              -torch.rand(n, h_v, device="cuda", generator=gen) * 0.3, torch.rand(n, h_v, device="cuda", generator=gen)]
    weights = torch.randn(n, h_v, d, device="cuda", generator=gen)
    results = []
    for path in ("fla", "torch"):
        q, k, v, g, beta = [t.clone().to(torch.bfloat16 if i in (0, 1, 2, 4) else torch.float32).requires_grad_()
                            for i, t in enumerate(inputs)]
        if path == "fla":
            out = tree_varlen_gated_delta_rule(fla.chunk_gated_delta_rule, q, k, v, g, beta, plan)
        else:
            rep = h_v // h_k
            out = tree_chunk_gated_delta_rule(modeling_qwen3_5.torch_chunk_gated_delta_rule,
                                              q.repeat_interleave(rep, 1), k.repeat_interleave(rep, 1), v, g, beta,
                                              plan)
        try:
            (out.float() * weights).sum().backward()
        except RuntimeError as exc:  # FLA refuses known-bad Triton/GPU pairs; gdn_kernel=auto then uses torch
            assert path == "fla"
            err = float((out.float() - tree_chunk_gated_delta_rule(
                modeling_qwen3_5.torch_chunk_gated_delta_rule, q.repeat_interleave(2, 1).detach(),
                k.repeat_interleave(2, 1).detach(), v.detach(), g.detach(), beta.detach(), plan).float()).abs().max())
            assert err < 3e-2 * float(out.float().abs().max()), err  # the forward still matches
            pytest.skip(f"FLA's backward refuses this device: {str(exc).splitlines()[0]}")
        results.append([out.float()] + [t.grad.float() for t in (q, k, v, g, beta)])
    for name, got, want in zip(["out", "dq", "dk", "dv", "dg", "dbeta"], *results):
        err = float((got - want).abs().max() / want.abs().max().clamp_min(1e-6))
        assert err < 3e-2, f"{name}: max error {err:.3g} of the values' scale"
