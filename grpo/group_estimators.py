"""The built-in group estimators: GRPO's standardised reward, Dr. GRPO's centred reward, RLOO's leave-one-out
baseline. Each is a one-file plug-in like any fork's (grpo/advantages.py has the interface); pass@k is in
grpo/pass_at_k.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from grpo.advantage_kit import EstimatorCase, register_estimator_case
from grpo.advantages import STD_EPS, AdvantageGroup, register_estimator

if TYPE_CHECKING:
    import numpy as np


# ---- the estimators ------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class GroupStdOptions:
    """Options of group_std."""

    std_eps: float = STD_EPS
    """Added to the group's population std before dividing."""


@register_estimator("group_std", GroupStdOptions())
def group_std(group: AdvantageGroup, opts: GroupStdOptions) -> np.ndarray:
    """GRPO (DeepSeekMath, arXiv 2402.03300): (r - mean) / (population std + 1e-8)."""
    rewards = group.rewards
    return (rewards - rewards.mean()) / (rewards.std() + opts.std_eps)


@dataclass(frozen=True)
class NoStdOptions:
    """Options of no_std (none)."""


@register_estimator("no_std", NoStdOptions())
def no_std(group: AdvantageGroup, opts: NoStdOptions) -> np.ndarray:
    """Dr. GRPO (arXiv 2503.20783): r - mean, no division by the std (which up-weights easy and hard prompts)."""
    return group.rewards - group.rewards.mean()


@dataclass(frozen=True)
class RlooOptions:
    """Options of rloo (none)."""


@register_estimator("rloo", RlooOptions())
def rloo(group: AdvantageGroup, opts: RlooOptions) -> np.ndarray:
    """RLOO (Ahmadian et al., arXiv 2402.14740): r_i - mean of the other rewards = G / (G - 1) (r_i - mean)."""
    import numpy as np

    rewards, n = group.rewards, len(group)
    if n < 2:
        return np.zeros_like(rewards)
    return (rewards - rewards.mean()) * n / (n - 1)


# ---- their hand cases (grpo/advantage_kit.py) ----------------------------------------------------------------------

# rewards (2, 0, 1, 1): mean 1, population std sqrt((1 + 1 + 0 + 0) / 4) = sqrt(0.5); std_eps 0.25 so the case
# sees it: (1, -1, 0, 0) / (sqrt(0.5) + 0.25)
register_estimator_case("group_std", EstimatorCase(
    rewards=(2.0, 0.0, 1.0, 1.0), overrides={"std_eps": 0.25},
    want=tuple(a / (0.5 ** 0.5 + 0.25) for a in (1.0, -1.0, 0.0, 0.0))))
# rewards (3, 0, 0): mean 1 -> (2, -1, -1)
register_estimator_case("no_std", EstimatorCase(rewards=(3.0, 0.0, 0.0), want=(2.0, -1.0, -1.0)))
# rewards (3, 0, 0, 1): r_i - mean of the other three: 3 - 1/3, 0 - 4/3, 0 - 4/3, 1 - 1
register_estimator_case("rloo", EstimatorCase(rewards=(3.0, 0.0, 0.0, 1.0), want=(8 / 3, -4 / 3, -4 / 3, 0.0)))
