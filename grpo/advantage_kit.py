"""The advantage test kit: every registered estimator and batch transform ships a hand-computed case next to it.

An estimator's case is one small group (rewards, and where the estimator reads them completion lengths, trained
tokens, turns) with the advantages worked out by hand; a transform's case is one small step of rollouts with the
new advantages worked out by hand. tests/test_advantage_kit.py requires one per registered name and checks, for
each:

1. the estimator / transform reproduces the hand-computed advantages (with the case's option `overrides`);
2. the case reaches every option's effect: changing any one option (to `perturb[name]`, or by default a bool
   flipped, an int + 1, a float doubled, 0 -> 1) changes the result. A clip that never clips, or a penalty that
   never applies, cannot catch code that gets it wrong;
3. the invariants over random groups / steps: shape, finite, padding (NaN rewards, padding samples) untouched,
   permutation equivariance within a group / step, and equal rewards (estimators) or zero advantages (transforms)
   giving zero where the options class declares it (`equal_rewards_give_zero`, `keeps_zero_advantages`, both
   True unless a class attribute says otherwise).

In a fork, next to the estimator or transform (same module):

    from grpo.advantage_kit import EstimatorCase, TransformCase, register_estimator_case, register_transform_case
    register_estimator_case("my_estimator", EstimatorCase(rewards=(1, 0, 1), completion_lengths=(4, 8, 2),
                                                          want=(...), overrides={...}))
    register_transform_case("my_transform", TransformCase(advantages=(1, -1, 2), group_ids=(0, 0, 1),
                                                          trained_tokens=(3, 5, 2), want=(...), overrides={...}))
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

ESTIMATOR_CASES: dict[str, EstimatorCase] = {}
TRANSFORM_CASES: dict[str, TransformCase] = {}
HOW_TO_ADD = ("add a hand-computed case next to it: `{register}({name!r}, {case}(..., want=..., overrides=...))` "
              "from grpo.advantage_kit (docs/losses.md, 'Adding an estimator or a batch transform'); its options "
              "must each change the result on the case")


@dataclass(frozen=True)
class EstimatorCase:
    """One group worked by hand; fields left None default to lengths 0, trained tokens 0, one turn each."""

    rewards: tuple[float, ...]  # [G]
    want: tuple[float, ...]  # [G] the advantages by hand
    completion_lengths: tuple[int, ...] | None = None  # [G]
    trained_tokens: tuple[int, ...] | None = None  # [G]
    turns: tuple[int, ...] | None = None  # [G]
    prompt_id: int = 0
    overrides: dict[str, Any] = field(default_factory=dict)
    perturb: dict[str, Any] = field(default_factory=dict)  # option -> another value whose effect the case shows
    note: str = ""


@dataclass(frozen=True)
class TransformCase:
    """One step of rollouts worked by hand; fields left None take AdvantageBatch's defaults."""

    advantages: tuple[float, ...]  # [N] what the estimator gave
    group_ids: tuple[int, ...]  # [N]
    want: tuple[float, ...]  # [N] the transformed advantages by hand
    rewards: tuple[float, ...] | None = None  # [N] (None: equal to the advantages)
    completion_lengths: tuple[int, ...] | None = None
    trained_tokens: tuple[int, ...] | None = None
    turns: tuple[int, ...] | None = None
    prompt_ids: tuple[int, ...] | None = None
    step: int = 1
    overrides: dict[str, Any] = field(default_factory=dict)
    perturb: dict[str, Any] = field(default_factory=dict)
    note: str = ""


def register_estimator_case(name: str, case: EstimatorCase) -> EstimatorCase:
    if name in ESTIMATOR_CASES:
        raise ValueError(f"estimator {name!r} already has a hand case")
    if len(case.want) != len(case.rewards):
        raise ValueError(f"hand case of {name!r}: want needs one advantage per reward")
    ESTIMATOR_CASES[name] = case
    return case


def register_transform_case(name: str, case: TransformCase) -> TransformCase:
    if name in TRANSFORM_CASES:
        raise ValueError(f"batch transform {name!r} already has a hand case")
    if not len(case.want) == len(case.advantages) == len(case.group_ids):
        raise ValueError(f"hand case of {name!r}: advantages, group_ids and want need one entry per rollout")
    TRANSFORM_CASES[name] = case
    return case


def estimator_case_for(name: str) -> EstimatorCase:
    if name not in ESTIMATOR_CASES:
        raise LookupError(f"advantage estimator {name!r} has no hand-computed case: " + HOW_TO_ADD.format(
            register="register_estimator_case", name=name, case="EstimatorCase"))
    return ESTIMATOR_CASES[name]


def transform_case_for(name: str) -> TransformCase:
    if name not in TRANSFORM_CASES:
        raise LookupError(f"advantage batch transform {name!r} has no hand-computed case: " + HOW_TO_ADD.format(
            register="register_transform_case", name=name, case="TransformCase"))
    return TRANSFORM_CASES[name]


def case_group(case: EstimatorCase):
    from grpo.advantages import AdvantageGroup

    return AdvantageGroup.of(case.rewards, case.completion_lengths, case.trained_tokens, case.turns, case.prompt_id)


def case_batch(case: TransformCase):
    import numpy as np

    from grpo.advantages import AdvantageBatch

    rewards = case.advantages if case.rewards is None else case.rewards
    return AdvantageBatch(np.array(case.advantages, np.float64), np.array(rewards, np.float64),
                          np.array(case.group_ids), case.step, case.completion_lengths, case.trained_tokens,
                          case.turns, case.prompt_ids)


def estimator_case_options(name: str, case: EstimatorCase, **changes) -> Any:
    from grpo.advantages import registered_estimators

    return dataclasses.replace(registered_estimators()[name], **(case.overrides | changes))


def transform_case_options(name: str, case: TransformCase, **changes) -> Any:
    from grpo.advantages import registered_batch_transforms

    return dataclasses.replace(registered_batch_transforms()[name], **(case.overrides | changes))


def run_estimator_case(name: str, case: EstimatorCase, options: Any = None):
    """The estimator's advantages [G] on the case (through estimate_advantages: NaN handling included)."""
    from grpo.advantages import estimate_advantages

    return estimate_advantages(estimator_case_options(name, case) if options is None else options, case_group(case))


def run_transform_case(name: str, case: TransformCase, options: Any = None):
    """The transform's advantages [N] on the case (a fresh instance: a stateful class starts from scratch)."""
    import numpy as np

    from grpo.advantages import batch_transforms

    (transform,) = batch_transforms((transform_case_options(name, case) if options is None else options,))
    return np.asarray(transform(case_batch(case)), dtype=np.float64)


def perturbed(value: Any) -> Any:
    """Another value of an option whose effect a case must show (None: the case must name one in `perturb`)."""
    if isinstance(value, bool):
        return not value
    if isinstance(value, int):
        return value + 1
    if isinstance(value, float):
        return value * 2 if value else 1.0
    return None


def option_effect_problems(kind: str, name: str, case: Any) -> list[str]:
    """Options whose change leaves the case's result alone (empty when every option shows its effect)."""
    import numpy as np

    estimator = kind == "estimator"
    options = estimator_case_options(name, case) if estimator else transform_case_options(name, case)
    run = run_estimator_case if estimator else run_transform_case
    base = run(name, case, options)
    problems = []
    for f in dataclasses.fields(options):
        other = case.perturb.get(f.name, perturbed(getattr(options, f.name)))
        if other is None:
            problems.append(f"option {f.name!r} ({getattr(options, f.name)!r}) has no default perturbation: give the "
                            f"case `perturb={{{f.name!r}: <another value>}}`")
            continue
        try:
            changed = run(name, case, dataclasses.replace(options, **{f.name: other}))
        except Exception:  # noqa: BLE001 (a value the code rejects is an effect the case sees)
            continue
        if np.array_equal(changed, base):
            problems.append(f"{f.name} = {getattr(options, f.name)!r} -> {other!r} leaves the case's advantages "
                            f"unchanged: pick rewards/lengths (and `overrides`) where the option acts, e.g. a clip "
                            f"that clips, a penalty that applies")
    return problems
