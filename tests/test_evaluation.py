"""Held-out evaluation in the rollout worker (grpo/evaluation.py) against the shared real vLLM server: eval groups
are generated at the requested weight version, scored, reported as eval/*, and never reach the trainer's queue."""

from __future__ import annotations

import asyncio
import multiprocessing
import queue
import threading
import time

import pytest
from test_rollout_loop import PROMPT, make_config, make_loop, tokenizer  # noqa: F401 (module fixture)

from grpo.evaluation import eval_due, eval_metrics
from grpo.rollout_loop import AsyncRolloutLoop


def test_eval_metrics_by_hand():
    # 2 prompts, k = 3: greedy 1, 0; sampled [1, 0, 0] and [0, 0, None]
    got = eval_metrics([1.0, 0.0], [[1.0, 0.0, 0.0], [0.0, 0.0, float("nan")]], [4, 6, 2, 8], 7, 1.5)
    assert got["eval/reward"] == 0.5 and got["eval/pass@k"] == 0.5
    assert got["eval/mean@k"] == pytest.approx((1 / 3 + 0) / 2) and got["eval/mean_length"] == 5.0
    assert got["eval/model_version"] == 7.0 and got["eval/unscored_count"] == 1.0 and got["eval/num_prompts"] == 2


def test_the_schedule_is_a_function_of_the_step():  # so a resumed run keeps it
    assert [s for s in range(0, 13) if eval_due(s, 4)] == [4, 8, 12]
    assert not any(eval_due(s, 0) for s in range(10))


def first_token_even(completion_ids, **kwargs):
    return [float(bool(ids) and ids[0] % 2 == 0) for ids in completion_ids]


class CountingLoop(AsyncRolloutLoop):
    """Records the temperature and weight version of every request (the eval path goes through the same hooks)."""

    requests: list

    async def generate_one_turn(self, prompt_ids):
        from grpo.evaluation import sampling_override_var
        from grpo.scheduler import model_version_var

        self.requests.append(((sampling_override_var.get() or {}).get("temperature", self.config.temperature),
                              model_version_var.get()))
        return await super().generate_one_turn(prompt_ids)


def test_eval_groups_run_beside_training_and_are_never_trained(vllm_server, tiny_qwen3, tokenizer):
    config = make_config(vllm_server, tiny_qwen3, num_generations=2, eval_num_generations=3)
    train_rows = [{"prompt": PROMPT}, {"prompt": [{"role": "user", "content": "the sky is"}]}]
    eval_rows = [{"prompt": [{"role": "user", "content": f"count to {i}"}]} for i in range(3)]
    ctx = multiprocessing.get_context("spawn")
    samples, metrics = queue.Queue(), queue.Queue()
    loop = make_loop(CountingLoop, config, train_rows, [first_token_even], tokenizer, samples=samples,
                     metrics=metrics, model_version=ctx.Value("q", 5), eval_request=ctx.Value("q", 5),
                     eval_done=ctx.Value("q", 0), stop=ctx.Event(), eval_dataset=eval_rows)
    loop.requests = []

    def stop_after_eval():  # the eval of version 5 was requested before the start; training runs until it is done
        while loop.shared.eval_done.value < 5:
            time.sleep(0.1)
        loop.shared.stop.set()

    threading.Thread(target=stop_after_eval, daemon=True).start()
    asyncio.run(loop.run(max_groups=None))
    items = [item for batch in iter(lambda: metrics.get() if not metrics.empty() else None, None) for item in batch]
    evals = {name: value for name, value in items if name.startswith("eval/")}
    assert evals["eval/model_version"] == 5.0 and evals["eval/num_prompts"] == 3.0
    assert 0.0 <= evals["eval/reward"] <= 1.0 and evals["eval/mean@k"] <= evals["eval/pass@k"] <= 1.0
    assert evals["eval/mean_length"] > 0
    greedy = [r for r in loop.requests if r[0] == 0.0]
    assert len(greedy) == 3 and all(version == 5 for _, version in greedy)  # one greedy rollout per eval prompt
    assert sum(1 for t, _ in loop.requests if t == config.temperature) >= 3 * 3  # k sampled per eval prompt
    published = []
    while not samples.empty():
        published.append(samples.get())
    assert published and all(item.group_id >= 0 for item in published)  # nothing from the eval groups (< -1)


def test_a_request_superseded_before_it_started_is_counted_as_skipped():
    from grpo.config import AsyncGRPOConfig
    from grpo.rollout_worker import RolloutWorker

    worker = RolloutWorker(AsyncGRPOConfig(), dataset=[])
    worker.request_eval(3)
    worker.request_eval(5)  # the worker never started version 3
    worker.shared.eval_started.value = 5
    worker.request_eval(7)  # 5 is running: it is not skipped, 7 waits for it
    worker.request_eval(7)  # the same request again (the final eval after an eval step) skips nothing
    assert worker.drain_metrics().count(("eval/skipped_count", 1)) == 1
    assert worker.shared.eval_request.value == 7


def test_wait_eval_returns_with_the_eval_metrics_in_hand():
    """The worker books an eval done right after its `put`, which reaches the pipe later (a feeder thread): the
    final eval's metrics must still be in the next `drain_metrics` (CI once logged the run without them)."""
    import threading
    import time

    from grpo.config import AsyncGRPOConfig
    from grpo.rollout_worker import RolloutWorker

    worker = RolloutWorker(AsyncGRPOConfig(), dataset=[])
    worker.check_alive = lambda: None  # no worker process here: this thread plays its part
    worker.request_eval(5)

    def late_worker():
        worker.shared.metrics.put([("gen/x", 1.0)])
        worker.shared.eval_done.value = 5  # booked done before its metrics are readable
        time.sleep(0.5)
        worker.shared.metrics.put([("eval/reward", 0.5), ("eval/model_version", 5.0)])

    thread = threading.Thread(target=late_worker)
    thread.start()
    assert worker.wait_eval(5, timeout=30)
    thread.join()
    items = worker.drain_metrics()
    assert items == [("gen/x", 1.0), ("eval/reward", 0.5), ("eval/model_version", 5.0)]  # in order, none lost
    assert worker.wait_eval(5, timeout=0.5)  # already read: no second wait
    worker.request_eval(7)
    worker.shared.eval_done.value = 7
    assert not worker.wait_eval(7, timeout=0.5)  # done but its metrics never come: the timeout says so


def test_two_evaluations_in_one_window_are_logged_apart(tmp_path):
    """Evaluations that finish in the same logging window are never averaged: the newest rides in the window's row,
    the earlier one gets a row of its own at the same step; the trainer's skip counter is summed with the window."""
    import json

    from grpo.evaluation import eval_metrics
    from grpo.metrics import MetricsLogger
    from grpo.step_metrics import log_window

    v3 = eval_metrics([1.0, 0.0], [[1.0, 0.0], [0.0, 0.0]], [4, 6], 3, 1.5)
    v5 = eval_metrics([1.0, 1.0], [[1.0, 1.0], [1.0, 0.0]], [5, 5], 5, 2.0)
    items = ([("gen/x", 1.0)] + list(v3.items()) + [("eval/skipped_count", 1.0), ("gen/x", 3.0)] + list(v5.items())
             + [("eval/skipped_count", 1.0)])
    logger = MetricsLogger(tmp_path, console=False, trackers=[])
    log_window(logger, 4, [{"loss": 0.5}], list(items))
    logger.close()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [4, 4]
    assert {k: v for k, v in rows[0].items() if k not in ("step", "time")} == v3
    assert {k: v for k, v in rows[1].items() if k.startswith("eval/") and k != "eval/skipped_count"} == v5
    assert rows[1]["eval/skipped_count"] == 2.0 and rows[1]["gen/x"] == 2.0 and rows[1]["loss"] == 0.5
