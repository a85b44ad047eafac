"""Held-out evaluation in the rollout worker: eval groups scheduled next to the training groups, never trained.

The trainer asks for an evaluation every `eval_steps` optimizer steps (and once at the end) by writing the weight
version to evaluate into a shared value; the worker's `run_eval_forever` task picks it up between its other work
and runs each eval prompt as one group on one server: 1 greedy rollout (temperature 0) and `eval_num_generations`
(k) sampled ones at the run's sampling settings, through the same servers, hooks (`generate_one`, environments,
tools) and reward functions as training. Training does not stop: eval rollouts take server slots like any
rollout, at most `EVAL_GROUPS_IN_FLIGHT` prompts at a time, and they are invisible to the trainer's queue, the
token allowance, the prompt ledger and the epoch count. A request that arrives while an evaluation runs waits;
one superseded by a newer request before it started is skipped (counted by the trainer, `eval/skipped_count`).

Metrics, pushed with the worker's others (logged in the trainer's next window): `eval/reward` (greedy reward, mean
over prompts), `eval/mean@k` (mean sampled reward), `eval/pass@k` (mean over prompts of the best of the k sampled
rewards: pass@k for 0/1 rewards), `eval/mean_length` (sampled completion tokens), `eval/model_version` (the weight
version the eval groups were generated at), `eval/num_prompts`, `eval/unscored_count` (None rewards, scored 0) and
`eval/duration_s`.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import time
from typing import Any

import numpy as np

log = logging.getLogger("grpo.eval")
EVAL_GROUPS_IN_FLIGHT = 4
"""Eval prompts generated at once (each takes 1 + k server slots while it runs)."""
EVAL_POLL_S = 0.2
sampling_override_var: contextvars.ContextVar[dict | None] = contextvars.ContextVar("sampling_override", default=None)
"""Sampling settings that replace the config's for the current rollout (greedy eval: temperature 0)."""
GREEDY = {"temperature": 0.0}


def eval_due(step: int, eval_steps: int) -> bool:
    """Whether the trainer asks for an evaluation after optimizer step `step` (a function of the step alone, so a
    resumed run keeps the schedule)."""
    return eval_steps > 0 and step > 0 and step % eval_steps == 0


def eval_metrics(greedy: list[float], sampled: list[list[float]], lengths: list[int], version: int,
                 seconds: float) -> dict[str, float]:
    """The eval/* metrics from per-prompt rewards (NaN = unscored, counted and scored 0)."""
    greedy_arr = np.asarray(greedy, dtype=np.float64)
    unscored = int(np.isnan(greedy_arr).sum()) + sum(int(np.isnan(np.asarray(s, dtype=np.float64)).sum())
                                                      for s in sampled)
    greedy_arr = np.nan_to_num(greedy_arr, nan=0.0)
    sampled_arr = [np.nan_to_num(np.asarray(s, dtype=np.float64), nan=0.0) for s in sampled]
    return {"eval/reward": float(greedy_arr.mean()),
            "eval/mean@k": float(np.mean([s.mean() for s in sampled_arr])),
            "eval/pass@k": float(np.mean([s.max() for s in sampled_arr])),
            "eval/mean_length": float(np.mean(lengths)) if lengths else float("nan"),
            "eval/model_version": float(version), "eval/num_prompts": float(len(greedy)),
            "eval/unscored_count": float(unscored), "eval/duration_s": seconds}


async def run_eval_forever(scheduler) -> None:
    """Worker task: evaluate each version the trainer asks for, newest first; report it done."""
    shared = scheduler.shared
    request, done = shared.eval_request, shared.eval_done
    while True:
        await asyncio.sleep(EVAL_POLL_S)
        version = int(request.value)
        if version <= int(done.value):
            continue
        if shared.eval_started is not None:
            shared.eval_started.value = version  # a later request now supersedes nothing unstarted
        metrics = await evaluate(scheduler, version)
        scheduler._metric_items += list(metrics.items())
        scheduler._flush_metrics()
        done.value = version
        log.info("eval at weight version %d: reward %.4g, pass@k %.4g, mean@k %.4g (%d prompts, %.1f s)", version,
                 metrics["eval/reward"], metrics["eval/pass@k"], metrics["eval/mean@k"],
                 int(metrics["eval/num_prompts"]), metrics["eval/duration_s"])


async def evaluate(scheduler, version: int) -> dict[str, float]:
    """One pass over the eval prompts at `version`: greedy + k sampled rollouts each, scored, never published."""
    start = time.perf_counter()
    rows = scheduler.eval_rows()
    gate = asyncio.Semaphore(EVAL_GROUPS_IN_FLIGHT)

    async def one(index: int, row: dict[str, Any]):
        async with gate:
            return await _eval_group(scheduler, index, row, version)

    results = await asyncio.gather(*(one(i, row) for i, row in enumerate(rows)))
    greedy = [r[0] for r in results]
    sampled = [r[1] for r in results]
    lengths = [n for r in results for n in r[2]]
    return eval_metrics(greedy, sampled, lengths, version, time.perf_counter() - start)


async def _eval_group(scheduler, index: int, row: dict[str, Any], version: int):
    """(greedy reward, k sampled rewards, sampled completion lengths) of one eval prompt."""
    from grpo.scoring import score_group
    from grpo.server_pool import GroupHome

    k = scheduler.config.eval_num_generations
    home = GroupHome(scheduler.pool.pick())
    group_id = -2 - index  # eval groups never reach the trainer; ids apart from the trained (>= 0) and padding (-1)
    tasks = []
    for i in range(1 + k):
        server = await scheduler.pool.slot(home)
        sampling_override_var.set(GREEDY if i == 0 else None)  # copied into the task's context at creation
        tasks.append(asyncio.create_task(scheduler._rollout_slot(row, group_id, version, home, server)))
    sampling_override_var.set(None)
    results = list(await asyncio.gather(*tasks))
    if any(r.rollout is None for r in results):  # an environment that would not reset: the prompt scores None
        return float("nan"), [float("nan")] * k, []
    group = scheduler.group_from_results(results, group_id, index, row, version)
    await score_group(group, scheduler.reward_funcs)
    rewards = [float(r) for r in group.rewards]
    return rewards[0], rewards[1:], [len(ids) for ids in group.completions_ids[1:]]
