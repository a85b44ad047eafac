"""Policy losses: pure functions `loss(inputs, cfg) -> (per_token_loss [M], metrics)` and their registry.

Every tensor is over the M trained tokens of one micro-batch row (algorithms.md sections 5-6). A loss never calls
the model or torch.distributed: the caller turns `per_token_loss` into the step's loss with `normalized_loss`
(section 6.4), the one place that knows about ranks and accumulation steps.

Adding a variant: write `fn(inputs: LossInputs, cfg: LossConfig) -> (per_token_loss, metrics)` under
`@register_loss("name")` (or anywhere, and pass `--loss pkg.module:fn`). tests/test_losses.py runs its invariants
(on-policy = plain policy gradient, masked tokens carry no sampled-token gradient, ...) on every registered loss.

How this departs from the textbook:
- The "old policy" is the sampler itself (vLLM's processed logprobs), so one ratio covers staleness and the
  train/inference mismatch; there is no reference model and no KL term.
- Masked importance sampling (IcePop / MIS, Ring-1T arXiv 2510.18855): tokens whose ratio falls outside
  [is_clip_min, is_clip_max] leave the loss instead of being clamped.
- Score centering (Marek and Ryabinin, arXiv 2609.20807) subtracts the sampler-expected score at each position,
  estimated on the sampler's top-k ids with the unseen tail modelled as the trainer's tail rescaled.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

if TYPE_CHECKING:
    from grpo.config import AsyncGRPOConfig

SAMPLER_NEG_INF = -9999.0
"""vLLM reports -inf logprobs as -9999.0; anything at or below it is treated as -inf (vllm.md section 3)."""
TAIL_FLOOR = 1e-6
"""Floor of the tail masses 1 - P_t and 1 - Q_t in the tail ratio; below it the top-k set covers the support."""


@dataclass(frozen=True)
class LossConfig:
    """The few run settings a loss reads."""

    epsilon: float = 0.2
    """Lower trust-region width: the surrogate clips r at 1 - epsilon."""
    epsilon_high: float = 0.2
    """Upper trust-region width: the surrogate clips r at 1 + epsilon_high."""
    is_clip_min: float = 0.5
    """Lower end of the masked importance-sampling band (vllm_importance_sampling_clip_min)."""
    is_clip_max: float = 5.0
    """Upper end of the band (vllm_importance_sampling_clip_max)."""

    @classmethod
    def from_run_config(cls, cfg: AsyncGRPOConfig) -> LossConfig:
        return cls(epsilon=cfg.epsilon, epsilon_high=cfg.epsilon_high_value,
                   is_clip_min=cfg.vllm_importance_sampling_clip_min,
                   is_clip_max=cfg.vllm_importance_sampling_clip_max)


@dataclass
class LossInputs:
    """One row's trained tokens, each tensor named by the model that produced it."""

    policy_logprobs: Tensor  # [M] trainer log p(y_t), with grad
    sampler_logprobs: Tensor  # [M] vLLM's processed log q(y_t) at sampling time
    advantages: Tensor  # [M] the rollout's advantage, repeated per token
    sample_id: Tensor  # [M] int, which training sample each token belongs to (per-completion clip metrics)
    policy_top_logprobs: Tensor | None = None  # [M, K] trainer log p at the sampler's top-k ids, -inf = padding
    sampler_top_logprobs: Tensor | None = None  # [M, K] vLLM's log q at those ids, <= -9999 = -inf

    def __post_init__(self) -> None:
        m = self.policy_logprobs.shape
        for name in ("sampler_logprobs", "advantages", "sample_id"):
            shape = getattr(self, name).shape
            if shape != m:
                raise ValueError(f"LossInputs.{name} must have shape {tuple(m)}, got {tuple(shape)}")
        if (self.policy_top_logprobs is None) != (self.sampler_top_logprobs is None):
            raise ValueError("pass both policy_top_logprobs and sampler_top_logprobs, or neither")
        if self.policy_top_logprobs is not None:
            policy_shape, sampler_shape = self.policy_top_logprobs.shape, self.sampler_top_logprobs.shape
            if policy_shape != sampler_shape or policy_shape[:1] != m:
                raise ValueError(f"top logprobs must both be [M, K] with M = {m[0]}, got {tuple(policy_shape)} "
                                 f"and {tuple(sampler_shape)}")


LossFn = Callable[[LossInputs, LossConfig], tuple[Tensor, dict[str, Tensor]]]
LOSSES: dict[str, LossFn] = {}


def register_loss(name: str) -> Callable[[LossFn], LossFn]:
    """Decorator adding a loss to `LOSSES` under `name` (selectable as `--loss name`)."""

    def add(fn: LossFn) -> LossFn:
        if name in LOSSES:
            raise ValueError(f"loss {name!r} is already registered (by {LOSSES[name].__module__})")
        LOSSES[name] = fn
        return fn

    return add


def get_loss(name_or_path: str) -> LossFn:
    """A registered loss by name, or any function by import path `pkg.module:fn`."""
    if name_or_path in LOSSES:
        return LOSSES[name_or_path]
    if ":" not in name_or_path:
        raise ValueError(f"unknown loss {name_or_path!r}: use one of {sorted(LOSSES)} or an import path "
                         f"'pkg.module:function'")
    module_name, _, attr = name_or_path.partition(":")
    fn = getattr(importlib.import_module(module_name), attr, None)
    if not callable(fn):
        raise ValueError(f"{name_or_path!r} does not name a function in {module_name}; registered losses: "
                         f"{sorted(LOSSES)}")
    return fn


def normalized_loss(per_token_loss: Tensor, num_tokens_global: int | Tensor, world_size: int,
                    grad_accum: int) -> Tensor:
    """This rank's micro-batch loss: sum of its terms / max(N_glob / W, 1) / GA (algorithms.md 6.4).

    FSDP averages gradients over the W ranks, so each micro-batch contributes the token mean over all ranks and the
    step averages its GA micro-batches. N_glob counts every trained token, masked and zero-advantage ones included.
    """
    tokens_per_rank = max(float(num_tokens_global) / world_size, 1.0)
    return per_token_loss.sum() / tokens_per_rank / grad_accum


# ---- shared pieces: ratio, masking band, metrics ------------------------------------------------------------------

def in_band(ratio: Tensor, cfg: LossConfig) -> Tensor:
    """Masked importance sampling: True where is_clip_min <= ratio <= is_clip_max (False for NaN)."""
    return (ratio >= cfg.is_clip_min) & (ratio <= cfg.is_clip_max)


def band_weight(ratio: Tensor, cfg: LossConfig) -> Tensor:
    """w(x) = x inside the band, 0 outside (algorithms.md 6.2)."""
    return torch.where(in_band(ratio, cfg), ratio, torch.zeros_like(ratio))


def sampled_token_ratio(inputs: LossInputs, cfg: LossConfig) -> tuple[Tensor, Tensor, Tensor]:
    """(ratio r_t with grad [M], in-band mask m_t [M], raw detached ratio [M] for metrics).

    Out-of-band ratios are replaced by a constant 1 before the exp: a masked ratio can be inf (q reported as
    -9999), and exp's backward would turn its zero gradient into 0 * inf = NaN.
    """
    log_ratio = inputs.policy_logprobs - inputs.sampler_logprobs  # [M]
    raw_ratio = log_ratio.detach().exp()
    mask = in_band(raw_ratio, cfg)
    ratio = torch.where(mask, log_ratio, torch.zeros_like(log_ratio)).exp()
    return ratio, mask, raw_ratio


def sampling_metrics(inputs: LossInputs, raw_ratio: Tensor, mask: Tensor) -> dict[str, Tensor]:
    """`sampling/*` over all trained tokens, before masking (NaN for an empty row)."""
    logp_diff = (inputs.policy_logprobs.detach() - inputs.sampler_logprobs).abs()  # [M]
    return {
        "sampling/importance_sampling_ratio/min": _reduce(raw_ratio, torch.min),
        "sampling/importance_sampling_ratio/mean": _reduce(raw_ratio, torch.mean),
        "sampling/importance_sampling_ratio/max": _reduce(raw_ratio, torch.max),
        "sampling/masked_mean": _reduce((~mask).float(), torch.mean),
        "sampling/sampling_logp_difference/mean": _reduce(logp_diff, torch.mean),
        "sampling/sampling_logp_difference/max": _reduce(logp_diff, torch.max),
    }


def clip_metrics(raw_ratio: Tensor, advantages: Tensor, mask: Tensor, sample_id: Tensor,
                 cfg: LossConfig) -> dict[str, Tensor]:
    """`clip_ratio/*` over unmasked tokens: tokens the surrogate clips, i.e. outside the trust region (6.3)."""
    low = (raw_ratio < 1 - cfg.epsilon) & (advantages < 0) & mask  # [M]
    high = (raw_ratio > 1 + cfg.epsilon_high) & (advantages > 0) & mask
    kept = mask.float()
    completions, completion = torch.unique(sample_id, return_inverse=True)  # [M] -> 0..num_completions-1
    num = completions.numel()
    per_completion_kept = _per_completion_sum(kept, completion, num)
    has_tokens = per_completion_kept > 0
    low_frac = _per_completion_sum(low.float(), completion, num)[has_tokens] / per_completion_kept[has_tokens]
    high_frac = _per_completion_sum(high.float(), completion, num)[has_tokens] / per_completion_kept[has_tokens]
    num_kept = kept.sum()
    return {
        "clip_ratio/low_mean": low.float().sum() / num_kept,
        "clip_ratio/high_mean": high.float().sum() / num_kept,
        "clip_ratio/region_mean": (low | high).float().sum() / num_kept,
        "clip_ratio/low_min": _reduce(low_frac, torch.min),
        "clip_ratio/high_max": _reduce(high_frac, torch.max),
    }


def entropy_metric(entropy: Tensor) -> dict[str, Tensor]:
    """`entropy`: mean token entropy over trained tokens (entropy [M] from grpo.logprobs)."""
    return {"entropy": _reduce(entropy.detach().float(), torch.mean)}


def _per_completion_sum(values: Tensor, completion: Tensor, num: int) -> Tensor:
    return torch.zeros(num, dtype=values.dtype, device=values.device).index_add_(0, completion, values)


def _reduce(values: Tensor, op: Callable[[Tensor], Tensor]) -> Tensor:
    """A detached float scalar; NaN when there is nothing to reduce (the metric logger drops NaNs)."""
    if values.numel() == 0:
        return torch.tensor(float("nan"), device=values.device)
    return op(values.detach().float())


def _metrics(inputs: LossInputs, raw_ratio: Tensor, mask: Tensor, cfg: LossConfig) -> dict[str, Tensor]:
    metrics = sampling_metrics(inputs, raw_ratio, mask)
    metrics.update(clip_metrics(raw_ratio, inputs.advantages, mask, inputs.sample_id, cfg))
    return {name: value.detach() for name, value in metrics.items()}


# ---- losses (the research region: fork here) ----------------------------------------------------------------------

@register_loss("clipped_surrogate")
def clipped_surrogate(inputs: LossInputs, cfg: LossConfig) -> tuple[Tensor, dict[str, Tensor]]:
    """GRPO/PPO clipped surrogate with the sampler as old policy (6.1): -m * min(r A, clip(r, 1-eps, 1+eps_high) A)."""
    ratio, mask, raw_ratio = sampled_token_ratio(inputs, cfg)  # [M]
    advantages = inputs.advantages
    clipped = torch.clamp(ratio, 1 - cfg.epsilon, 1 + cfg.epsilon_high)
    surrogate = torch.minimum(ratio * advantages, clipped * advantages)  # [M]
    per_token_loss = -torch.where(mask, surrogate, torch.zeros_like(surrogate))
    return per_token_loss, _metrics(inputs, raw_ratio, mask, cfg)


@register_loss("score_centering")
def score_centering(inputs: LossInputs, cfg: LossConfig) -> tuple[Tensor, dict[str, Tensor]]:
    """Masked-IS policy gradient minus the sampler-expected score at each position (6.2).

    l_t = -A_t [ sg(w(r_t)) log p(y_t) - sum_{a in H_t} c_{t,a} log p(a) ]. The band mask acts through w only: a
    masked sampled token loses its own term, but the centering term of its position stays, because it is an
    expectation over every y ~ q and does not depend on which y was drawn (vime does the same). Only the gradient
    is meaningful; the value is not a surrogate objective.

    Reading the estimator: with every ratio of a position inside the band, q_a w(p_a / q_a) = p_a and alpha_t = 1,
    so the residuals vanish (the IS-weighted score already averages to zero). The centering term is the
    correction for the mass the band removes, estimated on the top-k ids and the tail model.
    """
    if inputs.policy_top_logprobs is None:
        raise ValueError("score_centering needs policy_top_logprobs and sampler_top_logprobs (num_sampler_logprobs "
                         "> 0 on the worker, top_ids passed to policy_token_logprobs); or use --loss clipped_surrogate")
    _, mask, raw_ratio = sampled_token_ratio(inputs, cfg)
    sampled_weight = torch.where(mask, raw_ratio, torch.zeros_like(raw_ratio))  # [M] sg(w(r_t))
    sampled_term = torch.where(mask, sampled_weight * inputs.policy_logprobs, torch.zeros_like(raw_ratio))
    residuals, sampler_mass = centering_residuals(inputs.policy_top_logprobs, inputs.sampler_top_logprobs, cfg)
    in_top = torch.isfinite(inputs.policy_top_logprobs)  # [M, K]
    top_logprobs = torch.where(in_top, inputs.policy_top_logprobs, torch.zeros_like(residuals))
    centering_term = (residuals * top_logprobs).sum(dim=-1)  # [M]
    per_token_loss = -inputs.advantages * (sampled_term - centering_term)
    metrics = _metrics(inputs, raw_ratio, mask, cfg)
    metrics["sampling/sampler_mass"] = _reduce(sampler_mass, torch.mean)
    return per_token_loss, metrics


def centering_residuals(policy_top_logprobs: Tensor, sampler_top_logprobs: Tensor,
                        cfg: LossConfig) -> tuple[Tensor, Tensor]:
    """(detached residuals c [M, K], sampler mass Q_t [M]) on H_t = the sampler's top-k ids.

    c_a = q_a w(p_a / q_a) - alpha_t p_a. The tail outside H_t is modelled as q_v = rho_t p_v with
    rho_t = (1 - Q_t) / (1 - P_t); since sum_v grad p_v = 0 its expected score is -alpha_t sum_{a in H} p_a grad
    log p_a with alpha_t = rho_t w(1 / rho_t), which folds into the residuals. Entries with policy -inf (padding,
    ids outside the trainer's support) have p_a = 0 and get c_a = 0; sampler entries <= -9999 have q_a = 0.
    """
    policy_top = policy_top_logprobs.detach()  # [M, K]
    sampler_top = sampler_top_logprobs.to(policy_top.dtype)
    sampler_top = torch.where(sampler_top <= SAMPLER_NEG_INF, torch.full_like(sampler_top, float("-inf")),
                              sampler_top)
    policy_probs = policy_top.exp()  # [M, K], 0 at -inf
    sampler_probs = sampler_top.exp()
    policy_mass = policy_probs.sum(-1)  # [M] P_t
    sampler_mass = sampler_probs.sum(-1)  # [M] Q_t
    tail_ratio = (1 - sampler_mass).clamp_min(TAIL_FLOOR) / (1 - policy_mass).clamp_min(TAIL_FLOOR)  # rho_t
    alpha = tail_ratio * band_weight(1 / tail_ratio, cfg)
    # H_t covers the trainer's support (P_t -> 1): the tail is empty, rho_t is a ratio of rounding errors, and
    # sum_{a in H} p_a grad log p_a = grad P_t = 0 anyway, so drop the tail term rather than amplify noise.
    alpha = torch.where(1 - policy_mass <= TAIL_FLOOR, torch.zeros_like(alpha), alpha)
    # q_a w(p_a / q_a) = p_a inside the band and 0 outside; the log-ratio test is NaN-safe (q_a = 0 -> out of band).
    top_in_band = in_band((policy_top - sampler_top).exp(), cfg)
    expected = torch.where(top_in_band, policy_probs, torch.zeros_like(policy_probs))
    residuals = expected - alpha[:, None] * policy_probs
    return residuals, sampler_mass
