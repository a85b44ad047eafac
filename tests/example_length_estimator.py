"""A fork's length-aware advantage estimator, with two options and its hand case, plus a rollout-loop subclass:
one file, no edit elsewhere (`GRPO_PLUGIN_MODULES=example_length_estimator`). Train with
`... advantage:length_penalized --advantage.length-coef 0.2 --advantage.only-correct`; the kit runs with
`GRPO_PLUGIN_MODULES=example_length_estimator pytest tests/test_advantage_kit.py`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from grpo.advantage_kit import EstimatorCase, register_estimator_case
from grpo.advantages import AdvantageGroup, register_estimator
from grpo.rollout_loop import AsyncRolloutLoop


@dataclass(frozen=True)
class LengthPenalizedOptions:
    """Options of length_penalized."""

    length_coef: float = 0.1
    """Reward lost per unit of relative length above the group's mean length ((L - mean L) / mean L)."""
    only_correct: bool = False
    """Penalise length only in rollouts with a positive reward (a wrong answer is not made 'cheaper' by brevity)."""
    equal_rewards_give_zero: ClassVar[bool] = False  # equal rewards with unequal lengths get a length signal

    def check(self, config, inputs) -> None:
        """The resolved inputs: a Python-API `loop_cls` counts as much as --loop-cls."""
        if self.length_coef < 0:
            raise ValueError(f"--advantage.length-coef {self.length_coef}: pass a value >= 0")


@register_estimator("length_penalized", LengthPenalizedOptions())
def length_penalized(group: AdvantageGroup, opts: LengthPenalizedOptions) -> np.ndarray:
    """Centred reward minus a penalty on relative completion length (concise-reasoning shaping)."""
    lengths = group.completion_lengths.astype(np.float64)
    relative = (lengths - lengths.mean()) / max(lengths.mean(), 1.0)
    penalised = group.rewards > 0 if opts.only_correct else np.ones(len(group), dtype=bool)
    shaped = group.rewards - opts.length_coef * np.where(penalised, relative, 0.0)
    return shaped - shaped.mean()


# by hand: rewards (1, 1, 0, 0), lengths (10, 30, 5, 35): mean length 20, relative (-0.5, 0.5, -0.75, 0.75);
# only_correct with coef 0.4 penalises the first two only: shaped (1.2, 0.8, 0, 0), mean 0.5 -> (0.7, 0.3, -0.5, -0.5)
# (the wrong rollouts' lengths differ from the mean, so that only_correct = False would move them: the case sees it)
register_estimator_case("length_penalized", EstimatorCase(
    rewards=(1.0, 1.0, 0.0, 0.0), completion_lengths=(10, 30, 5, 35), turns=(1, 2, 1, 1),
    overrides={"length_coef": 0.4, "only_correct": True}, want=(0.7, 0.3, -0.5, -0.5)))


class ConciseLoop(AsyncRolloutLoop):
    """A loop subclass in the same plug-in file (`--loop-cls example_length_estimator:ConciseLoop`)."""

    def filter_prompt(self, row_index, row, epoch) -> bool:
        return bool(row.get("prompt"))
