"""Trust-region (clipped) policy-gradient losses: GRPO, DAPO, Dr. GRPO, GSPO, off-policy sequence masking, GMPO.

One function per objective; the paper variants of the clipped surrogate are settings of `ClippedOptions`
(ratio level, normaliser, clip range, sequence masking), registered under their paper names. Every loss here
also applies the masked importance-sampling band of the sampler (tokens with p/q outside
[vllm_importance_sampling_clip_min, vllm_importance_sampling_clip_max] leave the loss), because the sampler is the
old policy and its logprobs can disagree with the trainer's beyond any trust region (Ring-1T, arXiv 2510.18855).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from grpo.losses import (SAMPLER_NEG_INF, LossInputs, LossOutput, Normalizer, per_token, register_loss,
                         sampled_token_ratio, sequence_mean, sequence_sum, standard_metrics)

if TYPE_CHECKING:
    from torch import Tensor


@dataclass(frozen=True)
class ClippedOptions:
    """Options of the clipped surrogate -min(r A, clip(r, 1 - epsilon, 1 + epsilon_high) A)."""

    epsilon: float = 0.2
    """Lower clip range: the surrogate clips r at 1 - epsilon."""
    epsilon_high: float = 0.2
    """Upper clip range: the surrogate clips r at 1 + epsilon_high (DAPO clip-higher: 0.28)."""
    ratio_level: Literal["token", "sequence"] = "token"
    """`token`: r_t = p/q per token (GRPO); `sequence`: r = exp(mean_t log p/q) per sequence (GSPO)."""
    normalizer: Normalizer = "sequence"
    """`sequence`: mean over each sequence then over sequences (GRPO); `token`: mean over all tokens (DAPO);
    `constant`: sum / (sequences x max_completion_length) (Dr. GRPO)."""
    off_policy_mask_threshold: float | None = None
    """Drop sequences with A < 0 whose mean log(q/p) over all their tokens exceeds this (DeepSeek-V3.2 off-policy
    sequence masking; tokens with the sampler's -9999 placeholder logprob leave the mean)."""
    vllm_importance_sampling_clip_min: float = 0.5
    """Tokens whose trainer/sampler ratio is below this leave the loss (masked importance sampling)."""
    vllm_importance_sampling_clip_max: float = 5.0
    """Tokens whose ratio is above this leave the loss."""


def _presets():
    """(name, options, description) of the registered settings of the clipped surrogate."""
    return (
        ("clipped_surrogate", ClippedOptions(normalizer="token"),
         "PPO/GRPO clipped surrogate, token-mean normaliser (this project's earlier `clipped_surrogate`)."),
        ("grpo", ClippedOptions(),
         "GRPO (DeepSeekMath, arXiv 2402.03300): token ratio, mean per sequence then over sequences."),
        ("dapo", ClippedOptions(epsilon_high=0.28, normalizer="token"),
         "DAPO (arXiv 2503.14476): clip-higher epsilon_high = 0.28, token-level normaliser."),
        ("dr_grpo", ClippedOptions(normalizer="constant"),
         "Dr. GRPO (arXiv 2503.20783): constant normaliser; pair with advantage:no_std."),
        ("gspo", ClippedOptions(epsilon=3e-4, epsilon_high=4e-4, ratio_level="sequence", normalizer="sequence"),
         "GSPO (arXiv 2507.18071): sequence-level ratio exp(mean log p/q), clip 3e-4 / 4e-4, sequence mean."),
        ("off_policy_masked", ClippedOptions(epsilon_high=0.28, normalizer="token", off_policy_mask_threshold=0.1),
         "DAPO-style clipped surrogate with off-policy sequence masking (DeepSeek-V3.2, arXiv 2512.02556)."),
    )


def clipped_surrogate(inputs: LossInputs, opts: ClippedOptions) -> LossOutput:
    """Clipped surrogate with the sampler as old policy: -m * min(r A, clip(r, 1 - eps, 1 + eps_high) A).

    The ratio is per token (GRPO, arXiv 2402.03300; DAPO, arXiv 2503.14476) or the sequence's geometric mean
    (GSPO, arXiv 2507.18071, over the sequence's in-band tokens); the normaliser is the option's. Off-policy
    sequence masking (DeepSeek-V3.2, arXiv 2512.02556) removes negative-advantage sequences whose sampler drifted
    more than the threshold in mean log(q/p) over all their tokens (`off_policy_drift`), as the paper defines it.
    """
    import torch

    token_ratio, band, raw_ratio = sampled_token_ratio(
        inputs, opts.vllm_importance_sampling_clip_min, opts.vllm_importance_sampling_clip_max)  # [M]
    kept = band
    log_ratio = torch.where(band, inputs.policy_logprobs - inputs.sampler_logprobs,
                            torch.zeros_like(raw_ratio))  # [M]
    kept_per_seq = sequence_sum(band.to(raw_ratio.dtype), inputs).clamp_min(1)  # [S]
    if opts.off_policy_mask_threshold is not None:
        drift = off_policy_drift(inputs)  # [S]
        off_policy = (sequence_mean(inputs.advantages, inputs) < 0) & (drift > opts.off_policy_mask_threshold)
        kept = kept & ~per_token(off_policy, inputs)
    if opts.ratio_level == "sequence":
        sequence_ratio = (sequence_sum(log_ratio, inputs) / kept_per_seq).exp()  # [S] s_i
        ratio = per_token(sequence_ratio, inputs)  # [M] s_i on each token
    else:
        ratio = token_ratio
    advantages = inputs.advantages
    clipped = torch.clamp(ratio, 1 - opts.epsilon, 1 + opts.epsilon_high)
    surrogate = torch.minimum(ratio * advantages, clipped * advantages)  # [M]
    terms = -torch.where(kept, surrogate, torch.zeros_like(surrogate))
    if opts.normalizer == "sequence" and opts.ratio_level == "sequence":
        # one term per sequence (GSPO): its kept tokens all carry -min(s A, clip(s) A); masked ones do not dilute it
        terms = sequence_sum(terms, inputs) / sequence_sum(kept.to(terms.dtype), inputs).clamp_min(1)
    elif opts.normalizer == "sequence":
        terms = sequence_mean(terms, inputs)  # [S] GRPO's 1/|o_i|: removed tokens count in |o_i|
    metrics = standard_metrics(inputs, raw_ratio, kept, ratio.detach(), kept, 1 - opts.epsilon,
                               1 + opts.epsilon_high)
    if opts.off_policy_mask_threshold is not None:
        metrics["sampling/off_policy_masked_frac"] = (band & ~kept).float().mean().detach()
    return LossOutput(terms, opts.normalizer, kept, metrics)


for _name, _options, _description in _presets():
    register_loss(_name, _options, _description)(clipped_surrogate)


def off_policy_drift(inputs: LossInputs) -> Tensor:
    """[S] detached: each sequence's mean log(q/p) = mean_t (log q(y_t) - log p(y_t)), DeepSeek-V3.2's statistic.

    The mean runs over all of the sequence's tokens, the IS band's removed ones included (they are the ones that
    drifted most), except those whose sampler logprob is vLLM's -inf stand-in (<= -9999): their log(q/p) is
    meaningless, so they leave both the sum and the count. A sequence with no other token gets 0 (never masked).
    """
    import torch

    valid = inputs.sampler_logprobs > SAMPLER_NEG_INF  # [M]
    log_q_over_p = torch.where(valid, inputs.sampler_logprobs - inputs.policy_logprobs.detach(),
                               torch.zeros_like(inputs.sampler_logprobs))  # [M]
    count = sequence_sum(valid.to(log_q_over_p.dtype), inputs).clamp_min(1)  # [S]
    return sequence_sum(log_q_over_p, inputs) / count


@dataclass(frozen=True)
class GeometricMeanOptions:
    """Options of GMPO: clipping in log space, geometric mean of the token ratios per sequence."""

    epsilon: float = 0.4
    """Lower clip of log r_t (the ratio is clipped at exp(-epsilon))."""
    epsilon_high: float = 0.4
    """Upper clip of log r_t (at exp(epsilon_high))."""
    vllm_importance_sampling_clip_min: float = 0.5
    """Tokens whose trainer/sampler ratio is below this leave the loss (masked importance sampling)."""
    vllm_importance_sampling_clip_max: float = 5.0
    """Tokens whose ratio is above this leave the loss."""


@register_loss("gmpo", GeometricMeanOptions())
def geometric_mean(inputs: LossInputs, opts: GeometricMeanOptions) -> LossOutput:
    """GMPO (arXiv 2507.20673): -A_i exp(mean_t sgn(A) min(sgn(A) log r_t, sgn(A) clip(log r_t))); sequence mean.

    The geometric mean of the token ratios is less sensitive to outlier ratios than the arithmetic mean GRPO
    takes; token-level clipping happens in log space, in the direction the advantage's sign makes pessimistic.
    """
    import torch

    _, band, raw_ratio = sampled_token_ratio(
        inputs, opts.vllm_importance_sampling_clip_min, opts.vllm_importance_sampling_clip_max)
    log_ratio = torch.where(band, inputs.policy_logprobs - inputs.sampler_logprobs,
                            torch.zeros_like(raw_ratio))  # [M]
    sign = torch.sign(inputs.advantages)
    clipped = torch.clamp(log_ratio, -opts.epsilon, opts.epsilon_high)
    pessimistic = sign * torch.minimum(sign * log_ratio, sign * clipped)  # [M]
    kept_per_seq = sequence_sum(band.to(raw_ratio.dtype), inputs)  # [S]
    sequence_ratio = (sequence_sum(pessimistic, inputs) / kept_per_seq.clamp_min(1)).exp()  # [S]
    sequence_advantage = sequence_mean(inputs.advantages, inputs)  # [S]
    terms = -torch.where(kept_per_seq > 0, sequence_advantage * sequence_ratio, torch.zeros_like(sequence_ratio))
    metrics = standard_metrics(inputs, raw_ratio, band, raw_ratio, band, float(torch.tensor(-opts.epsilon).exp()),
                               float(torch.tensor(opts.epsilon_high).exp()))
    return LossOutput(terms, "sequence", band, metrics)
