"""Scoring a rollout group: summed rewards (docs/design.md §1) and the group-level metrics logged at scoring.

Reward sources, all weight 1: every reward function (sync ones in threads, async ones awaited, all concurrently),
an environment's `get_reward()`, and `Rollout.reward`. None becomes NaN; the total is the NaN-sum over sources and
stays NaN when no source scored the rollout (the rollout is then unscorable).
"""

from __future__ import annotations

import asyncio
import functools
import inspect
from collections.abc import Callable
from typing import Any

import numpy as np

from grpo.multiturn import FoldStats
from grpo.samples import Rollout, RolloutGroup


def is_async_callable(fn: Callable) -> bool:
    while isinstance(fn, functools.partial):
        fn = fn.func
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None))


def reward_name(fn: Callable) -> str:
    """`__name__` of a function, of a partial's function, or the class name of a callable instance."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    return getattr(fn, "__name__", None) or type(fn).__name__


def _as_rewards(values: Any, n: int, name: str) -> np.ndarray:
    values = list(values)
    if len(values) != n:
        raise ValueError(f"reward function {name!r} returned {len(values)} rewards for {n} completions; "
                         f"return one float (or None) per completion")
    return np.array([np.nan if v is None else float(v) for v in values], dtype=np.float64)  # [G]


async def score_group(group: RolloutGroup, reward_funcs: list[Callable]) -> dict[str, np.ndarray]:
    """Per-source rewards [G] keyed by source name; sets `group.rewards` to their NaN-aware sum."""
    n = len(group.completions)
    kwargs = dict(prompts=group.prompts, completions=group.completions, completion_ids=group.completions_ids,
                  **group.reward_kwargs)
    loop = asyncio.get_running_loop()
    calls = [fn(**kwargs) if is_async_callable(fn) else loop.run_in_executor(None, functools.partial(fn, **kwargs))
             for fn in reward_funcs]
    sources: dict[str, np.ndarray] = {}
    for fn, values in zip(reward_funcs, await asyncio.gather(*calls)):
        name = reward_name(fn)
        key = name if name not in sources else f"{name}_{len(sources)}"
        sources[key] = _as_rewards(values, n, name)
    for cls in {env[0] for env in group.env_rewards if env is not None}:
        sources[cls.__name__] = np.array([env[1] if env is not None and env[0] is cls else np.nan
                                          for env in group.env_rewards], dtype=np.float64)
    if any(r is not None for r in group.rollout_rewards):
        sources["rollout_reward"] = _as_rewards(group.rollout_rewards, n, "Rollout.reward")
    if sources:
        stacked = np.stack(list(sources.values()))  # [S, G]
        scored = ~np.isnan(stacked).all(axis=0)
        total = np.where(scored, np.nansum(stacked, axis=0), np.nan)
    else:
        total = np.full(n, np.nan)
    group.rewards = total
    return sources


def is_kept(rewards: np.ndarray, drop_equal_rewards: bool = True) -> bool:
    """A group trains iff at least two rollouts are scorable and their rewards are not all equal (exact test);
    with `drop_equal_rewards=False` iff at least one rollout is scorable (equal-reward groups then train with
    zero advantage, adding to the normalisers only)."""
    scored = rewards[~np.isnan(rewards)]
    if not drop_equal_rewards:
        return len(scored) >= 1
    return len(scored) >= 2 and bool(scored.max() != scored.min())


def duplicate_count(group: RolloutGroup) -> int:
    """Rollouts whose per-turn output ids equal those of an earlier rollout of the group (docs/design.md §10)."""
    seen, dups = set(), 0
    for rollout in group.rollouts:
        key = hash(tuple(tuple(turn.output_ids) for turn in rollout.turns))
        dups += key in seen
        seen.add(key)
    return dups


def _std(values: np.ndarray) -> float:
    values = values[~np.isnan(values)]
    return float(values.std()) if len(values) else float("nan")


def group_metrics(group: RolloutGroup, sources: dict[str, np.ndarray], kept: bool,
                  eos_token_ids: set[int]) -> list[tuple[str, Any]]:
    """The metrics a group contributes when scored (dropped groups included where the spec says so).

    `rewards/{name}/*` and `reward_group_std` are "over trained samples": pushed once per sample of a kept group
    (samples later dropped as stale are still counted, since scoring runs ahead of training).
    """
    items: list[tuple[str, Any]] = []
    rewards = group.rewards
    scored = rewards[~np.isnan(rewards)]
    items += [("reward", float(r)) for r in scored]
    items.append(("frac_reward_zero_std", float(not kept)))
    if not kept:
        items += [("reward_dropped", float(r)) for r in scored]
    else:
        sigma = float(scored.std())
        for i, seq in enumerate(group.completions_sequences):
            for _ in seq:
                items.append(("reward_group_std", sigma))
                for name, values in sources.items():
                    items.append((f"rewards/{name}/mean", float(values[i])))
                    items.append((f"rewards/{name}/group_std", _std(values)))
    for rollout in group.rollouts:
        length = len(rollout.completion_ids)
        last = rollout.turns[-1].output_ids if rollout.turns else []
        terminated = bool(last) and last[-1] in eos_token_ids
        items += [("completions/mean_length", length), ("completions/min_length", length),
                  ("completions/max_length", length), ("completions/clipped_ratio", float(not terminated))]
        if terminated:
            items += [("completions/mean_terminated_length", length), ("completions/min_terminated_length", length),
                      ("completions/max_terminated_length", length)]
    items.append(("completions/duplicate_frac", (duplicate_count(group), len(group.rollouts))))
    return items


def rollout_metrics(rollout: Rollout, num_samples: int, fold: FoldStats, duration_s: float,
                    has_tools: bool) -> list[tuple[str, Any]]:
    """Per-rollout metrics, pushed when its group completes (dropped groups included)."""
    turns = len(rollout.turns)
    items: list[tuple[str, Any]] = [("rollout/duration_s", duration_s), ("rollout/turns_mean", turns),
                                    ("rollout/turns_max", turns), ("rollout/samples_per_rollout", num_samples)]
    if fold.transitions:
        items.append(("rollout/fork_frac", (fold.forks, fold.transitions)))
    for drift in fold.drift_tokens:
        items += [("rollout/drift_tokens_mean", drift), ("rollout/drift_tokens_max", drift)]
    if has_tools:
        items += [("tools/call_frequency", rollout.tool_call_count),
                  ("tools/failure_frequency", (rollout.tool_failure_count, rollout.tool_call_count))]
    return items
