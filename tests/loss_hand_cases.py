"""The built-in losses' hand-computed off-policy cases (grpo/loss_kit.py registers them; tests/test_losses.py checks
them). A fork registers its loss's case in the loss's own module instead.

Two sequences, sampler log q = -1 everywhere, r = p / q per token:
  sequence 0 (A = +1): r = 1.5, 0.9        sequence 1 (A = -2): r = 0.6, 1.1, 6.0 (6.0 is outside the [0.5, 5] band)
Counts: 5 tokens, 2 sequences, max_completion_length 4; one rank, no accumulation. `grad` is d loss / d log p.
Where a preset's two bounds are equal (grpo's epsilon = epsilon_high = 0.2) the case sets them apart, so that code
which reads one where the other belongs fails it.
"""

from __future__ import annotations

import math

from grpo.loss_kit import HandCase, register_hand_case

RATIOS = (1.5, 0.9, 0.6, 1.1, 6.0)
ADVANTAGES = (1.0, 1.0, -2.0, -2.0, -2.0)
SEQUENCES = (0, 0, 1, 1, 1)
LOGP = tuple(-1.0 + math.log(r) for r in RATIOS)
EPS_HIGH = {"epsilon": 0.2, "epsilon_high": 0.28}


def _case(loss, grad, overrides=None, **kw) -> HandCase:
    return HandCase(RATIOS, ADVANTAGES, SEQUENCES, loss, tuple(grad), dict(overrides or {}), **kw)


def _is_case(weights, normaliser=5.0, **kw) -> HandCase:
    """Importance-weighted REINFORCE by hand: loss = sum(-w A log p) / D, grad = -w A / D."""
    value = sum(-w * a * lp for w, a, lp in zip(weights, ADVANTAGES, LOGP)) / normaliser
    return _case(value, [-w * a / normaliser for w, a in zip(weights, ADVANTAGES)], **kw)


# Clipped surrogate, clip [0.8, 1.28]: token terms -1.28 (1.5 clipped high, A > 0), -0.9, +1.6 (0.6 clipped low at
# 0.8, A < 0), +2.2, 0 (6.0 masked by the band). Swapping the epsilons clips at 1.2 and 0.72 instead.
_TOKENS = (-1.28, -0.9, 1.6, 2.2)
_S0 = math.sqrt(1.5 * 0.9)  # GSPO / GMPO sequence 0: geometric mean of 1.5 and 0.9 = 1.162 (token 4 masked)
_G1 = math.exp((-0.3 + math.log(1.1)) / 2)  # GMPO sequence 1: log 0.6 = -0.51 clipped to -0.3 (A < 0)

CASES = {
    "clipped_surrogate": _case(sum(_TOKENS) / 5, [0, -0.9 / 5, 0, 2.2 / 5, 0], EPS_HIGH),
    "grpo": _case(((-1.28 - 0.9) / 2 + (1.6 + 2.2) / 3) / 2, [0, -0.9 / 4, 0, 2.2 / 6, 0], EPS_HIGH),
    "dapo": _case(sum(_TOKENS) / 5, [0, -0.9 / 5, 0, 2.2 / 5, 0]),  # its defaults: 0.2 / 0.28
    "dr_grpo": _case(sum(_TOKENS) / (2 * 4), [0, -0.9 / 8, 0, 2.2 / 8, 0], EPS_HIGH),
    # GSPO with clip [0.85, 1.25] (its 3e-4 would clip both sequences): s0 = 1.162 inside -> term -s0 with
    # d s0 / d log p_t = s0 / 2 per kept token; s1 = sqrt(0.6 * 1.1) = 0.812 < 0.85 with A = -2 -> the clipped
    # constant -(-2 * 0.85) = 1.7, no gradient. One term per sequence, / 2 sequences.
    "gspo": _case((-_S0 + 1.7) / 2, [-_S0 / 4, -_S0 / 4, 0, 0, 0], {"epsilon": 0.15, "epsilon_high": 0.25}),
    # DeepSeek-V3.2: sequence i is dropped iff A_i < 0 and (1/|o_i|) sum_t log(q/p) > 0.1, over ALL its tokens.
    # Sequence 1 (A < 0): -(log 0.6 + log 1.1 + log 6.0) / 3 = -0.459 <= 0.1: kept (6.0 leaves by the band only),
    # so the terms are DAPO's. (The case that drops one is test_off_policy_mask_statistic_is_over_all_tokens.)
    "off_policy_masked": _case(sum(_TOKENS) / 5, [0, -0.9 / 5, 0, 2.2 / 5, 0]),
    # GMPO, log-space clip [-0.3, 0.45]: log 1.5 = 0.405 stays (A > 0, below 0.45), log 0.6 = -0.51 -> -0.3 (A < 0);
    # term -A_i exp(mean of the kept log ratios), sequence mean over 2 sequences.
    "gmpo": _case((-_S0 + 2 * _G1) / 2, [-_S0 / 4, -_S0 / 4, 0, _G1 / 2, 0], {"epsilon": 0.3, "epsilon_high": 0.45}),
    "tis": _is_case((1.5, 0.9, 0.6, 1.1, 2.0)),  # truncated at 2
    "mis": _is_case((1.5, 0.9, 0.6, 1.1, 0.0)),  # 6.0 outside [0.5, 2]
    "sequence_tis": _is_case((1.35, 1.35, 2.0, 2.0, 2.0)),  # products 1.35 and 3.96 -> 2
    "sequence_mis": _is_case((1.35, 1.35, 0.0, 0.0, 0.0)),
    "cispo": _is_case((1.28, 0.9, 0.6, 1.1, 1.28)),
    # K = 0 top logprobs: no centering term, masked IS with w(r) = r inside [0.5, 5]. Its epsilons only feed the
    # clip_ratio metrics, over the 4 kept tokens with [0.8, 1.4]: 1.5 > 1.4 with A > 0 (high), 0.6 < 0.8 with A < 0
    # (low): 1/4 each.
    "score_centering": _is_case((1.5, 0.9, 0.6, 1.1, 0.0), overrides={"epsilon": 0.2, "epsilon_high": 0.4},
                                metrics={"clip_ratio/low_mean": 0.25, "clip_ratio/high_mean": 0.25}),
}
for _name, _case_value in CASES.items():
    register_hand_case(_name, _case_value)
