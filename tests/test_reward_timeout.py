"""A reward function (or an environment's get_reward()) that runs past `reward_timeout_s` is named: the group is
dropped with reason reward_timeout under reward_errors=drop, the run stops under raise; while it runs, a progress
line names the function, the prompt and how long."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from grpo.samples import Rollout, RolloutGroup, TurnRecord
from grpo.scoring import RewardFunctionError, RewardTimeoutError, score_group, timed_get_reward

PROMPT = [{"role": "user", "content": "hi"}]


def group_of(n: int = 2, env_rewards=None) -> RolloutGroup:
    rollouts = [Rollout(completion=[{"role": "assistant", "content": "x"}], completion_ids=[5, 2],
                        turns=[TurnRecord([1], [5, 2], [-1.0, -1.0])]) for _ in range(n)]
    return RolloutGroup(prompts=[PROMPT] * n, reward_kwargs={}, completions=[r.completion for r in rollouts],
                        completions_ids=[[5, 2]] * n, completions_sequences=[[] for _ in range(n)],
                        tool_call_counts=[0] * n, tool_failure_counts=[0] * n, model_version=1, group_id=0,
                        row_index=0, env_rewards=env_rewards or [None] * n, rollout_rewards=[None] * n,
                        rollouts=rollouts)


RELEASE = threading.Event()


def stuck_judge(completions, **kwargs):
    RELEASE.wait(5.0)  # a judge that never answers (released at the end so no thread outlives the test long)
    return [1.0] * len(completions)


async def slow_async_judge(completions, **kwargs):
    await asyncio.sleep(5.0)
    return [1.0] * len(completions)


def quick(completions, **kwargs):
    return [float(i) for i in range(len(completions))]


@pytest.mark.parametrize("judge", [stuck_judge, slow_async_judge])
def test_a_late_reward_function_is_dropped_by_name_under_drop(judge, caplog):
    async def scored_within() -> float:  # the wait ends at the timeout (asyncio.run then joins the thread)
        start = time.monotonic()
        try:
            await score_group(group_of(), [quick, judge], "drop", timeout_s=0.6, progress_every=0.2, where="prompt 7")
        finally:
            RELEASE.set()
            assert time.monotonic() - start < 3.0

    with caplog.at_level("WARNING", logger="grpo.rollout"), pytest.raises(RewardFunctionError) as info:
        asyncio.run(scored_within())
    assert info.value.reason == "reward_timeout" and judge.__name__ in str(info.value)
    assert "prompt 7" in str(info.value) and "--reward-timeout-s" in str(info.value)
    lines = [r.getMessage() for r in caplog.records if "still waiting" in r.getMessage()]
    assert lines and judge.__name__ in lines[0] and "prompt 7" in lines[0] and "quick" not in lines[0]
    RELEASE.clear()


def test_a_late_reward_function_stops_the_run_by_name_under_raise():
    with pytest.raises(RewardTimeoutError, match="stuck_judge.*prompt 3.*--reward-errors drop"):
        asyncio.run(score_group(group_of(), [stuck_judge], "raise", timeout_s=0.3, where="prompt 3"))
    RELEASE.set()
    RELEASE.clear()


def test_a_reward_function_within_the_timeout_scores_as_before():
    sources = asyncio.run(score_group(group_of(3), [quick], "drop", timeout_s=5.0))
    assert list(sources["quick"]) == [0.0, 1.0, 2.0]


class SlowEnv:
    def get_reward(self):
        time.sleep(2.0)
        return 1.0


def test_a_late_get_reward_drops_the_group_under_drop_and_raises_under_raise():
    from concurrent.futures import ThreadPoolExecutor

    pool = ThreadPoolExecutor(2)
    late = asyncio.run(timed_get_reward(SlowEnv(), pool, 0.2, "drop", "prompt 1"))
    group = group_of(2, env_rewards=[(SlowEnv, late), (SlowEnv, 1.0)])
    with pytest.raises(RewardFunctionError, match=r"SlowEnv.get_reward\(\).*prompt 1") as info:
        asyncio.run(score_group(group, [quick], "drop", timeout_s=5.0))
    assert info.value.reason == "reward_timeout"
    with pytest.raises(RewardTimeoutError, match=r"SlowEnv.get_reward\(\)"):
        asyncio.run(timed_get_reward(SlowEnv(), pool, 0.2, "raise", "prompt 1"))
    pool.shutdown(wait=True)
