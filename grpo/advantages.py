"""Advantage estimators: a registry of pure functions `rewards [G] -> advantages [G]` over one prompt group.

NaN rewards (unscorable rollouts) get advantage 0 and leave every statistic. Select with
`--advantage-estimator NAME`; add one with `@register_estimator("name")` in a module listed in
$GRPO_LOSS_MODULES (or subclass the rollout loop and override `compute_advantages` for anything that needs more
than one group's rewards). DAPO's overlong reward shaping is applied before the estimator when
`overlong_buffer_length > 0`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np

Estimator = Callable[["np.ndarray"], "np.ndarray"]
ESTIMATORS: dict[str, Estimator] = {}
STD_EPS = 1e-8
"""Added to the group std before dividing (a group of equal rewards has std 0)."""


def register_estimator(name: str) -> Callable[[Estimator], Estimator]:
    """Decorator adding an estimator over the scored rewards of one group (no NaN inside) to `ESTIMATORS`."""

    def add(fn: Estimator) -> Estimator:
        if name in ESTIMATORS:
            raise ValueError(f"advantage estimator {name!r} is already registered")
        ESTIMATORS[name] = fn
        return fn

    return add


@register_estimator("group_std")
def group_std(rewards: np.ndarray) -> np.ndarray:
    """GRPO (DeepSeekMath, arXiv 2402.03300): (r - mean) / (population std + 1e-8)."""
    return (rewards - rewards.mean()) / (rewards.std() + STD_EPS)


@register_estimator("no_std")
def no_std(rewards: np.ndarray) -> np.ndarray:
    """Dr. GRPO (arXiv 2503.20783): r - mean, no division by the std (which up-weights easy and hard prompts)."""
    return rewards - rewards.mean()


@register_estimator("rloo")
def rloo(rewards: np.ndarray) -> np.ndarray:
    """RLOO (Ahmadian et al., arXiv 2402.14740): r_i - mean of the other rewards = G / (G - 1) (r_i - mean)."""
    import numpy as np

    n = len(rewards)
    if n < 2:
        return np.zeros_like(rewards)
    return (rewards - rewards.mean()) * n / (n - 1)


def overlong_penalty(lengths: np.ndarray, max_length: int, buffer: int, factor: float) -> np.ndarray:
    """DAPO soft overlong punishment (arXiv 2503.14476 eq. 13): 0 up to max - buffer, then linear down to
    -factor at max_length (and beyond)."""
    import numpy as np

    if buffer <= 0:
        return np.zeros(len(lengths), dtype=np.float64)
    excess = np.asarray(lengths, dtype=np.float64) - (max_length - buffer)
    return -factor * np.clip(excess / buffer, 0.0, 1.0)


def estimate_advantages(name: str, rewards: np.ndarray, lengths: np.ndarray | None = None, max_length: int = 0,
                        overlong_buffer: int = 0, overlong_factor: float = 1.0) -> np.ndarray:
    """Advantages [G] of one group by the named estimator; NaN rewards get 0 and are left out of the statistics."""
    import numpy as np

    if name not in ESTIMATORS:
        raise ValueError(f"unknown advantage estimator {name!r}: use one of {sorted(ESTIMATORS)}")
    rewards = np.asarray(rewards, dtype=np.float64)
    if overlong_buffer > 0 and lengths is not None:
        rewards = rewards + overlong_penalty(lengths, max_length, overlong_buffer, overlong_factor)
    advantages = np.zeros_like(rewards)
    scored = ~np.isnan(rewards)
    if scored.any():
        advantages[scored] = ESTIMATORS[name](rewards[scored])
    return advantages
