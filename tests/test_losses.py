"""Losses: the invariants of tests/loss_checks.py on every registered loss, a hand-computed case per loss, the
score-centering estimator against exact expectations, the normaliser, the registry and the CLI.

Your own loss by import path gets the same invariants and the kit:
`GRPO_PLUGIN_MODULES=my_pkg.my_losses pytest tests/test_losses.py`.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import loss_hand_cases  # noqa: F401 (registers the built-in losses' hand cases)
from loss_hand_cases import ADVANTAGES, LOGP, RATIOS
from loss_checks import CHECKS, V, check_loss, make_inputs, structured_case

from grpo.loss_kit import (HAND_CASES, coverage_problems, hand_case_for, matches, run_case,  # noqa: F401
                           swap_problems)
from grpo.losses import (LOSS_MODULES_ENV, LOSSES, LossInputs, LossOutput, get_loss, normalized_loss,
                         register_loss, registered_losses, sampler_needs)
from grpo.score_centering import ScoreCenteringOptions, centering_residuals

ALL_LOSSES = sorted(registered_losses())
BAND = (0.5, 5.0)


@pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.__name__.removeprefix("check_"))
@pytest.mark.parametrize("name", ALL_LOSSES)
def test_invariants(name, check):
    check(name)


def test_families_are_registered():
    want = {"score_centering", "clipped_surrogate", "grpo", "dapo", "dr_grpo", "gspo", "off_policy_masked", "gmpo",
            "tis", "mis", "sequence_tis", "sequence_mis", "cispo"}
    assert want <= set(ALL_LOSSES)


# ---- the test kit (grpo/loss_kit.py): one hand-computed off-policy case per registered loss ---------------------


@pytest.mark.parametrize("name", ALL_LOSSES)
def test_every_loss_ships_a_hand_computed_case(name):
    try:
        hand_case_for(name)
    except LookupError as exc:
        pytest.fail(str(exc))


@pytest.mark.parametrize("name", ALL_LOSSES)
def test_hand_computed_case(name):
    case = hand_case_for(name)
    diffs = matches(case, run_case(name, case))
    assert not diffs, f"{name} differs from its hand-computed case: {diffs}"


@pytest.mark.parametrize("name", ALL_LOSSES)
def test_hand_case_is_off_policy_and_reaches_the_bands(name):
    assert not coverage_problems(name, hand_case_for(name))


@pytest.mark.parametrize("name", ALL_LOSSES)
def test_hand_case_tells_asymmetric_options_apart(name):
    assert not swap_problems(name, hand_case_for(name))


def test_the_kit_names_the_fix():
    with pytest.raises(LookupError, match="register_hand_case"):
        hand_case_for("no_such_loss")
    grpo = HAND_CASES["grpo"]
    symmetric = dataclasses.replace(grpo, overrides={})  # grpo's defaults: epsilon = epsilon_high = 0.2
    assert any("epsilon = epsilon_high" in p for p in swap_problems("grpo", symmetric))
    on_policy = dataclasses.replace(grpo, ratios=(1.0, 0.9, 0.6, 1.1, 1.2))
    problems = coverage_problems("grpo", on_policy)
    assert any("ratio 1" in p for p in problems) and any("inside and outside" in p for p in problems)
    wrong = dataclasses.replace(grpo, loss=grpo.loss + 1e-3)
    diffs = matches(wrong, run_case("grpo", wrong))
    assert len(diffs) == 1 and diffs[0].startswith("loss ")


def _row(policy, sampler, advantages, sequence_index):
    """One row in float64 with a grad leaf for log p, no top-k (the loss families that do not read it)."""
    policy = torch.tensor(policy, dtype=torch.float64, requires_grad=True)
    no_top = torch.zeros(len(sampler), 0, dtype=torch.float64)
    inputs = LossInputs(policy, torch.tensor(sampler, dtype=torch.float64),
                        torch.tensor(advantages, dtype=torch.float64), torch.tensor(sequence_index),
                        policy_top_logprobs=no_top, sampler_top_logprobs=no_top)
    return policy, inputs


def _loss_and_grad(name, policy, inputs, **overrides):
    fn, options = get_loss(name)
    out = fn(inputs, dataclasses.replace(options, **overrides))
    loss = normalized_loss(out, inputs, 1, 1)
    (grad,) = torch.autograd.grad(loss, (policy,), allow_unused=True)
    return loss.item(), (torch.zeros_like(policy) if grad is None else grad), out


def test_off_policy_mask_statistic_is_over_all_tokens():
    # DeepSeek-V3.2 (arXiv 2512.02556), off-policy sequence masking:
    #   M_i = 0  iff  A_i < 0  and  (1 / |o_i|) sum_{t=1}^{|o_i|} log(pi_old(o_t) / pi_theta(o_t)) > delta
    # over ALL |o_i| tokens. One sequence, A = -1, log(p/q) = [-1.0, -0.05], delta = 0.1:
    #   (1.0 + 0.05) / 2 = 0.525 > 0.1 -> dropped: loss 0, gradient 0. (Token 0's ratio e^-1 = 0.37 is outside the
    #   [0.5, 5] band; a statistic over in-band tokens only would be 0.05 and keep token 1: loss 0.4756.)
    policy, inputs = _row([-2.0, -1.05], [-1.0, -1.0], [-1.0, -1.0], [0, 0])
    loss, grad, out = _loss_and_grad("off_policy_masked", policy, inputs)
    assert loss == 0.0
    torch.testing.assert_close(grad, torch.zeros(2, dtype=torch.float64), rtol=0, atol=0)
    assert not out.kept.any()
    assert out.metrics["sampling/off_policy_masked_frac"].item() == pytest.approx(0.5)  # token 1; token 0: band
    # The mask only touches A < 0: with A = +1 token 1 stays, -min(r A, clip(r, 0.8, 1.28) A) / 2 tokens,
    # r = e^-0.05, d/dlog p = -r / 2.
    policy, inputs = _row([-2.0, -1.05], [-1.0, -1.0], [1.0, 1.0], [0, 0])
    loss, grad, _ = _loss_and_grad("off_policy_masked", policy, inputs)
    r = math.exp(-0.05)
    assert loss == pytest.approx(-r / 2, rel=1e-12)
    torch.testing.assert_close(grad, torch.tensor([0.0, -r / 2], dtype=torch.float64), rtol=1e-12, atol=0)


def test_off_policy_mask_statistic_leaves_out_sampler_placeholder_tokens():
    # A token whose sampler logprob is vLLM's -inf stand-in (-9999) has no meaningful log(q/p): it leaves the mean
    # (numerator and |o_i|). A = -1, log(p/q) = [-0.2, -0.05] and one placeholder token:
    #   (0.2 + 0.05) / 2 = 0.125 > 0.1 -> dropped. (Counting the placeholder as 0 in |o_i| would give 0.083 and
    #   keep it; taking its raw log(q/p) = -9999 - log p would make the mean hugely negative and keep it.)
    policy, inputs = _row([-1.2, -1.05, -3.0], [-1.0, -1.0, -9999.0], [-1.0] * 3, [0, 0, 0])
    loss, grad, out = _loss_and_grad("off_policy_masked", policy, inputs)
    assert loss == 0.0 and not out.kept.any()
    torch.testing.assert_close(grad, torch.zeros(3, dtype=torch.float64), rtol=0, atol=0)


@pytest.mark.parametrize("name", ["sequence_mis", "sequence_tis"])
def test_sequence_weight_leaves_out_sampler_placeholder_tokens(name):
    # Sequence-level IS: w_i = prod_{t valid} p(y_t) / q(y_t), l_t = -sg(w_i) A_i log p(y_t) on the sequence's
    # valid tokens; a token with q = -9999 (vLLM's -inf) has no meaningful ratio and leaves the product and the loss,
    # the rest of its sequence stays (the same rule for mask and truncate). Here r = [1.2, 1.5, placeholder], A = +1:
    #   w = 1.8, inside [0.5, 2] (mask) and below 2 (truncate): loss = -1.8 (log p_0 + log p_1) / 3 tokens,
    #   d loss / d log p = [-1.8 / 3, -1.8 / 3, 0] (the token normaliser counts the removed token).
    logp = [-1.0 + math.log(1.2), -1.0 + math.log(1.5), -3.0]
    policy, inputs = _row(logp, [-1.0, -1.0, -9999.0], [1.0] * 3, [0, 0, 0])
    loss, grad, out = _loss_and_grad(name, policy, inputs)
    assert loss == pytest.approx(-1.8 * (logp[0] + logp[1]) / 3, rel=1e-12)
    torch.testing.assert_close(grad, torch.tensor([-0.6, -0.6, 0.0], dtype=torch.float64), rtol=1e-12, atol=0)
    assert out.kept.tolist() == [True, True, False]


def test_clip_metrics_by_hand():
    # clipped_surrogate, eps = 0.2, eps_high = 0.28 -> trust region [0.8, 1.28]; band [0.5, 5].
    # Kept tokens 0-3: low = {2} (r = 0.6 < 0.8, A < 0), high = {0} (r = 1.5 > 1.28, A > 0).
    # Per sequence (kept tokens only): s0 = {0, 1}: low 0, high 1/2; s1 = {2, 3}: low 1/2, high 0.
    fn, options = get_loss("clipped_surrogate")
    options = dataclasses.replace(options, epsilon_high=0.28)
    sampler = torch.full((5,), -1.0, dtype=torch.float64)
    inputs = LossInputs(torch.tensor(LOGP, dtype=torch.float64), sampler, torch.tensor(ADVANTAGES),
                        torch.tensor([0, 0, 1, 1, 1]))
    metrics = fn(inputs, options).metrics
    assert metrics["clip_ratio/low_mean"].item() == pytest.approx(1 / 4)
    assert metrics["clip_ratio/high_mean"].item() == pytest.approx(1 / 4)
    assert metrics["clip_ratio/region_mean"].item() == pytest.approx(2 / 4)
    assert metrics["clip_ratio/low_min"].item() == pytest.approx(0.0)
    assert metrics["clip_ratio/high_max"].item() == pytest.approx(1 / 2)
    assert metrics["sampling/masked_mean"].item() == pytest.approx(1 / 5)
    assert metrics["sampling/importance_sampling_ratio/mean"].item() == pytest.approx(sum(RATIOS) / 5)
    assert metrics["sampling/sampling_logp_difference/max"].item() == pytest.approx(math.log(6.0))


def test_clip_metrics_leave_out_sequences_without_kept_tokens():
    """low_min / high_max are over sequences with a kept token: one whose every token left the band counts as
    neither 0 nor 1; with no kept token at all both are NaN (dropped by the metric logger)."""
    fn, options = get_loss("clipped_surrogate")
    options = dataclasses.replace(options, epsilon_high=0.28)
    sampler = torch.tensor(LOGP, dtype=torch.float64) - torch.log(torch.tensor(RATIOS, dtype=torch.float64))
    logp = torch.tensor(list(LOGP) + [0.0, 0.0], dtype=torch.float64)  # sequence 2: ratio e^5 and e^-5, out of band
    inputs = LossInputs(logp, torch.cat([sampler, torch.tensor([-5.0, 5.0], dtype=torch.float64)]),
                        torch.tensor(list(ADVANTAGES) + [1.0, -1.0]), torch.tensor([0, 0, 1, 1, 1, 2, 2]))
    out = fn(inputs, options)
    assert not out.kept[5:].any()
    kept = out.kept[:5]
    per_seq = [(0, 2), (2, 5)]
    low = [float(((torch.tensor(RATIOS[a:b]) < 0.8) & (torch.tensor(ADVANTAGES[a:b]) < 0) & kept[a:b]).sum()
                 / kept[a:b].sum()) for a, b in per_seq]
    high = [float(((torch.tensor(RATIOS[a:b]) > 1.28) & (torch.tensor(ADVANTAGES[a:b]) > 0) & kept[a:b]).sum()
                  / kept[a:b].sum()) for a, b in per_seq]
    assert out.metrics["clip_ratio/low_min"].item() == pytest.approx(min(low))
    assert out.metrics["clip_ratio/high_max"].item() == pytest.approx(max(high))
    nothing = LossInputs(torch.zeros(2, dtype=torch.float64), torch.tensor([-5.0, 5.0], dtype=torch.float64),
                         torch.tensor([1.0, -1.0]), torch.tensor([0, 0]))
    metrics = fn(nothing, options).metrics
    assert math.isnan(metrics["clip_ratio/low_min"].item()) and math.isnan(metrics["clip_ratio/high_max"].item())


# ---- score centering: exact expectations over the sampled token ----------------------------------------------------

SC = ScoreCenteringOptions()


def _single_position_grad(name, policy_logits, sampler_logits, y, advantage, top_ids):
    fn, options = get_loss(name)
    inputs = make_inputs(policy_logits, sampler_logits, torch.tensor([y]),
                         torch.tensor([advantage], dtype=torch.float64), top_ids, torch.tensor([0]))
    (grad,) = torch.autograd.grad(fn(inputs, options).terms.sum(), (policy_logits,))
    return grad


def _expected_grad_over_samples(policy_logits, sampler_logits, advantage, top_ids, name="score_centering"):
    """sum_y q(y) * grad(loss | sampled y): the exact expectation of the gradient under the sampler, at 1 position."""
    q = torch.softmax(sampler_logits, -1)[0]
    return sum(q[y] * _single_position_grad(name, policy_logits, sampler_logits, y, advantage, top_ids)
               for y in range(V))


def _far_from_sampler():
    """One position whose p/q ratios straddle the band: some tokens are masked, the rest in band."""
    sampler_logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -0.5, -1.0]], dtype=torch.float64)
    shift = torch.tensor([[0.0, 0.6, -1.2, 2.5, 0.3, -0.4]], dtype=torch.float64)
    policy_logits = (sampler_logits + shift).requires_grad_()
    ratio = torch.softmax(policy_logits, -1) / torch.softmax(sampler_logits, -1)
    outside = (ratio < BAND[0]) | (ratio > BAND[1])
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
    assert BAND[0] <= 1 / rho <= BAND[1]
    policy_logits = p.log()[None].clone().requires_grad_()
    centered = _expected_grad_over_samples(policy_logits, q.log()[None], 1.0, head[None])
    torch.testing.assert_close(centered, torch.zeros_like(centered), atol=1e-12, rtol=0)


def test_score_centering_with_full_top_k_equals_exact_centering():
    policy_logits, sampler_logits, targets, advantages, _, sequence_index = structured_case((2, 3), seed=4)
    with torch.no_grad():
        policy_logits[1, 2] += 2.0  # push a few ratios out of the band
        policy_logits[3, 0] -= 2.0
    top_ids = torch.arange(V).expand(5, V)
    inputs = make_inputs(policy_logits, sampler_logits, targets, advantages, top_ids, sequence_index)
    (grad,) = torch.autograd.grad(get_loss("score_centering")[0](inputs, SC).terms.sum(), (policy_logits,))
    # Independent reference: -A [w(r_y) log p(y) - sum_v q_v w(p_v / q_v) log p_v], weights detached.
    logp = torch.log_softmax(policy_logits, -1)
    q = torch.softmax(sampler_logits, -1)
    ratio = logp.detach().exp() / q
    w = torch.where((ratio >= BAND[0]) & (ratio <= BAND[1]), ratio, torch.zeros_like(ratio))
    assert (w == 0).any()
    rows = torch.arange(5)
    bracket = w[rows, targets] * logp[rows, targets] - (q * w * logp).sum(-1)
    (want,) = torch.autograd.grad(-(advantages[sequence_index] * bracket).sum(), (policy_logits,))
    torch.testing.assert_close(grad, want)


def test_score_centering_masked_position_keeps_its_centering_term():
    policy_logits, sampler_logits, targets, advantages, top_ids, sequence_index = structured_case(seed=5)
    # Residuals vanish when every ratio is in the band, so make the sampler's top id of position 4 out of band.
    with torch.no_grad():
        policy_logits[4, top_ids[4, 0]] += 4.0
    inputs = make_inputs(policy_logits, sampler_logits, targets, advantages, top_ids, sequence_index)
    residuals, _ = centering_residuals(inputs.policy_top_logprobs, inputs.sampler_top_logprobs, *BAND)
    assert residuals[4].abs().sum() > 0
    inputs.sampler_logprobs = inputs.sampler_logprobs.clone()
    inputs.sampler_logprobs[4] = inputs.policy_logprobs[4].detach() - math.log(10.0)  # r = 10: masked
    top = inputs.policy_top_logprobs.detach().requires_grad_()
    inputs.policy_top_logprobs = top
    out = get_loss("score_centering")[0](inputs, SC)
    assert not out.kept[4]
    (grad_top,) = torch.autograd.grad(out.terms.sum(), (top,))
    assert grad_top[4].abs().sum() > 0


def test_centering_residuals_on_policy_vanish_and_sampler_mass():
    policy_logits, *_ = structured_case(seed=6, on_policy=True)
    logp = torch.log_softmax(policy_logits.detach(), -1)
    top = torch.topk(logp, 3, dim=-1).indices
    residuals, sampler_mass = centering_residuals(logp.gather(1, top), logp.gather(1, top), *BAND)
    torch.testing.assert_close(residuals, torch.zeros_like(residuals), atol=1e-15, rtol=0)
    torch.testing.assert_close(sampler_mass, logp.exp().gather(1, top).sum(-1))


def test_score_centering_padding_and_out_of_support_entries_contribute_nothing():
    case = structured_case(seed=7)
    base, padded = make_inputs(*case), make_inputs(*case)
    m = base.policy_logprobs.shape[0]
    padded.policy_top_logprobs = torch.cat([padded.policy_top_logprobs,
                                            torch.full((m, 2), float("-inf"), dtype=torch.float64)], 1)
    padded.sampler_top_logprobs = torch.cat([padded.sampler_top_logprobs,
                                             torch.full((m, 2), -9999.0, dtype=torch.float64)], 1)
    fn = get_loss("score_centering")[0]
    want, got = fn(base, SC), fn(padded, SC)
    torch.testing.assert_close(got.terms, want.terms)
    assert got.metrics["sampling/sampler_mass"] == want.metrics["sampling/sampler_mass"]
    (grad,) = torch.autograd.grad(got.terms.sum(), (case[0],))
    assert torch.isfinite(grad).all()


def test_score_centering_requires_top_logprobs():
    inputs = make_inputs(*structured_case())
    inputs.policy_top_logprobs = inputs.sampler_top_logprobs = None
    with pytest.raises(ValueError, match="clipped_surrogate"):
        get_loss("score_centering")[0](inputs, SC)


# ---- normaliser, registry, CLI, import-path hook -------------------------------------------------------------------

def test_normalized_loss_divides_by_the_named_global_count():
    terms = torch.tensor([1.0, 2.0, 3.0])  # sum 6, 3 tokens in 2 sequences
    inputs = LossInputs(torch.zeros(3), torch.zeros(3), torch.zeros(3), torch.tensor([0, 0, 1]),
                        num_tokens_global=10, num_sequences_global=4, max_completion_length=5)
    # token: 10 tokens over W = 2 ranks -> 5 per rank; GA = 2 -> 6 / 5 / 2
    assert normalized_loss(LossOutput(terms, "token", terms > 0, {}), inputs, 2, 2).item() == pytest.approx(0.6)
    # constant: 4 sequences x 5 = 20 over 2 ranks -> 6 / 10
    assert normalized_loss(LossOutput(terms, "constant", terms > 0, {}), inputs, 2, 1).item() == pytest.approx(0.6)
    per_sequence = torch.tensor([1.0, 3.0])  # sequence: 4 sequences over 4 ranks -> divisor 1
    assert normalized_loss(LossOutput(per_sequence, "sequence", terms > 0, {}), inputs, 4, 1).item() == 4.0
    # fewer global tokens than ranks: still D / W per rank (1 / 4), no floor -> 6 / (1 / 4) / 3
    few = LossInputs(torch.zeros(3), torch.zeros(3), torch.zeros(3), torch.tensor([0, 0, 1]), num_tokens_global=1)
    assert normalized_loss(LossOutput(terms, "token", terms > 0, {}), few, 4, 3).item() == pytest.approx(8.0)
    with pytest.raises(ValueError, match="sequence_mean"):
        normalized_loss(LossOutput(terms, "sequence", terms > 0, {}), inputs, 1, 1)


@pytest.mark.parametrize("normalizer, world, count", [("sequence", 4, 2), ("token", 2, 1), ("constant", 4, 1)])
def test_normalized_loss_with_fewer_units_than_ranks(normalizer, world, count):
    # The step's loss is sum over all ranks' terms / D. Rank r's loss is sum(terms_r) / (D / W) and FSDP averages
    # the W ranks' gradients, so d step / d term = (1 / W) (W / D) = 1 / D for any D >= 1, also D < W (the other
    # ranks hold padding rows: end-of-data flush, staleness re-check). Cases: W = 4 with 2 trained sequences;
    # W = 2 with one trained token; W = 4 with one sequence x max_completion_length 2 (constant, D = 2).
    # Here rank 0 holds one unit with term 3 (the rest of the micro-batch, if any, is on other ranks).
    term = torch.tensor([3.0], dtype=torch.float64, requires_grad=True)
    inputs = LossInputs(torch.zeros(1), torch.zeros(1), torch.zeros(1), torch.tensor([0]),
                        num_tokens_global=count, num_sequences_global=count, max_completion_length=2)
    divisor = count * (2 if normalizer == "constant" else 1)  # D
    loss = normalized_loss(LossOutput(term, normalizer, term > 0, {}), inputs, world, 1)
    (grad,) = torch.autograd.grad(loss, (term,))
    assert loss.item() == pytest.approx(3.0 * world / divisor)  # sum(terms_r) / (D / W)
    assert (grad / world).item() == pytest.approx(1 / divisor)  # after FSDP's mean over W ranks: 1 / D


@pytest.mark.parametrize("normalizer", ["token", "sequence", "constant"])
def test_normalized_loss_without_any_trained_unit_is_zero_with_zero_gradient(normalizer):
    # D = 0 (no trained token on any rank): the loss is 0 and its gradient 0, not NaN.
    lengths = torch.tensor([0, 0])  # two padding sequences
    per_sequence = normalizer == "sequence"
    terms = torch.zeros(2 if per_sequence else 0, dtype=torch.float64, requires_grad=True)
    inputs = LossInputs(torch.zeros(0), torch.zeros(0), torch.zeros(0), torch.zeros(0, dtype=torch.long),
                        sequence_lengths=lengths)
    assert inputs.num_tokens_global == inputs.num_sequences_global == 0
    loss = normalized_loss(LossOutput(terms, normalizer, torch.zeros(0, dtype=torch.bool), {}), inputs, 4, 2)
    (grad,) = torch.autograd.grad(loss, (terms,))
    assert loss.item() == 0.0 and torch.isfinite(grad).all() and (grad == 0).all()


def test_registry_errors_and_import_path():
    fn, options = get_loss("grpo.clipped_losses:ClippedOptions")
    assert fn is get_loss("grpo")[0] and options == type(LOSSES["grpo"])()
    with pytest.raises(ValueError, match="unknown loss 'ppo'.*score_centering"):
        get_loss("ppo")
    with pytest.raises(ValueError, match="already registered"):
        register_loss("score_centering", SC)(lambda inputs, options: None)
    with pytest.raises(ValueError, match="own options dataclass"):
        register_loss("another_centering", SC)(lambda inputs, options: None)


def test_cli_lists_every_loss_and_parses_its_options(capsys):
    import tyro

    from grpo.config import AsyncGRPOConfig

    with pytest.raises(SystemExit):
        tyro.cli(AsyncGRPOConfig, args=["--help"])
    help_text = capsys.readouterr().out
    for name in ALL_LOSSES:
        assert f"loss:{name.replace('_', '-')}" in help_text, name
    config = tyro.cli(AsyncGRPOConfig, args=["loss:dapo", "--loss.epsilon-high", "0.3", "advantage:rloo"])
    assert config.loss == dataclasses.replace(LOSSES["dapo"], epsilon_high=0.3)
    assert type(config.advantage).__name__ == "RlooOptions" and config.num_sampler_logprobs == 0
    assert AsyncGRPOConfig().num_sampler_logprobs == SC.num_sampler_logprobs == 8  # declared by the default loss
    assert sampler_needs(LOSSES["gspo"]).top_logprobs == 0


def test_import_path_hook_runs_the_same_checks(monkeypatch):
    """The documented hook: a module named in $GRPO_PLUGIN_MODULES registers its loss, which then gets every check."""
    monkeypatch.setenv(LOSS_MODULES_ENV, "example_custom_loss")
    assert "example_reinforce" in registered_losses()
    check_loss("example_reinforce")
    case = hand_case_for("example_reinforce")  # shipped in the loss's own module
    assert not matches(case, run_case("example_reinforce", case)) and not coverage_problems("example_reinforce", case)
    fn, options = get_loss("example_custom_loss:ExampleOptions")
    assert fn.__name__ == "example_reinforce" and options.scale == 1.0


FORK_LOSS = '''
"""A fork's loss without a hand-computed case."""
from dataclasses import dataclass
from grpo.losses import LossOutput, register_loss, sampling_metrics

@dataclass(frozen=True)
class CaselessOptions:
    scale: float = 1.0

@register_loss("caseless_reinforce", CaselessOptions())
def caseless_reinforce(inputs, opts):
    """REINFORCE without a case."""
    kept = inputs.sampler_logprobs > -9999.0
    raw = (inputs.policy_logprobs.detach() - inputs.sampler_logprobs).exp()
    return LossOutput(-opts.scale * inputs.advantages * inputs.policy_logprobs, "token", kept,
                      {k: v.detach() for k, v in sampling_metrics(inputs, raw, kept).items()})
'''


def test_a_plugin_loss_without_a_hand_case_fails_with_how_to_add_one(tmp_path):
    import os
    import subprocess
    import sys
    from pathlib import Path

    (tmp_path / "fork_caseless.py").write_text(FORK_LOSS)
    repo = Path(__file__).resolve().parents[1]
    env = os.environ | {"GRPO_PLUGIN_MODULES": "fork_caseless",
                        "PYTHONPATH": os.pathsep.join([str(tmp_path), str(repo), os.environ.get("PYTHONPATH", "")])}
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k",
                          "caseless_reinforce"], env=env, capture_output=True, text=True, timeout=300, cwd=repo)
    assert run.returncode == 1, run.stdout[-2000:]
    assert "test_every_loss_ships_a_hand_computed_case[caseless_reinforce]" in run.stdout
    assert "register_hand_case('caseless_reinforce'" in run.stdout
    assert "passed" in run.stdout  # its invariants ran (and pass): only the missing case fails
