"""grpo/losses.py: invariants every registered loss must satisfy, then exact checks of each loss and helper.

Distributions are tiny (V = 6) so expectations over the sampled token are exact sums, not Monte Carlo.
"""

from __future__ import annotations

import math

import pytest
import torch

from grpo.config import AsyncGRPOConfig
from grpo.losses import (LOSSES, LossConfig, LossInputs, centering_residuals, entropy_metric, get_loss,
                         normalized_loss, register_loss)

V = 6
CFG = LossConfig(epsilon=0.2, epsilon_high=0.28, is_clip_min=0.5, is_clip_max=5.0)
ALL_LOSSES = sorted(LOSSES)


def _inputs(policy_logits, sampler_logits, targets, advantages, top_ids, sample_id=None) -> LossInputs:
    """LossInputs at M positions from full distributions: policy_logits [M, V] (leaf with grad), sampler [M, V]."""
    policy_logp = torch.log_softmax(policy_logits, dim=-1)
    sampler_logp = torch.log_softmax(sampler_logits, dim=-1)
    m = policy_logits.shape[0]
    return LossInputs(
        policy_logprobs=policy_logp.gather(1, targets[:, None]).squeeze(1),
        sampler_logprobs=sampler_logp.gather(1, targets[:, None]).squeeze(1),
        advantages=advantages,
        sample_id=torch.zeros(m, dtype=torch.long) if sample_id is None else sample_id,
        policy_top_logprobs=policy_logp.gather(1, top_ids),
        sampler_top_logprobs=sampler_logp.gather(1, top_ids),
    )


def _random_case(m: int = 8, k: int = 3, seed: int = 0, on_policy: bool = False):
    gen = torch.Generator().manual_seed(seed)
    sampler_logits = torch.randn(m, V, generator=gen, dtype=torch.float64)
    noise = 0.0 if on_policy else 0.3 * torch.randn(m, V, generator=gen, dtype=torch.float64)
    policy_logits = (sampler_logits + noise).requires_grad_()
    targets = torch.multinomial(torch.softmax(sampler_logits, -1), 1, generator=gen).squeeze(1)
    advantages = torch.randn(m, generator=gen, dtype=torch.float64)
    top_ids = torch.topk(sampler_logits, k, dim=-1).indices
    sample_id = torch.arange(m) // 3
    return policy_logits, sampler_logits, targets, advantages, top_ids, sample_id


def _logits_grad(loss_name, policy_logits, *rest, cfg=CFG):
    per_token, metrics = get_loss(loss_name)(_inputs(policy_logits, *rest), cfg)
    (grad,) = torch.autograd.grad(per_token.sum(), (policy_logits,))
    return grad, per_token, metrics


# ---- invariants of every registered loss ----------------------------------------------------------------------

@pytest.mark.parametrize("loss_name", ALL_LOSSES)
def test_on_policy_is_the_plain_policy_gradient(loss_name):
    policy_logits, sampler_logits, targets, advantages, top_ids, sample_id = _random_case(on_policy=True)
    grad, _, metrics = _logits_grad(loss_name, policy_logits, sampler_logits, targets, advantages, top_ids, sample_id)
    for name in ("min", "mean", "max"):
        assert metrics[f"sampling/importance_sampling_ratio/{name}"].item() == pytest.approx(1.0, abs=1e-12)
    assert metrics["sampling/masked_mean"].item() == 0.0
    assert metrics["sampling/sampling_logp_difference/max"].item() == pytest.approx(0.0, abs=1e-12)
    logp_y = torch.log_softmax(policy_logits, -1).gather(1, targets[:, None]).squeeze(1)
    (reinforce,) = torch.autograd.grad(-(advantages * logp_y).sum(), (policy_logits,))
    torch.testing.assert_close(grad, reinforce)


@pytest.mark.parametrize("loss_name", ALL_LOSSES)
def test_masked_token_has_no_sampled_token_gradient(loss_name):
    policy_logits, sampler_logits, targets, advantages, top_ids, sample_id = _random_case(seed=1)
    inputs = _inputs(policy_logits, sampler_logits, targets, advantages, top_ids, sample_id)
    policy_logprobs = inputs.policy_logprobs.detach().clone().requires_grad_()
    # Token 2 far above the band (r = 8), token 5 below it (r = 0.3); the others at r = 1.05 (inside the band and
    # the trust region, so even a clipped loss has a gradient there).
    with torch.no_grad():
        policy_logprobs.copy_(inputs.sampler_logprobs + math.log(1.05))
        policy_logprobs[2] = inputs.sampler_logprobs[2] + math.log(8.0)
        policy_logprobs[5] = inputs.sampler_logprobs[5] + math.log(0.3)
    inputs.policy_logprobs = policy_logprobs
    per_token, metrics = get_loss(loss_name)(inputs, CFG)
    (grad,) = torch.autograd.grad(per_token.sum(), (policy_logprobs,), allow_unused=True)
    assert grad[2] == 0 and grad[5] == 0
    assert (grad[[0, 1, 3, 4, 6, 7]] != 0).all()
    assert metrics["sampling/masked_mean"].item() == pytest.approx(2 / 8)
    assert metrics["sampling/importance_sampling_ratio/max"].item() == pytest.approx(8.0)
    assert metrics["sampling/importance_sampling_ratio/min"].item() == pytest.approx(0.3)


@pytest.mark.parametrize("loss_name", ALL_LOSSES)
def test_sampler_minus_9999_is_minus_inf_and_never_nan(loss_name):
    policy_logits, sampler_logits, targets, advantages, top_ids, sample_id = _random_case(seed=2)
    inputs = _inputs(policy_logits, sampler_logits, targets, advantages, top_ids, sample_id)
    inputs.sampler_logprobs = inputs.sampler_logprobs.clone()
    inputs.sampler_logprobs[0] = -9999.0  # the ratio overflows to inf: masked, no NaN gradient
    top = inputs.sampler_top_logprobs.clone()
    top[:, -1] = -9999.0
    inputs.sampler_top_logprobs = top
    per_token, metrics = get_loss(loss_name)(inputs, CFG)
    (grad,) = torch.autograd.grad(per_token.sum(), (policy_logits,))
    assert torch.isfinite(per_token).all() and torch.isfinite(grad).all()
    assert metrics["sampling/masked_mean"].item() == pytest.approx(1 / 8)


@pytest.mark.parametrize("loss_name", ALL_LOSSES)
def test_metrics_are_detached_scalars_and_empty_rows_work(loss_name):
    policy_logits, sampler_logits, targets, advantages, top_ids, sample_id = _random_case(seed=3)
    _, per_token, metrics = _logits_grad(loss_name, policy_logits, sampler_logits, targets, advantages, top_ids,
                                         sample_id)
    assert per_token.shape == targets.shape
    required = {"sampling/importance_sampling_ratio/min", "sampling/importance_sampling_ratio/mean",
                "sampling/importance_sampling_ratio/max", "sampling/masked_mean",
                "sampling/sampling_logp_difference/mean", "sampling/sampling_logp_difference/max",
                "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean", "clip_ratio/low_min",
                "clip_ratio/high_max"}
    assert required <= metrics.keys()
    for value in metrics.values():
        assert value.dim() == 0 and not value.requires_grad
    # A zero-weight dummy row (end of data) has no trained token: the loss must still backprop.
    empty = _random_case(m=0)
    per_token, metrics = get_loss(loss_name)(_inputs(*empty), CFG)
    normalized_loss(per_token, 10, 1, 1).backward()
    assert math.isnan(metrics["sampling/importance_sampling_ratio/mean"].item())


# ---- score centering ----------------------------------------------------------------------------------------------

def _expected_grad_over_samples(policy_logits, sampler_logits, advantage, top_ids, loss_name="score_centering"):
    """sum_y q(y) * grad(loss | sampled y): the exact expectation of the gradient under the sampler, at 1 position."""
    q = torch.softmax(sampler_logits, -1)[0]
    total = torch.zeros_like(policy_logits)
    for y in range(V):
        grad, _, _ = _logits_grad(loss_name, policy_logits, sampler_logits, torch.tensor([y]),
                                  torch.tensor([advantage], dtype=torch.float64), top_ids)
        total += q[y] * grad
    return total


def _far_from_sampler():
    """One position whose p/q ratios straddle the band: some tokens are masked, the rest in band."""
    sampler_logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -0.5, -1.0]], dtype=torch.float64)
    shift = torch.tensor([[0.0, 0.6, -1.2, 2.5, 0.3, -0.4]], dtype=torch.float64)
    policy_logits = (sampler_logits + shift).requires_grad_()
    ratio = torch.softmax(policy_logits, -1) / torch.softmax(sampler_logits, -1)
    outside = (ratio < CFG.is_clip_min) | (ratio > CFG.is_clip_max)
    assert outside.any() and (~outside).sum() >= 3, "the case must mask some tokens and keep others"
    return policy_logits, sampler_logits


@pytest.mark.parametrize("advantage", [1.0, -0.7])
def test_score_centering_expected_gradient_is_zero_for_constant_advantage(advantage):
    policy_logits, sampler_logits = _far_from_sampler()
    top_ids = torch.arange(V)[None]  # K = V: H_t covers the vocabulary
    centered = _expected_grad_over_samples(policy_logits, sampler_logits, advantage, top_ids)
    torch.testing.assert_close(centered, torch.zeros_like(centered), atol=1e-12, rtol=0)
    # The same expectation without centering is what the estimator removes: it must be clearly nonzero.
    plain = _expected_grad_over_samples(policy_logits, sampler_logits, advantage, top_ids, "clipped_surrogate")
    assert plain.abs().max() > 1e-2


def test_score_centering_tail_model_is_exact_when_sampler_tail_is_proportional():
    """K < V: if q_v = rho * p_v outside H (the estimator's tail model), the expected gradient is again 0."""
    p = torch.softmax(torch.tensor([1.0, 0.2, -0.3, 0.4, -1.0, 0.1], dtype=torch.float64), -1)
    head = torch.tensor([0, 3])  # H_t, K = 2
    q = p.clone()
    q[head] = torch.tensor([0.45, 0.05], dtype=torch.float64)  # Q = 0.5
    tail = torch.ones(V, dtype=torch.bool)
    tail[head] = False
    rho = (1 - q[head].sum()) / (1 - p[head].sum())
    q[tail] = rho * p[tail]
    assert CFG.is_clip_min <= 1 / rho <= CFG.is_clip_max
    policy_logits = p.log()[None].clone().requires_grad_()
    centered = _expected_grad_over_samples(policy_logits, q.log()[None], 1.0, head[None])
    torch.testing.assert_close(centered, torch.zeros_like(centered), atol=1e-12, rtol=0)


def test_score_centering_with_full_top_k_equals_exact_centering():
    policy_logits, sampler_logits, targets, advantages, _, sample_id = _random_case(m=5, seed=4)
    with torch.no_grad():
        policy_logits[1, 2] += 2.0  # push a few ratios out of the band
        policy_logits[3, 0] -= 2.0
    top_ids = torch.arange(V).expand(5, V)
    grad, _, _ = _logits_grad("score_centering", policy_logits, sampler_logits, targets, advantages, top_ids,
                              sample_id)
    # Independent reference: -A [w(r_y) log p(y) - sum_v q_v w(p_v / q_v) log p_v], weights detached.
    logp = torch.log_softmax(policy_logits, -1)
    q = torch.softmax(sampler_logits, -1)
    ratio = (logp.detach().exp() / q)
    w = torch.where((ratio >= 0.5) & (ratio <= 5.0), ratio, torch.zeros_like(ratio))
    assert (w == 0).any()
    rows = torch.arange(5)
    bracket = w[rows, targets] * logp[rows, targets] - (q * w * logp).sum(-1)
    (want,) = torch.autograd.grad(-(advantages * bracket).sum(), (policy_logits,))
    torch.testing.assert_close(grad, want)


def test_score_centering_masked_position_keeps_its_centering_term():
    policy_logits, sampler_logits, targets, advantages, top_ids, sample_id = _random_case(seed=5)
    # Residuals vanish when every ratio is in the band, so make the sampler's top id of position 4 out of band.
    with torch.no_grad():
        policy_logits[4, top_ids[4, 0]] += 4.0
    inputs = _inputs(policy_logits, sampler_logits, targets, advantages, top_ids, sample_id)
    residuals, _ = centering_residuals(inputs.policy_top_logprobs, inputs.sampler_top_logprobs, CFG)
    assert residuals[4].abs().sum() > 0
    inputs.sampler_logprobs = inputs.sampler_logprobs.clone()
    inputs.sampler_logprobs[4] = inputs.policy_logprobs[4].detach() - math.log(10.0)  # r = 10: masked
    top = inputs.policy_top_logprobs.detach().requires_grad_()
    inputs.policy_top_logprobs = top
    per_token, _ = get_loss("score_centering")(inputs, CFG)
    (grad_top,) = torch.autograd.grad(per_token.sum(), (top,))
    assert grad_top[4].abs().sum() > 0


def test_centering_residuals_on_policy_vanish_and_sampler_mass():
    policy_logits, sampler_logits, *_ = _random_case(seed=6, on_policy=True)
    logp = torch.log_softmax(policy_logits.detach(), -1)
    top = torch.topk(logp, 3, dim=-1).indices
    residuals, sampler_mass = centering_residuals(logp.gather(1, top), logp.gather(1, top), CFG)
    torch.testing.assert_close(residuals, torch.zeros_like(residuals), atol=1e-15, rtol=0)
    torch.testing.assert_close(sampler_mass, logp.exp().gather(1, top).sum(-1))


def test_score_centering_padding_and_out_of_support_entries_contribute_nothing():
    policy_logits, sampler_logits, targets, advantages, top_ids, sample_id = _random_case(seed=7)
    base = _inputs(policy_logits, sampler_logits, targets, advantages, top_ids, sample_id)
    padded = _inputs(policy_logits, sampler_logits, targets, advantages, top_ids, sample_id)
    minus_inf = torch.full((8, 2), float("-inf"), dtype=torch.float64)
    padded.policy_top_logprobs = torch.cat([padded.policy_top_logprobs, minus_inf], 1)
    padded.sampler_top_logprobs = torch.cat([padded.sampler_top_logprobs, torch.tensor([[-9999.0, -9999.0]] * 8,
                                                                                        dtype=torch.float64)], 1)
    want, want_metrics = get_loss("score_centering")(base, CFG)
    got, got_metrics = get_loss("score_centering")(padded, CFG)
    torch.testing.assert_close(got, want)
    assert got_metrics["sampling/sampler_mass"] == want_metrics["sampling/sampler_mass"]
    (grad,) = torch.autograd.grad(got.sum(), (policy_logits,))
    assert torch.isfinite(grad).all()


def test_score_centering_requires_top_logprobs():
    policy_logits, sampler_logits, targets, advantages, top_ids, sample_id = _random_case()
    inputs = _inputs(policy_logits, sampler_logits, targets, advantages, top_ids, sample_id)
    inputs.policy_top_logprobs = inputs.sampler_top_logprobs = None
    with pytest.raises(ValueError, match="clipped_surrogate"):
        get_loss("score_centering")(inputs, CFG)


# ---- clipped surrogate and clip metrics, by hand ---------------------------------------------------------------

def test_clipped_surrogate_hand_computed():
    # eps = 0.2, eps_high = 0.28 -> clip range [0.8, 1.28]; band [0.5, 5].
    # tok  r    A    r*A    clip(r)*A   min     loss   d loss / d log p
    # 0   1.5   1    1.5    1.28        1.28   -1.28   0     (clipped branch is constant)
    # 1   0.6  -2   -1.2   -1.6        -1.6     1.6    0     (clipped)
    # 2   1.1   0.5  0.55   0.55        0.55   -0.55  -0.55  (-A r)
    # 3   0.7   1    0.7    0.8         0.7    -0.7   -0.7
    # 4   6.0   1    masked (r > 5)              0      0
    # 5   0.4  -1    masked (r < 0.5)            0      0
    # 6   1.5  -1   -1.5   -1.28       -1.5     1.5    1.5
    ratios = torch.tensor([1.5, 0.6, 1.1, 0.7, 6.0, 0.4, 1.5], dtype=torch.float64)
    advantages = torch.tensor([1, -2, 0.5, 1, 1, -1, -1], dtype=torch.float64)
    sampler_logprobs = torch.full((7,), -1.0, dtype=torch.float64)
    policy_logprobs = (sampler_logprobs + ratios.log()).requires_grad_()
    sample_id = torch.tensor([0, 0, 0, 1, 1, 2, 2])
    inputs = LossInputs(policy_logprobs, sampler_logprobs, advantages, sample_id)
    per_token, metrics = get_loss("clipped_surrogate")(inputs, CFG)
    torch.testing.assert_close(per_token, torch.tensor([-1.28, 1.6, -0.55, -0.7, 0, 0, 1.5], dtype=torch.float64))
    (grad,) = torch.autograd.grad(per_token.sum(), (policy_logprobs,))
    torch.testing.assert_close(grad, torch.tensor([0, 0, -0.55, -0.7, 0, 0, 1.5], dtype=torch.float64))
    # Sampling metrics before masking: mean r = 11.8 / 7, 2 of 7 masked, max |log r| = log 6.
    assert metrics["sampling/importance_sampling_ratio/mean"].item() == pytest.approx(11.8 / 7)
    assert metrics["sampling/masked_mean"].item() == pytest.approx(2 / 7)
    assert metrics["sampling/sampling_logp_difference/max"].item() == pytest.approx(math.log(6.0))
    # Over the 5 unmasked tokens: low = {1} (r < 0.8, A < 0), high = {0} (r > 1.28, A > 0); token 6 has r > 1.28
    # but A < 0, token 3 has r < 0.8 but A > 0: neither is clipped. Per completion (unmasked tokens only):
    # c0 = {0, 1, 2}: low 1/3, high 1/3; c1 = {3}: 0, 0; c2 = {6}: 0, 0.
    assert metrics["clip_ratio/low_mean"].item() == pytest.approx(1 / 5)
    assert metrics["clip_ratio/high_mean"].item() == pytest.approx(1 / 5)
    assert metrics["clip_ratio/region_mean"].item() == pytest.approx(2 / 5)
    assert metrics["clip_ratio/low_min"].item() == pytest.approx(0.0)
    assert metrics["clip_ratio/high_max"].item() == pytest.approx(1 / 3)


def test_clip_min_and_max_are_over_completions():
    # sample ids are arbitrary labels (7 and 3): completion 7 = {0, 1}, completion 3 = {2, 3, 4}.
    # low tokens (r = 0.6 < 0.8, A < 0): 0 in completion 7 -> 1/2; 2 and 3 in completion 3 -> 2/3.  min = 1/2.
    # high tokens (r = 2 > 1.28, A > 0): 1 in completion 7 -> 1/2; 4 in completion 3 -> 1/3.        max = 1/2.
    ratios = torch.tensor([0.6, 2.0, 0.6, 0.6, 2.0], dtype=torch.float64)
    advantages = torch.tensor([-1, 1, -1, -1, 1], dtype=torch.float64)
    sampler_logprobs = torch.full((5,), -2.0, dtype=torch.float64)
    no_top = torch.zeros(5, 0, dtype=torch.float64)  # K = 0: score centering reduces to masked IS
    inputs = LossInputs(sampler_logprobs + ratios.log(), sampler_logprobs, advantages, torch.tensor([7, 7, 3, 3, 3]),
                        no_top, no_top)
    for name in ALL_LOSSES:
        _, metrics = get_loss(name)(inputs, CFG)
        assert metrics["clip_ratio/low_min"].item() == pytest.approx(1 / 2)
        assert metrics["clip_ratio/high_max"].item() == pytest.approx(1 / 2)
        assert metrics["clip_ratio/region_mean"].item() == pytest.approx(1.0)


# ---- normalisation, registry, config ------------------------------------------------------------------------------

def test_normalized_loss_matches_the_formula():
    per_token = torch.tensor([1.0, 2.0, 3.0])
    # sum = 6; N_glob = 10 over W = 2 ranks -> 5 tokens per rank; GA = 2 -> 6 / 5 / 2.
    assert normalized_loss(per_token, 10, 2, 2).item() == pytest.approx(0.6)
    # Fewer global tokens than ranks: the divisor is floored at 1.
    assert normalized_loss(per_token, 1, 4, 3).item() == pytest.approx(2.0)
    assert normalized_loss(per_token, torch.tensor(12), 3, 1).item() == pytest.approx(1.5)


def test_get_loss_by_name_by_import_path_and_errors():
    assert get_loss("score_centering") is LOSSES["score_centering"]
    assert get_loss("grpo.losses:clipped_surrogate") is LOSSES["clipped_surrogate"]
    with pytest.raises(ValueError, match="clipped_surrogate.*score_centering"):
        get_loss("ppo")
    with pytest.raises(ValueError, match="does not name a function"):
        get_loss("grpo.losses:nope")
    with pytest.raises(ValueError, match="already registered"):
        register_loss("score_centering")(lambda inputs, cfg: None)


def test_loss_config_from_run_config():
    cfg = LossConfig.from_run_config(AsyncGRPOConfig(epsilon=0.1, vllm_importance_sampling_clip_min=0.3))
    assert cfg == LossConfig(epsilon=0.1, epsilon_high=0.1, is_clip_min=0.3, is_clip_max=5.0)
    assert LossConfig.from_run_config(AsyncGRPOConfig(epsilon_high=0.28)).epsilon_high == 0.28


def test_entropy_metric_is_the_detached_mean():
    entropy = torch.tensor([0.5, 1.5, 1.0], requires_grad=True)
    value = entropy_metric(entropy)["entropy"]
    assert value.item() == pytest.approx(1.0) and not value.requires_grad
    assert math.isnan(entropy_metric(torch.zeros(0))["entropy"].item())
