"""pass@k advantages (Chen et al., "Pass@k Training for Adaptively Balancing Exploration and Exploitation",
arXiv 2508.10751), analytic form, generalised from 0/1 rewards to any reward: the reward of a k-subset of the group
is its best reward, and a rollout's advantage is the mean, over the k-subsets that contain it, of the subset's
reward standardised by the mean and std over all k-subsets. With 0/1 rewards this is the paper's
A_pos = (1 - R) / sigma, A_neg = (1 - R - C(N_neg - 1, k - 1) / C(N - 1, k - 1)) / sigma, R = 1 - C(N_neg, k) / C(N, k).
k = 1 gives group_std. A group with fewer scored rollouts than k uses k = their number.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import comb
from typing import TYPE_CHECKING

from grpo.advantage_kit import EstimatorCase, register_estimator_case
from grpo.advantages import STD_EPS, AdvantageGroup, register_estimator

if TYPE_CHECKING:
    import numpy as np


@dataclass(frozen=True)
class PassAtKOptions:
    """Options of pass_at_k."""

    k: int = 4
    """Subset size: the objective is the expected best reward of k rollouts (pass@k for 0/1 rewards)."""

    def check(self, config) -> None:
        """k fits the group (--num-generations)."""
        if not 1 <= self.k <= config.num_generations:
            raise ValueError(f"advantage:pass-at-k --advantage.k {self.k}: k must be between 1 and "
                             f"--num-generations ({config.num_generations})")


@register_estimator("pass_at_k", PassAtKOptions())
def pass_at_k(group: AdvantageGroup, opts: PassAtKOptions) -> np.ndarray:
    """pass@k training (arXiv 2508.10751): advantage of the expected best-of-k reward, option k."""
    import numpy as np

    rewards = group.rewards
    n = len(rewards)
    if n == 0 or rewards.max() == rewards.min():  # equal rewards: E[r^2] - E[r]^2 below leaves ~1e-8 of rounding
        return np.zeros_like(rewards)
    k = min(opts.k, n)
    order = np.argsort(rewards, kind="stable")
    r = rewards[order]  # ascending
    subsets = comb(n, k)
    p_max = np.array([comb(j, k - 1) for j in range(n)], dtype=np.float64) / subsets  # P(best = r[j]), j 0-based
    mean = float((p_max * r).sum())
    std = float(np.sqrt(max((p_max * r * r).sum() - mean * mean, 0.0)))
    if std < STD_EPS:
        return np.zeros_like(rewards)
    containing = comb(n - 1, k - 1)
    # a subset holding r[j] has its best at r[j] (others all below: C(j, k-1)) or at a higher r[m] (C(m-1, k-2))
    above = np.array([comb(m - 1, k - 2) if k >= 2 and m >= 1 else 0 for m in range(n)], dtype=np.float64) * r
    tail = np.concatenate([np.cumsum(above[::-1])[::-1][1:], [0.0]])  # sum over m > j
    expected = (r * np.array([comb(j, k - 1) for j in range(n)], dtype=np.float64) + tail) / containing
    out = np.empty_like(rewards)
    out[order] = (expected - mean) / std
    return out


# by hand, rewards (1, 0, 0, 0), k = 2: of the C(4, 2) = 6 pairs, 3 hold rollout 0 (best 1), 3 do not (best 0):
# mean 1/2, std 1/2. Rollout 0 is in 3 pairs, all best 1: (1 - 1/2) / (1/2) = 1. Each other rollout is in 3 pairs,
# one with rollout 0 (best 1) and two without (best 0): mean of z = (1 + 2 (-1)) / 3 = -1/3.
register_estimator_case("pass_at_k", EstimatorCase(rewards=(1.0, 0.0, 0.0, 0.0), overrides={"k": 2},
                                                   want=(1.0, -1 / 3, -1 / 3, -1 / 3)))
