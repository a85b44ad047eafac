"""Batch-level std normalisation of the advantages (the per-step batch transform hook's first user).

Every advantage of the step is divided by the population std of the step's rollout advantages (+ 1e-8); the mean
is left alone, so a zero advantage stays zero. With `advantage:no-std` this is the group-mean / batch-std
normalisation of REINFORCE++-style baselines and ScaleRL's batch-level advantage normalisation (arXiv 2510.13786).
"""

from __future__ import annotations

from grpo.advantages import STD_EPS, AdvantageBatch, register_batch_transform


@register_batch_transform("batch_std")
def batch_std(batch: AdvantageBatch):
    """Divide every advantage by the std of the step's rollout advantages (group-mean / batch-std with no_std)."""
    return batch.advantages / (batch.advantages.std() + STD_EPS)
