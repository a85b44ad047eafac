"""Importance-weighted policy gradient: -sg(w) A log p with truncated or masked importance weights (TIS / MIS /
CISPO), per token or per sequence.

The weight corrects for sampling from q (vLLM, possibly stale) instead of the trainer's p. Truncation bounds it
(TIS, Yao et al. "Your efficient RL framework secretly brings you off-policy RL training", 2025; CISPO,
MiniMax-M1 arXiv 2506.13585, which clamps at 1 + epsilon_high with no lower bound); masking removes tokens or
sequences whose weight leaves the band (MIS / IcePop, Ring-1T arXiv 2510.18855). Tokens whose sampler logprob is
vLLM's -inf stand-in (-9999) are always removed: their ratio is meaningless. At sequence level the same rule holds
for mask and truncate alike: such a token leaves the sequence's product of ratios and the loss, and the rest of its
sequence is weighted by the product over its other tokens (it does not mask the whole sequence).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from grpo.losses import (SAMPLER_NEG_INF, LossInputs, LossOutput, Normalizer, in_band, per_token, register_loss,
                         sequence_mean, sequence_sum, standard_metrics)


@dataclass(frozen=True)
class ImportanceSampledOptions:
    """Options of the importance-weighted policy gradient."""

    vllm_importance_sampling_mode: Literal["token_truncate", "token_mask", "sequence_truncate",
                                           "sequence_mask"] = "token_truncate"
    """Weight level (`token`: w_t = p/q of the token; `sequence`: w = prod_t p/q over the sequence's tokens, on each;
    tokens with the sampler's -9999 placeholder leave the product and the loss, not the rest of their sequence)
    x what happens outside [clip_min, clip_max] (`truncate`: clamp the weight; `mask`: drop the token/sequence)."""
    vllm_importance_sampling_clip_min: float = 0.0
    """Lower end of the weight band."""
    vllm_importance_sampling_clip_max: float = 2.0
    """Upper end of the weight band."""
    normalizer: Normalizer = "token"
    """What the summed terms are divided by (see grpo.losses.Normalizer)."""


def _presets():
    return (
        ("tis", ImportanceSampledOptions(),
         "Token-level truncated importance sampling (TIS): w_t = min(p/q, 2)."),
        ("mis", ImportanceSampledOptions("token_mask", 0.5, 2.0),
         "Token-level masked importance sampling (MIS / IcePop, arXiv 2510.18855): drop tokens with p/q outside "
         "[0.5, 2]."),
        ("sequence_tis", ImportanceSampledOptions("sequence_truncate", 0.0, 2.0),
         "Sequence-level truncated importance sampling: w = min(prod_t p/q, 2) on every token of the sequence."),
        ("sequence_mis", ImportanceSampledOptions("sequence_mask", 0.5, 2.0),
         "Sequence-level masked importance sampling: drop sequences with prod_t p/q outside [0.5, 2]."),
        ("cispo", ImportanceSampledOptions("token_truncate", 0.0, 1.28),
         "CISPO (MiniMax-M1, arXiv 2506.13585): w_t = clip(p/q, 0, 1 + 0.28), token mean."),
    )


def importance_weighted(inputs: LossInputs, opts: ImportanceSampledOptions) -> LossOutput:
    """Importance-weighted REINFORCE: l_t = -sg(w) A_t log p(y_t); w truncated or masked, per token or sequence.

    On-policy w = 1 and the gradient is plain REINFORCE. The weight is detached (the score function carries the
    gradient), as in TIS and CISPO; unlike PPO's clip, a truncated token keeps its gradient.
    """
    import torch

    level, _, mode = opts.vllm_importance_sampling_mode.partition("_")
    low, high = opts.vllm_importance_sampling_clip_min, opts.vllm_importance_sampling_clip_max
    valid = inputs.sampler_logprobs > SAMPLER_NEG_INF  # [M]
    log_ratio = torch.where(valid, inputs.policy_logprobs.detach() - inputs.sampler_logprobs,
                            torch.zeros_like(inputs.sampler_logprobs))  # [M]
    raw_ratio = torch.where(valid, log_ratio.exp(), torch.full_like(log_ratio, float("inf")))  # metrics
    if level == "sequence":
        # [M] prod_t r_t over the valid tokens of the token's sequence (invalid ones contribute log r = 0)
        ratio = per_token(sequence_sum(log_ratio, inputs).exp(), inputs)
    else:
        ratio = log_ratio.exp()
    if mode == "mask":
        kept = valid & in_band(ratio, low, high)  # sequence level: an invalid token leaves only itself
        weight = torch.where(kept, ratio, torch.zeros_like(ratio))
    else:
        kept = valid
        weight = torch.where(kept, ratio.clamp(low, high), torch.zeros_like(ratio))
    terms = -weight * inputs.advantages * torch.where(kept, inputs.policy_logprobs,
                                                      torch.zeros_like(inputs.policy_logprobs))
    if opts.normalizer == "sequence":
        terms = sequence_mean(terms, inputs)
    metrics = standard_metrics(inputs, raw_ratio, kept, ratio, kept, low, high)
    return LossOutput(terms, opts.normalizer, kept, metrics)


for _name, _options, _description in _presets():
    register_loss(_name, _options, _description)(importance_weighted)
