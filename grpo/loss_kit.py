"""The loss test kit: every registered loss ships a hand-computed off-policy case, registered next to the loss.

A case is a tiny row (a few tokens, two or more sequences, sampler log q = -1 on every token, ratios r = p/q given)
with the loss value and its gradient d loss / d log p worked out by hand, on one rank without accumulation.
tests/test_losses.py requires one per registered loss and checks, for each:

1. the loss reproduces the hand-computed value and gradient (and any metrics the case pins);
2. the case is off-policy and reaches the loss's edges: no ratio is 1, both advantage signs occur, and for every
   band option pair (`X_min`/`X_max`) some token ratio lies inside the band and some outside;
3. the case tells the loss's asymmetric option pairs apart (`epsilon`/`epsilon_high`, `X_min`/`X_max`,
   `X_low`/`X_high`): with the case's options the two differ, and swapping their values changes the loss, the
   gradient or a pinned metric. A case that cannot see a swap cannot catch code that mixes the two up.

In a fork, next to the loss (same module):

    from grpo.loss_kit import HandCase, register_hand_case
    register_hand_case("my_loss", HandCase(ratios=(1.5, 0.9, 0.6, 1.1, 6.0), advantages=(1, 1, -2, -2, -2),
                                           sequence_index=(0, 0, 1, 1, 1), loss=..., grad=(...), overrides={...}))
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

SAMPLER_LOGPROB = -1.0
"""log q of every token of a case; log p = log q + log r."""
HAND_CASES: dict[str, HandCase] = {}
HOW_TO_ADD = ("add a hand-computed off-policy case next to the loss: `register_hand_case({name!r}, "
              "HandCase(ratios=..., advantages=..., sequence_index=..., loss=..., grad=..., overrides=...))` from "
              "grpo.loss_kit (docs/losses.md, 'Adding a loss'); ratios != 1, both advantage signs, tokens inside and "
              "outside its bands, and options whose asymmetric pairs differ")


@dataclass(frozen=True)
class HandCase:
    """One row worked by hand. `grad` is d loss / d log p per token; `overrides` change the registered options."""

    ratios: tuple[float, ...]  # [M] p/q per token
    advantages: tuple[float, ...]  # [M] the sequence's advantage on each of its tokens
    sequence_index: tuple[int, ...]  # [M]
    loss: float
    grad: tuple[float, ...]  # [M]
    overrides: dict[str, Any] = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=dict)  # optional pinned metric values
    max_completion_length: int = 4
    note: str = ""


def register_hand_case(name: str, case: HandCase) -> HandCase:
    if name in HAND_CASES:
        raise ValueError(f"loss {name!r} already has a hand case")
    if not (len(case.ratios) == len(case.advantages) == len(case.sequence_index) == len(case.grad)):
        raise ValueError(f"hand case of {name!r}: ratios, advantages, sequence_index and grad need one entry per token")
    HAND_CASES[name] = case
    return case


def hand_case_for(name: str) -> HandCase:
    """The registered case of a loss, or an error that says how to add one."""
    if name not in HAND_CASES:
        raise LookupError(f"loss {name!r} has no hand-computed case: " + HOW_TO_ADD.format(name=name))
    return HAND_CASES[name]


def case_options(name: str, case: HandCase, swap: tuple[str, str] | None = None) -> Any:
    from grpo.losses import get_loss

    options = dataclasses.replace(get_loss(name)[1], **case.overrides)
    if swap is not None:
        a, b = swap
        options = dataclasses.replace(options, **{a: getattr(options, b), b: getattr(options, a)})
    return options


def run_case(name: str, case: HandCase, options: Any = None) -> tuple[float, list[float], dict[str, float]]:
    """(loss, gradient d loss / d log p, metrics) of the registered loss on the case, in float64."""
    import torch

    from grpo.losses import LossInputs, get_loss, normalized_loss

    fn, _ = get_loss(name)
    options = case_options(name, case) if options is None else options
    m = len(case.ratios)
    policy = torch.tensor([SAMPLER_LOGPROB + math.log(r) for r in case.ratios], dtype=torch.float64,
                          requires_grad=True)
    no_top = torch.zeros(m, 0, dtype=torch.float64)
    inputs = LossInputs(policy, torch.full((m,), SAMPLER_LOGPROB, dtype=torch.float64),
                        torch.tensor(case.advantages, dtype=torch.float64), torch.tensor(case.sequence_index),
                        max_completion_length=case.max_completion_length, policy_top_logprobs=no_top,
                        sampler_top_logprobs=no_top)
    out = fn(inputs, options)
    loss = normalized_loss(out, inputs, 1, 1)
    (grad,) = torch.autograd.grad(loss, (policy,), allow_unused=True)
    grad = torch.zeros_like(policy) if grad is None else grad
    return loss.item(), grad.tolist(), {k: float(v) for k, v in out.metrics.items()}


def matches(case: HandCase, got: tuple[float, list[float], dict[str, float]], rel: float = 1e-9) -> list[str]:
    """What differs between a run and the case's hand-computed numbers (empty when it matches)."""
    loss, grad, metrics = got

    def close(a: float, b: float) -> bool:
        return math.isclose(a, b, rel_tol=rel, abs_tol=1e-12)

    diffs = [] if close(loss, case.loss) else [f"loss {loss!r} != {case.loss!r}"]
    diffs += [f"grad[{i}] {g!r} != {w!r}" for i, (g, w) in enumerate(zip(grad, case.grad)) if not close(g, w)]
    diffs += [f"{k} {metrics.get(k)!r} != {v!r}" for k, v in case.metrics.items()
              if k not in metrics or not close(metrics[k], v)]
    return diffs


def option_pairs(options: Any) -> list[tuple[str, str]]:
    """Asymmetric option pairs: epsilon/epsilon_high and X_min/X_max, X_low/X_high (numeric fields only)."""
    names = {f.name for f in dataclasses.fields(options)
             if isinstance(getattr(options, f.name), (int, float)) and not isinstance(getattr(options, f.name), bool)}
    pairs = [("epsilon", "epsilon_high")] if {"epsilon", "epsilon_high"} <= names else []
    for low, high in (("_min", "_max"), ("_low", "_high")):
        pairs += [(n, n[: -len(low)] + high) for n in sorted(names)
                  if n.endswith(low) and n[: -len(low)] + high in names]
    return pairs


def coverage_problems(name: str, case: HandCase) -> list[str]:
    """Why the case does not reach the loss's off-policy behaviour (empty when it does)."""
    options = case_options(name, case)
    problems = []
    if any(math.isclose(r, 1.0) for r in case.ratios):
        problems.append("a token has ratio 1: every ratio must differ from 1 (off-policy)")
    if not (any(a > 0 for a in case.advantages) and any(a < 0 for a in case.advantages)):
        problems.append("advantages must take both signs")
    for low, high in option_pairs(options):
        if low.endswith("_min") and "clip" in low:
            lo, hi = getattr(options, low), getattr(options, high)
            inside = [lo <= r <= hi for r in case.ratios]
            if all(inside) or not any(inside):
                problems.append(f"ratios must fall both inside and outside the band [{low}, {high}] = [{lo}, {hi}]")
    return problems


def swap_problems(name: str, case: HandCase) -> list[str]:
    """Option pairs the case cannot tell apart: equal values, or a swap that leaves every checked number alone."""
    options = case_options(name, case)
    problems = []
    for a, b in option_pairs(options):
        if getattr(options, a) == getattr(options, b):
            problems.append(f"{a} = {b} = {getattr(options, a)} in the case: set them apart in `overrides`")
            continue
        try:
            swapped = run_case(name, case, case_options(name, case, swap=(a, b)))
        except Exception:  # noqa: BLE001 (a swap the loss rejects is a swap the case sees)
            continue
        if not matches(case, swapped, rel=1e-6):
            problems.append(f"swapping {a} and {b} leaves the loss, the gradient and the pinned metrics unchanged: "
                            f"put a token where the two bounds act differently, or pin the metric they move")
    return problems
