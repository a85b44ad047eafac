"""Faults on the generation side, against a real vLLM CPU server (through the fault proxy where a fault is
injected): each scenario ends in recovery (samples keep arriving, the fault counted) or in a named error from
`RolloutWorker.get` within its deadline. The worker is the real spawned process the trainer uses."""

from __future__ import annotations

import os
import signal
import struct
import subprocess
import sys
import time

import pytest

from grpo.config import AsyncGRPOConfig
from grpo.metrics import MetricsWindow
from grpo.rollout_worker import RolloutWorker
from grpo.rollout_loop import AsyncRolloutLoop

from .harness import named_error, within
from .proxy import wait_until

PROMPT = [{"role": "user", "content": "What is 3 + 4?"}]
ROWS = [{"prompt": [{"role": "user", "content": f"Count to {i}."}]} for i in range(12)]


def length_reward(completion_ids, **kwargs):
    return [float(len(ids) % 3) + 0.1 * i for i, ids in enumerate(completion_ids)]


def constant_reward(completion_ids, **kwargs):
    return [1.0] * len(completion_ids)


def none_reward(completion_ids, **kwargs):
    return [None] * len(completion_ids)


def raising_reward(completion_ids, **kwargs):
    raise KeyError("judge_score")


def short_reward(completion_ids, **kwargs):
    return [1.0]


class FastPoll(AsyncRolloutLoop):
    metrics_poll_s = 0.3


class IdleLoop(AsyncRolloutLoop):
    async def setup(self):  # alive and beating, never generating, until the trainer stops it
        import asyncio

        while not self._stopping():
            await asyncio.sleep(0.2)


def config_for(model_dir, base_url, **kw) -> AsyncGRPOConfig:
    base = dict(model=str(model_dir), vllm_server_base_url=base_url, num_generations=4, max_completion_length=8,
                max_concurrent_rollouts=8, rollout_worker_timeout=60, vllm_server_timeout=30,
                progress_interval_s=2.0)
    return AsyncGRPOConfig(**(base | kw))


def start_worker(model_dir, base_url, rows=ROWS, rewards=(length_reward,), loop_cls=FastPoll,
                 token_allowance: float = 4000.0, **kw):
    """A real worker; the token allowance stands in for the trainer's backpressure (it idles once that much is
    queued and nobody pulls)."""
    worker = RolloutWorker(config_for(model_dir, base_url, **kw), rows, list(rewards), loop_cls=loop_cls)
    worker.set_token_allowance(token_allowance)
    worker.start()
    return worker


def pull(worker, n: int, seconds: float = 120) -> list:
    def take():
        out = []
        while len(out) < n:
            sample = worker.get(timeout=5)
            if sample is not None:
                out.append(sample)
        return out

    return within(seconds, take)


def metrics(worker) -> dict:
    w = MetricsWindow()
    w.extend(worker.drain_metrics())
    return w.reduce()


# ---- recovered: retried or counted (one worker lives through these, one fault after the other) -----------------


@pytest.fixture(scope="module")
def module_proxy(faults_server):
    from .proxy import FaultProxy

    p = FaultProxy(faults_server.base_url)
    yield p
    p.close()


@pytest.fixture(scope="module")
def live_worker(tiny_qwen3, module_proxy):
    worker = start_worker(tiny_qwen3, module_proxy.base_url)
    pull(worker, 1, seconds=180)
    yield worker
    worker.stop()


@pytest.fixture
def faults(module_proxy, live_worker):
    metrics(live_worker)  # start a fresh window
    yield module_proxy
    module_proxy.clear()


@pytest.mark.vllm
@pytest.mark.parametrize("route, action, count", [
    ("/metrics", "reset", None),  # every poll fails: counted, never fatal (it used to kill the worker in 5 s)
    ("/v1/completions", "503", 3),  # 5xx: retried with backoff
    ("/v1/completions", "reset", 3),  # connection reset mid-request: retried
])
def test_transient_server_faults_are_retried_or_counted(live_worker, faults, route, action, count):
    faults.add(route, action, count)
    assert len(pull(live_worker, 8)) == 8
    key = "rollout/vllm_metrics_error_count" if route == "/metrics" else "rollout/vllm_retry_count"
    wait_for_count(live_worker, key, count or 1)


def wait_for_count(worker, key: str, at_least: int, seconds: float = 90) -> None:
    """The counter's sum over the worker's metrics reaches `at_least` (the poller pushes it every `metrics_poll_s`,
    which a loaded machine stretches: waiting a fixed second was flaky in CI). Samples keep being pulled meanwhile,
    so the worker is never held by backpressure while the retried requests are due."""
    seen = []

    def reached():
        worker.get(timeout=0.5)
        seen.extend(value for name, value in worker.drain_metrics() if name == key)
        return sum(seen) >= at_least

    wait_until(reached, seconds, f"{key} >= {at_least} (seen so far: {sum(seen):g})")


@pytest.mark.vllm
def test_server_down_then_back_is_retried(live_worker, faults):
    """Connections reset for 3 s (a server restart, seen from the client): generation retries and recovers."""
    faults.down()
    time.sleep(3.0)
    faults.up()
    assert len(pull(live_worker, 8)) == 8


@pytest.mark.vllm
def test_server_sigstopped_during_generation_recovers(live_worker, faults, faults_server):
    """The real server frozen for 4 s (SIGSTOP to its process group) and continued: requests just wait."""
    os.killpg(faults_server.proc.pid, signal.SIGSTOP)
    try:
        time.sleep(4.0)
    finally:
        os.killpg(faults_server.proc.pid, signal.SIGCONT)
    assert len(pull(live_worker, 8)) == 8


# ---- stopped with a named error -----------------------------------------------------------------------------------


@pytest.mark.vllm
@pytest.mark.parametrize("where", ["first_row", "one_row_among_many"])
def test_over_long_prompt_stops_the_run_with_the_limit(tiny_qwen3, faults_server, where):
    """The spec: a prompt the server cannot take stops the run with the server's limit (it used to be dropped
    silently, every epoch)."""
    long_row = {"prompt": [{"role": "user", "content": " ".join(["word"] * 600)}]}
    rows = [long_row] + ROWS if where == "first_row" else ROWS[:3] + [long_row] + ROWS[3:]
    worker = start_worker(tiny_qwen3, faults_server.base_url, rows=rows)
    try:
        named_error(120, pull, "max_model_len", "max-model-len", "prompt", worker=worker, n=10_000,
                    expected=RuntimeError)
    finally:
        worker.stop()


@pytest.mark.vllm
@pytest.mark.parametrize("reward, reason", [(constant_reward, "equal_rewards"), (none_reward, "unscored")])
def test_no_group_ever_kept_stops_with_the_reason(tiny_qwen3, faults_server, reward, reason):
    """Every group dropped at scoring: a named error after max_dropped_groups_in_a_row (it used to wait forever
    with no log line), with progress lines while waiting."""
    worker = start_worker(tiny_qwen3, faults_server.base_url, rewards=[reward], max_dropped_groups_in_a_row=4)
    try:
        named_error(120, pull, reason, "reward", worker=worker, n=1, expected=RuntimeError)
        assert worker.ledger.drop_counts[reason] >= 4
    finally:
        worker.stop()


@pytest.mark.vllm
@pytest.mark.parametrize("reward, needle", [(raising_reward, "judge_score"), (short_reward, "short_reward")])
def test_reward_raising_or_wrong_length_stops_with_its_traceback(tiny_qwen3, faults_server, reward, needle):
    worker = start_worker(tiny_qwen3, faults_server.base_url, rewards=[reward])
    try:
        named_error(120, pull, needle, "traceback", worker=worker, n=1, expected=RuntimeError)
    finally:
        worker.stop()


@pytest.mark.vllm
def test_worker_sigkill_is_named_at_once(tiny_qwen3, faults_server):
    worker = start_worker(tiny_qwen3, faults_server.base_url)
    try:
        pull(worker, 1)
        os.kill(worker.process.pid, signal.SIGKILL)
        start = time.monotonic()
        named_error(30, pull, "killed by signal 9", worker=worker, n=10_000, expected=RuntimeError)
        assert time.monotonic() - start < 15
    finally:
        worker.stop()


def test_worker_frozen_half_way_through_a_sample_is_named_not_a_deadlock(tiny_qwen3):
    """SIGSTOP while a sample is half written: the trainer used to block forever inside the pipe read, with the
    heartbeat check unreachable. The half message is written into the real queue's pipe."""
    worker = RolloutWorker(config_for(tiny_qwen3, "http://127.0.0.1:9", rollout_worker_timeout=4), ROWS,
                           [length_reward], loop_cls=IdleLoop)
    worker.start()
    try:
        assert worker.get(timeout=3) is None  # alive and beating
        os.kill(worker.process.pid, signal.SIGSTOP)
        writer = worker.shared.samples._writer
        os.write(writer.fileno(), struct.pack("!i", 4096) + b"\x80\x04" + b"x" * 100)  # header promises 4096 bytes
        named_error(30, worker.get, "hung", "heartbeat", timeout=60, expected=RuntimeError)
    finally:
        os.kill(worker.process.pid, signal.SIGCONT)
        worker.stop()


TRAINER = """
import sys, time
sys.path[:0] = {paths!r}
from faults.test_worker_faults import IdleLoop, config_for, length_reward, ROWS
from grpo.rollout_worker import RolloutWorker
if __name__ == "__main__":
    worker = RolloutWorker(config_for({model!r}, "http://127.0.0.1:9"), ROWS, [length_reward], loop_cls=IdleLoop)
    worker.start()
    print(worker.process.pid, flush=True)
    time.sleep(600)
"""


def test_trainer_sigkill_leaves_no_orphan_worker(tiny_qwen3, tmp_path):
    """SIGKILL of the trainer gives it no chance to stop the worker: the worker's parent watchdog ends it."""
    import psutil

    script = tmp_path / "trainer.py"
    script.write_text(TRAINER.format(paths=sys.path[:6], model=str(tiny_qwen3)))
    trainer = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        worker_pid = int(within(120, trainer.stdout.readline))
        trainer.kill()
        trainer.wait()
        wait_until(lambda: not psutil.pid_exists(worker_pid) or psutil.Process(worker_pid).status() == "zombie",
                   15, "the orphaned worker to exit")
    finally:
        if trainer.poll() is None:
            trainer.kill()
