"""A loss as a fork would write it outside grpo/: one options dataclass + one function + one registration line.

Used by tests/test_losses.py to exercise the import-path hook (`GRPO_PLUGIN_MODULES=example_custom_loss`); train with
it as `GRPO_PLUGIN_MODULES=example_custom_loss python train.py ... loss:example_reinforce --loss.scale 2`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from grpo.loss_kit import HandCase, register_hand_case
from grpo.losses import LossInputs, LossOutput, register_loss, sampling_metrics


@dataclass(frozen=True)
class ExampleOptions:
    scale: float = 1.0
    """Multiplies the advantages."""


@register_loss("example_reinforce", ExampleOptions())
def example_reinforce(inputs: LossInputs, opts: ExampleOptions) -> LossOutput:
    """Plain REINFORCE, -scale A log p(y), token mean; drops tokens the sampler reported as impossible."""
    kept = inputs.sampler_logprobs > -9999.0
    terms = -opts.scale * inputs.advantages * torch.where(kept, inputs.policy_logprobs,
                                                          torch.zeros_like(inputs.policy_logprobs))
    raw_ratio = (inputs.policy_logprobs.detach() - inputs.sampler_logprobs).exp()
    metrics = {k: v.detach() for k, v in sampling_metrics(inputs, raw_ratio, kept).items()}  # no trust region: no
    return LossOutput(terms, "token", kept, metrics)  # clip_ratio/* (optional; losses with a trust region report it)


# The hand-computed off-policy case every loss ships (grpo/loss_kit.py): log q = -1, log p = -1 + log r; token mean
# of -scale A log p over 4 tokens with scale 2: loss = -2 (1 (-1 + log 1.5) + 1 (-1 + log 0.8)
# - 1 (-1 + log 0.5) - 1 (-1 + log 3)) / 4 = -(log 1.5 + log 0.8 - log 0.5 - log 3) / 2; grad = -2 A / 4.
register_hand_case("example_reinforce", HandCase(
    ratios=(1.5, 0.8, 0.5, 3.0), advantages=(1.0, 1.0, -1.0, -1.0), sequence_index=(0, 0, 1, 1),
    loss=-(math.log(1.5) + math.log(0.8) - math.log(0.5) - math.log(3.0)) / 2, grad=(-0.5, -0.5, 0.5, 0.5),
    overrides={"scale": 2.0}))
