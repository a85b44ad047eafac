"""A loss whose terms are all NaN, for tests/faults/test_nonfinite.py. Registered only in the training subprocess
(GRPO_LOSS_MODULES=faults.nan_loss), so the loss suites that run over every registered loss never see it."""

from __future__ import annotations

from dataclasses import dataclass

from grpo.losses import LossInputs, LossOutput, register_loss, standard_metrics


@dataclass(frozen=True)
class NaNOptions:
    pass


@register_loss("nan_reinforce", NaNOptions())
def nan_reinforce(inputs: LossInputs, opts: NaNOptions) -> LossOutput:
    """REINFORCE whose terms are all NaN: what an overflow anywhere upstream of the loss looks like."""
    kept = inputs.sampler_logprobs > -9999.0
    terms = -inputs.advantages * inputs.policy_logprobs * float("nan")
    ratio = (inputs.policy_logprobs.detach() - inputs.sampler_logprobs).exp()
    return LossOutput(terms, "token", kept, standard_metrics(inputs, ratio, kept, ratio, kept, 0.8, 1.2))
