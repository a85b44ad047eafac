"""A loss as a fork would write it outside grpo/: one options dataclass + one function + one registration line.

Used by tests/test_losses.py to exercise the import-path hook (`GRPO_LOSS_MODULES=example_custom_loss`); train with
it as `GRPO_LOSS_MODULES=example_custom_loss python train.py ... loss:example_reinforce --loss.scale 2`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from grpo.losses import LossInputs, LossOutput, register_loss, standard_metrics


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
    return LossOutput(terms, "token", kept, standard_metrics(inputs, raw_ratio, kept, raw_ratio, kept, 0.8, 1.2))
