"""Scoring a rollout group: summed rewards (docs/design.md §1) and the group-level metrics logged at scoring.

Reward sources, all weight 1: every reward function (sync ones in threads, async ones awaited, all concurrently),
an environment's `get_reward()`, and `Rollout.reward`. The total is the NaN-sum over sources and stays NaN when no
source scored the rollout (the rollout is then unscorable).

What a source may return, per completion: a real number (int, float, bool, a NumPy scalar: anything with
`__float__` but a string) or None = "not scored". Anything else (a string, even "1.0", a list, a dict) stops the run
with a TypeError naming the source, the value and its type. A non-finite number (NaN, +inf, -inf) is scored as None
too, but counted (`rewards/nonfinite_count`, and `rewards/{source}/nonfinite_count`) and warned about by the
scheduler: an explicit NaN is treated like ±inf, since inside the pipeline NaN is how "unscored" is stored and an
infinite reward would turn the whole group's advantages (and the loss) into NaN. Return None to leave a completion
unscored without a warning.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
import math
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


def _reward_value(value: Any, source: str, index: int) -> float | None:
    """One reward as a float (None stays None); a TypeError naming the source when it is not a number."""
    if value is None:
        return None
    if not isinstance(value, str | bytes) and hasattr(type(value), "__float__"):
        try:
            return float(value)
        except (TypeError, ValueError):
            pass
    raise TypeError(f"{source} returned {value!r:.100} ({type(value).__name__}) for completion {index}: rewards "
                    f"must be numbers; make it return floats or None (None = not scored)")


def _as_rewards(values: Any, n: int, source: str) -> tuple[np.ndarray, list[float]]:
    """(rewards [G], the non-finite values found): None and NaN/±inf become NaN (unscored)."""
    if isinstance(values, str | bytes | dict) or not hasattr(values, "__iter__"):
        raise TypeError(f"{source} returned {values!r:.100} ({type(values).__name__}) for {n} completions; make it "
                        f"return a list with one float (or None) per completion")
    values = list(values)
    if len(values) != n:
        raise ValueError(f"{source} returned {len(values)} rewards for {n} completions; "
                         f"return one float (or None) per completion")
    rewards, nonfinite = np.full(n, np.nan, dtype=np.float64), []  # [G]
    for i, value in enumerate(values):
        x = _reward_value(value, source, i)
        if x is None:
            continue
        if math.isfinite(x):
            rewards[i] = x
        else:
            nonfinite.append(x)
    return rewards, nonfinite


class RewardFunctionError(RuntimeError):
    """A reward function raised (reason reward_error) or ran past reward_timeout_s (reason reward_timeout) while
    scoring a group, under reward_errors="drop": the group is dropped and counted by `reason`."""

    def __init__(self, source: str, cause: BaseException, reason: str = "reward_error"):
        self.source, self.cause, self.reason = source, cause, reason
        what = source if " " in source else f"reward function {source!r}"
        super().__init__(f"{what} raised {type(cause).__name__}: {cause}")


class RewardTimeoutError(TimeoutError):
    """A reward function (or an environment's get_reward()) ran past `--reward-timeout-s` on one group."""

    def __init__(self, source: str, timeout_s: float, where: str):
        self.source = source
        super().__init__(f"{source} did not return within {timeout_s:g} s on {where} (--reward-timeout-s): make it "
                         f"faster or give it its own timeout, raise --reward-timeout-s, or pass --reward-errors drop "
                         f"to drop such groups (counted in rollout/dropped_reward_timeout_count)")


class TimedOutReward:
    """What an environment's get_reward() stands for when it ran past the timeout under reward_errors="drop":
    scoring turns it into a reward_timeout drop of the whole group (`score_group`)."""

    def __init__(self, error: RewardTimeoutError):
        self.error = error


async def timed_get_reward(env, pool, timeout_s: float | None, reward_errors: str, where: str):
    """`env.get_reward()` (sync ones in `pool`) bounded by `timeout_s`: its value; past the timeout a
    RewardTimeoutError (`raise`) or a `TimedOutReward` that drops the group at scoring (`drop`)."""
    call = env.get_reward() if is_async_callable(env.get_reward) else \
        asyncio.get_running_loop().run_in_executor(pool, env.get_reward)
    try:
        return await asyncio.wait_for(call, timeout_s)
    except asyncio.TimeoutError:
        error = RewardTimeoutError(f"environment {type(env).__name__}.get_reward()", timeout_s, where)
        if reward_errors == "drop":
            return TimedOutReward(error)
        raise error from None


async def _await_rewards(calls: list, names: list[str], timeout_s: float | None, progress_every: float,
                         where: str) -> list:
    """Await every reward call; a progress line every `progress_every` s names those still running on `where` and
    for how long; past `timeout_s` the first still running raises RewardTimeoutError (the rest are cancelled; a sync
    function's thread finishes in the background, its result discarded). Returns results or exceptions, in order."""
    import time

    from grpo.progress import WaitProgress

    tasks = [asyncio.ensure_future(call) for call in calls]
    progress = WaitProgress(f"reward functions on {where}", progress_every, logging.getLogger("grpo.rollout"))
    pending = set(tasks)
    while pending:
        left = None if timeout_s is None else timeout_s - progress.waited_s
        if left is not None and left <= 0:
            break
        _, pending = await asyncio.wait(pending, timeout=min(progress_every, left if left is not None else math.inf))
        if pending:
            running = [name for name, task in zip(names, tasks) if task in pending]
            progress.tick(f"{', '.join(running)} still running (reward_timeout_s={timeout_s:g})")
    if pending:
        for task in pending:
            task.cancel()
        late = next(name for name, task in zip(names, tasks) if task in pending)
        raise RewardTimeoutError(f"reward function {late!r}", timeout_s, where)
    return [task.exception() or task.result() for task in tasks]


async def score_group(group: RolloutGroup, reward_funcs: list[Callable], reward_errors: str = "raise",
                      timeout_s: float | None = None, progress_every: float = 30.0,
                      where: str = "a group") -> dict[str, np.ndarray]:
    """Per-source rewards [G] keyed by source name; sets `group.rewards` to their NaN-aware sum and
    `group.nonfinite_rewards` to the NaN/±inf values each source returned (scored as None). A reward function
    that raises: its exception propagates (`raise`), or becomes a RewardFunctionError naming it (`drop`). One that
    runs past `timeout_s`: RewardTimeoutError naming it and `where` (`raise`), or a RewardFunctionError with reason
    reward_timeout (`drop`); an environment's get_reward() that timed out (`timed_get_reward`) likewise."""
    n = len(group.completions)
    kwargs = dict(prompts=group.prompts, completions=group.completions, completion_ids=group.completions_ids,
                  **group.reward_kwargs)
    loop = asyncio.get_running_loop()
    calls = [fn(**kwargs) if is_async_callable(fn) else loop.run_in_executor(None, functools.partial(fn, **kwargs))
             for fn in reward_funcs]
    sources: dict[str, np.ndarray] = {}
    nonfinite: dict[str, list[float]] = {}

    def add(key: str, values, source: str) -> None:
        sources[key], bad = _as_rewards(values, n, source)
        if bad:
            nonfinite[key] = bad

    late = next((env[1] for env in group.env_rewards if env is not None and isinstance(env[1], TimedOutReward)),
                None)
    if late is not None:
        for call in calls:  # not awaited: the group is dropped anyway
            call.cancel() if isinstance(call, asyncio.Future) else call.close()
        raise RewardFunctionError(late.error.source, late.error, reason="reward_timeout")
    try:
        results = await _await_rewards(calls, [reward_name(fn) for fn in reward_funcs], timeout_s, progress_every,
                                       where)
    except RewardTimeoutError as exc:
        if reward_errors == "drop":
            raise RewardFunctionError(exc.source, exc, reason="reward_timeout") from exc
        raise
    for fn, values in zip(reward_funcs, results):
        if isinstance(values, Exception) and reward_errors != "drop":
            raise values
        if isinstance(values, Exception):
            raise RewardFunctionError(reward_name(fn), values) from values
        name = reward_name(fn)
        add(name if name not in sources else f"{name}_{len(sources)}", values, f"reward function {name!r}")
    for cls in {env[0] for env in group.env_rewards if env is not None}:
        add(cls.__name__, [env[1] if env is not None and env[0] is cls else None for env in group.env_rewards],
            f"environment {cls.__name__}.get_reward()")
    if any(r is not None for r in group.rollout_rewards):
        add("rollout_reward", group.rollout_rewards, "Rollout.reward (set by generate_one)")
    if sources:
        stacked = np.stack(list(sources.values()))  # [S, G]
        scored = ~np.isnan(stacked).all(axis=0)
        total = np.where(scored, np.nansum(stacked, axis=0), np.nan)
    else:
        total = np.full(n, np.nan)
    group.rewards = total
    group.nonfinite_rewards = nonfinite
    return sources


def is_kept(rewards: np.ndarray, drop_equal_rewards: bool = True) -> bool:
    """A group trains iff at least two rollouts are scorable and their rewards are not all equal (exact test);
    with `drop_equal_rewards=False` iff at least one rollout is scorable (equal-reward groups then train with
    zero advantage, adding to the normalisers only)."""
    scored = rewards[~np.isnan(rewards)]
    if not drop_equal_rewards:
        return len(scored) >= 1
    return len(scored) >= 2 and bool(scored.max() != scored.min())


def drop_reason(rewards: np.ndarray, num_samples: int, drop_equal_rewards: bool = True) -> str | None:
    """None when the group is kept; else why it is dropped (the spec's rule on rewards, plus no trainable token)."""
    if num_samples == 0:
        return "no_samples"
    if is_kept(rewards, drop_equal_rewards):
        return None
    return "unscored" if np.isnan(np.asarray(rewards, dtype=np.float64)).all() else "equal_rewards"


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
    bad = getattr(group, "nonfinite_rewards", None) or {}
    items.append(("rewards/nonfinite_count", sum(len(v) for v in bad.values())))  # 0 too: "none" stays visible
    items += [(f"rewards/{name}/nonfinite_count", len(values)) for name, values in bad.items()]
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
