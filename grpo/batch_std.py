"""Batch-level std normalisation of the advantages (the per-step batch transform hook's first user).

Every advantage of the step is divided by the population std of the step's rollout advantages (+ std_eps); the
mean is left alone, so a zero advantage stays zero. With `advantage:no-std` this is the group-mean / batch-std
normalisation of REINFORCE++-style baselines and ScaleRL's batch-level advantage normalisation (arXiv 2510.13786).
"""

from __future__ import annotations

from dataclasses import dataclass

from grpo.advantage_kit import TransformCase, register_transform_case
from grpo.advantages import STD_EPS, AdvantageBatch, register_batch_transform


@dataclass(frozen=True)
class BatchStdOptions:
    """Options of batch_std."""

    std_eps: float = STD_EPS
    """Added to the step's std before dividing (`--transform.batch-std.std-eps`)."""


@register_batch_transform("batch_std", BatchStdOptions())
def batch_std(batch: AdvantageBatch, opts: BatchStdOptions):
    """Divide every advantage by the std of the step's rollout advantages (group-mean / batch-std with no_std)."""
    return batch.advantages / (batch.advantages.std() + opts.std_eps)


# by hand: advantages (3, -1, 0, -2), mean 0, population std sqrt((9 + 1 + 0 + 4) / 4) = sqrt(3.5); with
# std_eps 0.5 every advantage is divided by sqrt(3.5) + 0.5 (the eps is large so that the case sees it)
register_transform_case("batch_std", TransformCase(
    advantages=(3.0, -1.0, 0.0, -2.0), group_ids=(0, 0, 1, 1), overrides={"std_eps": 0.5},
    want=tuple(a / (3.5 ** 0.5 + 0.5) for a in (3.0, -1.0, 0.0, -2.0))))
