"""The rollout worker process and its queue: picklability at start, the staleness drop rule, failure surfacing
(traceback, killed process, missing heartbeat), and samples streaming from a real vLLM server."""

from __future__ import annotations

import asyncio
import functools
import os
import signal
import time

import pytest

from grpo.config import AsyncGRPOConfig
from grpo.metrics import MetricsWindow
from grpo.rollout_worker import RolloutWorker, WorkerStart, check_picklable
from grpo.rollout_loop import AsyncRolloutLoop, ConsumedGroup
from grpo.samples import TrainingSample
from grpo.shared_state import LoopOptions

PROMPT = [{"role": "user", "content": "What is 3 + 4?"}]


def length_reward(completion_ids, **kwargs):
    return [float(len(ids) % 3) for ids in completion_ids]


def scaled_reward(completion_ids, scale, **kwargs):
    return [scale * len(ids) for ids in completion_ids]


class CallableReward:
    def __call__(self, completion_ids, **kwargs):
        return [0.0] * len(completion_ids)


def make_closure():
    offset = 1.0

    def closure_reward(completion_ids, **kwargs):
        return [offset] * len(completion_ids)

    return closure_reward


def config_for(model_dir, base_url="http://127.0.0.1:9", **kw) -> AsyncGRPOConfig:
    base = dict(model=str(model_dir), vllm_server_base_url=base_url, num_generations=4, max_completion_length=12,
                max_concurrent_rollouts=8)
    return AsyncGRPOConfig(**(base | kw))


# ---- picklability -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [lambda completion_ids, **kw: [0.0] * len(completion_ids), make_closure()])
def test_lambda_or_closure_reward_fails_at_start_naming_the_fix(bad, tiny_qwen3):
    worker = RolloutWorker(config_for(tiny_qwen3), [{"prompt": PROMPT}], [bad])
    with pytest.raises(TypeError, match="module level.*functools.partial.*callable class"):
        worker.start()
    assert worker.process is None  # nothing was spawned


def test_module_functions_partials_and_callable_instances_pickle():
    check_picklable([length_reward, functools.partial(scaled_reward, scale=2.0), CallableReward()],
                    tools=[length_reward], environment_factory={"a": CallableReward}, loop_cls=AsyncRolloutLoop)
    with pytest.raises(TypeError, match="tool"):
        check_picklable(tools=[lambda x: x])


# ---- the drop rule (no process needed: _accept books one queue item) ------------------------------------------


def sample(version, group_id, n=5):
    return TrainingSample(input_ids=list(range(n)), completion_mask=[0, 1, 1, 1, 1], sampler_logprobs=[0.0] * n,
                          advantage=1.0, group_id=group_id, model_version=version, queued_at=time.monotonic())


def test_queue_drops_exactly_the_over_stale_samples(tiny_qwen3):
    worker = RolloutWorker(config_for(tiny_qwen3, max_staleness=4), [{"prompt": PROMPT}] * 10, [length_reward])
    worker.set_model_version(6)
    worker.shared.queued_tokens.value = 7 * 5
    items = [sample(v, group_id=v) for v in range(7)]
    accepted = [s for s in map(worker._accept, items) if s is not None]
    assert [s.model_version for s in accepted] == [2, 3, 4, 5, 6]  # staleness 6 - v <= 4
    assert worker.shared.queued_tokens.value == 0  # dropped samples leave the token count too
    w = MetricsWindow()
    w.extend(worker.drain_metrics())
    out = w.reduce()
    assert out["sample/dropped_stale_count"] == 2
    assert out["sample/staleness_max"] == 4 and out["sample/staleness_mean"] == 2.0
    # a pulled sample is not consumed (it may die in the batcher); a stale drop is (regression: a stale drop used
    # to hold the resume point back forever, so a resume retrained everything after it)
    assert worker.delivered.count == 7 and worker.consumed_groups == 2
    assert worker.state_dict()["prompt_index"] == 2 and worker.drain_drops() == [(0, "stale"), (1, "stale")]
    worker.mark_trained([s for s in accepted if s.group_id != 3])
    assert worker.consumed_groups == 6
    assert worker.state_dict() == {"prompt_index": 3, "consumed_above": [4, 5, 6], "partial": [], "model_version": 6,
                                   "carried": []}
    half, rest = sample(6, group_id=9), sample(6, group_id=9)
    half.group_size = rest.group_size = 2  # one of the group's two samples trained, the other still open
    worker.mark_trained([half])
    state = worker.state_dict(open_samples=[rest])
    assert state["partial"] == [9] and [c["position"] for c in state["carried"]] == [9]
    worker._accept(ConsumedGroup(3, "equal_rewards"))
    worker._accept(ConsumedGroup(8, "filtered"))
    # a partial group is not consumed: it holds the low-water mark, and its rest is carried
    assert worker.state_dict()["prompt_index"] == 7 and worker.state_dict()["consumed_above"] == [8]
    worker.mark_trained([rest])
    assert worker.state_dict()["consumed_above"] == [8, 9] and worker.state_dict()["partial"] == []


# ---- failure surfacing -------------------------------------------------------------------------------------------


class FailingSetup(AsyncRolloutLoop):
    async def setup(self):
        raise ValueError("boom from setup")


class IdleLoop(AsyncRolloutLoop):
    async def setup(self):
        await asyncio.sleep(3600)  # alive and beating, never generating


class BlockingSetup(AsyncRolloutLoop):
    async def setup(self):
        time.sleep(3600)  # blocks the event loop: no heartbeat


def test_worker_exception_reaches_get_with_traceback(tiny_qwen3):
    worker = RolloutWorker(config_for(tiny_qwen3), [{"prompt": PROMPT}], [length_reward], loop_cls=FailingSetup)
    worker.start()
    try:
        with pytest.raises(RuntimeError, match="(?s)Traceback.*in setup.*ValueError: boom from setup"):
            worker.get(timeout=120)
    finally:
        worker.stop()


def test_killed_worker_makes_get_raise_within_the_timeout(tiny_qwen3):
    worker = RolloutWorker(config_for(tiny_qwen3, rollout_worker_timeout=300), [{"prompt": PROMPT}],
                           [length_reward], loop_cls=IdleLoop)
    worker.start()
    try:
        assert worker.get(timeout=3) is None  # alive, nothing to give
        os.kill(worker.process.pid, signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(RuntimeError, match="killed by signal 9"):
            worker.get(timeout=60)
        assert time.monotonic() - start < 10
    finally:
        worker.stop()


class DeafLoop(AsyncRolloutLoop):
    async def run(self):
        self.shared.metrics.put([("deaf/running", 1.0)])
        while True:  # never looks at the stop event
            await asyncio.sleep(0.05)


def test_a_worker_slow_to_stop_prints_where_it_is(tiny_qwen3, capfd, monkeypatch):
    """Asked to stop, a worker still running after GRPO_WORKER_STOP_REPORT_S prints its threads' stacks and its
    event loop's tasks to stderr before the trainer terminates it; the trainer warns how long it took."""
    monkeypatch.setenv("GRPO_WORKER_STOP_REPORT_S", "1")
    worker = RolloutWorker(config_for(tiny_qwen3), [{"prompt": PROMPT}], [length_reward], loop_cls=DeafLoop)
    worker.start()
    deadline = time.monotonic() + 120
    while ("deaf/running", 1.0) not in worker.drain_metrics():  # its loop runs (imports done)
        assert time.monotonic() < deadline
        worker.check_alive()
        time.sleep(0.2)
    worker.stop(timeout=6)
    err = capfd.readouterr().err
    assert "still running 1 s after the trainer asked it to stop" in err, err[-2000:]
    assert "Thread" in err and "DeafLoop.run" in err, err[-3000:]  # thread stacks, then the loop's task
    assert not worker.process.is_alive()


@pytest.mark.slow
def test_hung_worker_is_detected_by_its_heartbeat(tiny_qwen3):
    worker = RolloutWorker(config_for(tiny_qwen3, rollout_worker_timeout=8), [{"prompt": PROMPT}],
                           [length_reward], loop_cls=BlockingSetup)
    worker.start()
    try:
        start = time.monotonic()
        with pytest.raises(RuntimeError, match="hung: no heartbeat"):
            worker.get(timeout=120)
        assert time.monotonic() - start < 60
    finally:
        worker.stop(timeout=2)  # hung for good: terminate it without stop's usual grace


# ---- a real run ------------------------------------------------------------------------------------------------


@pytest.mark.vllm
def test_worker_streams_scored_samples(vllm_server, tiny_qwen3):
    config = config_for(tiny_qwen3, vllm_server.base_url)
    worker = RolloutWorker(config, [{"prompt": PROMPT, "answer": "7"}] * 3, [length_reward],
                           start=WorkerStart(model_version=1))
    worker.start()
    try:
        got = [worker.get(timeout=120) for _ in range(6)]
        assert all(s is not None and s.model_version == 1 and s.num_trained > 0 for s in got)
        assert all(s.completion_mask[0] == 0 and len(s.sampler_logprobs) == len(s.input_ids) for s in got)
        names = ("reward", "frac_reward_zero_std", "completions/mean_length", "rollout/concurrency_cap",
                 "rollout/vllm_kv_cache_usage_frac", "sample/staleness_max")
        items, deadline = [], time.monotonic() + 60  # the gauges come with the worker's next /metrics poll (5 s)
        while not {name for name, _ in items} >= set(names):
            assert time.monotonic() < deadline, f"no {set(names) - {n for n, _ in items}} within 60 s"
            items += worker.drain_metrics()
            time.sleep(0.1)
        w = MetricsWindow()
        w.extend(items)
        out = w.reduce()
        for name in names:
            assert name in out, name
        waited = worker.take_wait_s()  # the six gets waited for generation: the step's total, taken once
        assert waited > 0 and worker.take_wait_s() == 0.0
        assert worker.delivered.count >= 1
        trained_ids = {s.group_id for s in got}
        assert not trained_ids & set(range(worker.consumed.low_water))  # pulled samples do not count as trained
        worker.mark_trained(got)
        assert worker.consumed_groups >= len(trained_ids) and worker.state_dict()["prompt_index"] >= 1
    finally:
        start = time.monotonic()
        worker.stop()
        assert time.monotonic() - start < 30 and not worker.process.is_alive()


def test_groups_dropped_in_a_row_stop_with_the_reason_and_a_kept_sample_resets_the_count(tiny_qwen3):
    worker = RolloutWorker(config_for(tiny_qwen3, max_dropped_groups_in_a_row=3), [{"prompt": PROMPT}] * 9,
                           [length_reward])
    worker._accept(ConsumedGroup(0, "equal_rewards"))
    worker._accept(ConsumedGroup(1, "unscored"))
    assert worker._accept(sample(0, group_id=2)) is not None  # a kept group resets the count
    worker._accept(ConsumedGroup(3, "filtered"))  # filtering is the user's choice, not a missing signal
    worker._accept(ConsumedGroup(4, "equal_rewards"))
    worker._accept(ConsumedGroup(5, "equal_rewards"))
    with pytest.raises(RuntimeError, match="3 groups in a row.*equal_rewards.*rollout.py sample"):
        worker._accept(ConsumedGroup(6, "unscored"))


def test_samples_that_went_stale_in_the_batcher_are_dropped_at_batch_close(tiny_qwen3):
    """The batch-closing sample starts the next micro-batch and can wait there across a weight sync: staleness
    is checked again when its batch closes (it could exceed max_staleness by one)."""
    worker = RolloutWorker(config_for(tiny_qwen3, max_staleness=1), [{"prompt": PROMPT}] * 9, [length_reward])
    worker.set_model_version(5)
    rows = [[sample(4, group_id=0), sample(3, group_id=1)], [sample(3, group_id=2)]]
    kept, dropped = worker.recheck_staleness(rows)
    assert dropped == 2 and [s.group_id for s in kept[0]] == [0]
    assert [s.group_id for s in kept[1]] == [-1] and kept[1][0].num_trained == 0  # a dummy keeps the rank busy
    assert worker.drain_drops() == [(1, "stale"), (2, "stale")] and worker.state_dict()["prompt_index"] == 0


def test_the_untrained_rest_of_a_partial_group_is_carried_through_a_resume(tiny_qwen3):
    """Group 2 (3 samples): one trained before the checkpoint, one in the batcher's open micro-batch, one still in
    the pipe. The checkpoint carries the two (JSON, arrays and -inf included); the resumed worker does not draw
    prompt 2 again, hands the two out first, and consumes the prompt once they are trained."""
    import json

    import numpy as np

    from grpo.ledger import resume_skips

    rows = [{"prompt": PROMPT}] * 10
    worker = RolloutWorker(config_for(tiny_qwen3), rows, [length_reward])
    group = [sample(1, group_id=2) for _ in range(3)]
    for i, s in enumerate(group):
        s.group_size, s.rollout_id, s.advantage = 3, f"r{i}", 0.5 - i
        s.sampler_top_ids = np.arange(10, dtype=np.int64).reshape(5, 2)
        s.sampler_top_logprobs = np.full((5, 2), -np.inf, dtype=np.float32)
        s.sampler_top_logprobs[1:, 0] = -0.25
    for g in (0, 1):
        worker.ledger.dropped(g, "equal_rewards")
    worker.mark_trained([group[0]])
    worker._inbox.put(group[2])
    state = json.loads(json.dumps(worker.state_dict(open_samples=[group[1]]) | {"step": 4}))
    assert state["prompt_index"] == 2 and state["partial"] == [2]
    assert [c["rollout_id"] for c in state["carried"]] == ["r1", "r2"]
    assert [item.rollout_id for item, counted in worker._front] == ["r2"]  # pulled early, still handed out here

    options = LoopOptions(dataset_start_index=state["prompt_index"], skip_positions=frozenset(resume_skips(state)))
    resumed = RolloutWorker(config_for(tiny_qwen3), rows, [length_reward], options,
                            start=WorkerStart(carried=tuple(state["carried"])))
    assert 2 in resumed.spec.options.skip_positions  # not generated again
    back = [resumed._accept(item, counted) for item, counted in list(resumed._front)]
    for old, new in zip(group[1:], back):
        assert new.group_id == 0 and new.key == old.key and new.advantage == old.advantage
        assert new.input_ids == old.input_ids and new.sampler_logprobs == old.sampler_logprobs
        np.testing.assert_array_equal(new.sampler_top_ids, old.sampler_top_ids)
        np.testing.assert_array_equal(new.sampler_top_logprobs, old.sampler_top_logprobs)
    assert resumed.state_dict()["prompt_index"] == 2  # the rest is not trained yet
    resumed.mark_trained(back)
    assert resumed.state_dict()["prompt_index"] == 3 and resumed.state_dict()["partial"] == []
