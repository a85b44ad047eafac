"""Score centering, the default loss: masked-IS policy gradient minus the sampler-expected score at each position.

Marek and Ryabinin, "Score centering for off-policy policy gradients", arXiv 2609.20807. Masked importance
sampling (IcePop / MIS, Ring-1T arXiv 2510.18855): tokens whose ratio p/q falls outside
[vllm_importance_sampling_clip_min, vllm_importance_sampling_clip_max] leave the loss instead of being clamped.
The sampler-expected score is estimated on the sampler's top-k ids, with the unseen tail modelled as the trainer's
tail rescaled (docs/losses.md derives the estimator).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING


from grpo.losses import (SAMPLER_NEG_INF, LossInputs, LossOutput, SamplerNeeds, in_band, reduce, register_loss,
                         sampled_token_ratio, standard_metrics)

if TYPE_CHECKING:
    from torch import Tensor

TAIL_FLOOR = 1e-6
"""Floor of the tail masses 1 - P_t and 1 - Q_t in the tail ratio; below it the top-k set covers the support."""


@dataclass(frozen=True)
class ScoreCenteringOptions:
    """Options of the score-centering loss."""

    vllm_importance_sampling_clip_min: float = 0.5
    """Tokens whose trainer/sampler ratio is below this leave the loss (masked importance sampling)."""
    vllm_importance_sampling_clip_max: float = 5.0
    """Tokens whose ratio is above this leave the loss."""
    num_sampler_logprobs: int = 8
    """Top sampler logprobs requested per token, the support of the centering expectation."""
    epsilon: float = 0.2
    """Trust region the clip_ratio metrics count (below 1 - epsilon); the loss itself does not clip."""
    epsilon_high: float = 0.2
    """Upper end of that metric's trust region (above 1 + epsilon_high)."""

    def sampler_needs(self) -> SamplerNeeds:
        return SamplerNeeds(top_logprobs=self.num_sampler_logprobs)


# ---- the loss (research region: fork here) ------------------------------------------------------------------------

@register_loss("score_centering", ScoreCenteringOptions())
def score_centering(inputs: LossInputs, opts: ScoreCenteringOptions) -> LossOutput:
    """Score centering (arXiv 2609.20807): masked-IS policy gradient minus the sampler-expected score; token mean.

    l_t = -A_t [ sg(w(r_t)) log p(y_t) - sum_{a in H_t} c_{t,a} log p(a) ], w(x) = x inside the band, 0 outside.
    The band mask acts through w only: a masked sampled token loses its own term, but the centering term of its
    position stays, because it is an expectation over every y ~ q and does not depend on which y was drawn. Only
    the gradient is meaningful; the value is not a surrogate objective.

    Reading the estimator: with every ratio of a position inside the band, q_a w(p_a / q_a) = p_a and alpha_t = 1,
    so the residuals vanish (the IS-weighted score already averages to zero). The centering term is the
    correction for the mass the band removes, estimated on the top-k ids and the tail model.
    """
    import torch

    if inputs.policy_top_logprobs is None:
        raise ValueError("score_centering needs policy_top_logprobs and sampler_top_logprobs (num_sampler_logprobs "
                         "> 0 on the worker, top_ids passed to policy_token_logprobs); or use loss:clipped_surrogate")
    low, high = opts.vllm_importance_sampling_clip_min, opts.vllm_importance_sampling_clip_max
    _, mask, raw_ratio = sampled_token_ratio(inputs, low, high)
    sampled_weight = torch.where(mask, raw_ratio, torch.zeros_like(raw_ratio))  # [M] sg(w(r_t))
    sampled_term = torch.where(mask, sampled_weight * inputs.policy_logprobs, torch.zeros_like(raw_ratio))
    residuals, sampler_mass = centering_residuals(inputs.policy_top_logprobs, inputs.sampler_top_logprobs, low, high)
    in_top = torch.isfinite(inputs.policy_top_logprobs)  # [M, K]
    top_logprobs = torch.where(in_top, inputs.policy_top_logprobs, torch.zeros_like(residuals))
    centering_term = (residuals * top_logprobs).sum(dim=-1)  # [M]
    terms = -inputs.advantages * (sampled_term - centering_term)
    metrics = standard_metrics(inputs, raw_ratio, mask, raw_ratio, mask, 1 - opts.epsilon, 1 + opts.epsilon_high)
    metrics["sampling/sampler_mass"] = reduce(sampler_mass, torch.mean)
    return LossOutput(terms, "token", mask, metrics)


def centering_residuals(policy_top_logprobs: Tensor, sampler_top_logprobs: Tensor, low: float,
                        high: float) -> tuple[Tensor, Tensor]:
    """(detached residuals c [M, K], sampler mass Q_t [M]) on H_t = the sampler's top-k ids; band [low, high].

    c_a = q_a w(p_a / q_a) - alpha_t p_a. The tail outside H_t is modelled as q_v = rho_t p_v with
    rho_t = (1 - Q_t) / (1 - P_t); since sum_v grad p_v = 0 its expected score is -alpha_t sum_{a in H} p_a grad
    log p_a with alpha_t = rho_t w(1 / rho_t), which folds into the residuals. Entries with policy -inf (padding,
    ids outside the trainer's support) have p_a = 0 and get c_a = 0; sampler entries <= -9999 have q_a = 0.
    """
    import torch

    policy_top = policy_top_logprobs.detach()  # [M, K]
    sampler_top = sampler_top_logprobs.to(policy_top.dtype)
    sampler_top = torch.where(sampler_top <= SAMPLER_NEG_INF, torch.full_like(sampler_top, float("-inf")),
                              sampler_top)
    policy_probs = policy_top.exp()  # [M, K], 0 at -inf
    sampler_probs = sampler_top.exp()
    policy_mass = policy_probs.sum(-1)  # [M] P_t
    sampler_mass = sampler_probs.sum(-1)  # [M] Q_t
    tail_ratio = (1 - sampler_mass).clamp_min(TAIL_FLOOR) / (1 - policy_mass).clamp_min(TAIL_FLOOR)  # rho_t
    inverse = 1 / tail_ratio
    alpha = tail_ratio * torch.where(in_band(inverse, low, high), inverse, torch.zeros_like(inverse))
    # H_t covers the trainer's support (P_t -> 1): the tail is empty, rho_t is a ratio of rounding errors, and
    # sum_{a in H} p_a grad log p_a = grad P_t = 0 anyway, so drop the tail term rather than amplify noise.
    alpha = torch.where(1 - policy_mass <= TAIL_FLOOR, torch.zeros_like(alpha), alpha)
    # q_a w(p_a / q_a) = p_a inside the band and 0 outside; the log-ratio test is NaN-safe (q_a = 0 -> out of band).
    top_in_band = in_band((policy_top - sampler_top).exp(), low, high)
    expected = torch.where(top_in_band, policy_probs, torch.zeros_like(policy_probs))
    residuals = expected - alpha[:, None] * policy_probs
    return residuals, sampler_mass

