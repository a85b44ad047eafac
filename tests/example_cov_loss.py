"""A covariance-selected loss as a fork would write it (KL-Cov, Cui et al., "The Entropy Mechanism of
Reinforcement Learning for Reasoning Language Models", arXiv 2505.22617): one file, no core edit
(`GRPO_PLUGIN_MODULES=example_cov_loss`). Tokens whose centred covariance between log p and the advantage exceeds
a threshold get a KL-like penalty kl_coef (log p - log q)^2 on top of the importance-weighted policy gradient.

The covariance is a statistic over the row the loss is given, not over the token's own sequence: the options say
so (`statistic_scope = "row"`, grpo/losses.py) and the kit checks that documented behaviour instead of the
sequence-split normaliser invariants. Departures from the paper: a threshold instead of a top-k fraction (a
fraction of a row's tokens is not the same fraction of its copies' union), the squared log ratio instead of its
absolute value (smooth at 0, so on-policy it is plain REINFORCE).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from grpo.loss_kit import HandCase, register_hand_case
from grpo.losses import SAMPLER_NEG_INF, LossInputs, LossOutput, register_loss, sampling_metrics


@dataclass(frozen=True)
class KlCovOptions:
    kl_coef: float = 1.0
    """Weight of the (log p - log q)^2 penalty on the selected tokens."""
    cov_threshold: float = 0.05
    """A token is selected when (log p - row mean)(A - row mean) exceeds this."""
    statistic_scope: ClassVar[str] = "row"  # the covariance is centred over the row the loss is given


@register_loss("kl_cov", KlCovOptions())
def kl_cov(inputs: LossInputs, opts: KlCovOptions) -> LossOutput:
    """KL-Cov (arXiv 2505.22617): importance-weighted policy gradient, KL penalty on high-covariance tokens."""
    kept = inputs.sampler_logprobs > SAMPLER_NEG_INF  # [M]
    log_ratio = torch.where(kept, inputs.policy_logprobs - inputs.sampler_logprobs,
                            torch.zeros_like(inputs.policy_logprobs))  # [M]
    count = kept.to(log_ratio.dtype).sum().clamp_min(1.0)
    logp = torch.where(kept, inputs.policy_logprobs.detach(), torch.zeros_like(log_ratio))
    advantages = torch.where(kept, inputs.advantages, torch.zeros_like(log_ratio))
    covariance = (logp - logp.sum() / count) * (advantages - advantages.sum() / count)  # [M], row-centred
    selected = kept & (covariance > opts.cov_threshold)
    penalty = opts.kl_coef * log_ratio ** 2
    terms = torch.where(kept, -log_ratio.exp() * inputs.advantages, torch.zeros_like(log_ratio))
    terms = terms + torch.where(selected, penalty, torch.zeros_like(penalty))
    raw_ratio = (inputs.policy_logprobs.detach() - inputs.sampler_logprobs).exp()
    metrics = {k: v.detach() for k, v in sampling_metrics(inputs, raw_ratio, kept).items()}
    metrics["kl_cov/selected_frac"] = (selected.float().sum() / count).detach()
    return LossOutput(terms, "token", kept, metrics)


# by hand: log r = (0.4, -0.2, -0.4, 0.2), A = (1, 1, -1, -1): row means 0 (log p = -1 + log r, mean -1), so the
# covariance is log r * A = (0.4, -0.2, 0.4, -0.2); threshold 0.1 selects tokens 0 and 2; kl_coef 0.5.
# loss = (-e^0.4 - e^-0.2 + e^-0.4 + e^0.2 + 0.5 (0.16 + 0.16)) / 4; d/d log p = (-r A + 2 kl_coef log r [selected]) / 4
_R = (math.exp(0.4), math.exp(-0.2), math.exp(-0.4), math.exp(0.2))
register_hand_case("kl_cov", HandCase(
    ratios=_R, advantages=(1.0, 1.0, -1.0, -1.0), sequence_index=(0, 0, 1, 1),
    loss=(-_R[0] - _R[1] + _R[2] + _R[3] + 0.5 * 0.32) / 4,
    grad=((-_R[0] + 0.4) / 4, -_R[1] / 4, (_R[2] - 0.4) / 4, _R[3] / 4),
    overrides={"kl_coef": 0.5, "cov_threshold": 0.1}, metrics={"kl_cov/selected_frac": 0.5}))
