"""`reward_errors`: a reward function that raises stops the run with its traceback (`raise`, the default,
test_worker_faults.py), or drops its group with a counted, recorded reason (`drop`) while the run goes on. A
reward that returns the wrong shape is a bug in the reward, not a judge hiccup: it stops the run either way."""

from __future__ import annotations

import pytest

from .harness import named_error
from .test_worker_faults import pull, start_worker


def flaky_judge(prompts, completion_ids, **kwargs):
    """Raises for every third prompt ("Count to 0.", "Count to 3.", ...), scores the others."""
    number = int(prompts[0][-1]["content"].split()[-1].rstrip("."))
    if number % 3 == 0:
        raise ConnectionError(f"judge timed out on prompt {number}")
    return [float(len(ids) % 3) + 0.1 * i for i, ids in enumerate(completion_ids)]


def short_reward(completion_ids, **kwargs):
    return [1.0]


@pytest.mark.vllm
def test_reward_errors_drop_drops_the_group_with_its_reason_and_trains_the_rest(tiny_qwen3, faults_server):
    worker = start_worker(tiny_qwen3, faults_server.base_url, rewards=[flaky_judge], reward_errors="drop")
    try:
        samples = pull(worker, 12, seconds=240)
    finally:
        worker.stop()
    assert {s.row_index % 3 for s in samples} <= {1, 2}  # no sample of a prompt whose judge raised
    assert worker.ledger.drop_counts["reward_error"] >= 1
    drops = worker.drain_drops()
    assert drops and all(reason == "reward_error" and position % 3 == 0 for position, reason in drops), drops
    counted = [v for k, v in worker.drain_metrics() if k == "rollout/dropped_reward_error_count"]
    assert sum(counted) == worker.ledger.drop_counts["reward_error"]


@pytest.mark.vllm
def test_reward_errors_drop_still_stops_on_a_wrong_shaped_reward(tiny_qwen3, faults_server):
    worker = start_worker(tiny_qwen3, faults_server.base_url, rewards=[short_reward], reward_errors="drop")
    try:
        named_error(120, pull, "short_reward", "return", worker=worker, n=1, expected=RuntimeError)
    finally:
        worker.stop()
