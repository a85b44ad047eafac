"""Bad reward values and failing environments (issue 19): a reward that is not a number stops the run with a
TypeError naming its source; NaN/±inf rewards are scored as None, counted and warned about (they used to turn the
group's advantages into NaN); a failing `reset()` is retried, then its prompt is dropped with a counted reason
(it used to end the run); `max_completion_length` at or above the server's `max_model_len` is warned about once.

Two kinds of scenario: the real spawned worker against the real CPU server (what a run sees), and the real
scheduler in-process with scripted turns where the environment path is what matters (no generation needed)."""

from __future__ import annotations

import asyncio
import json
import logging
import math
import queue

import numpy as np
import pytest

from grpo.config import AsyncGRPOConfig
from grpo.metrics import MetricsWindow
from grpo.rollout_loop import AsyncRolloutLoop
from grpo.samples import TurnRecord
from grpo.shared_state import LoopOptions, SharedState

from .harness import audit, named_error, within
from .test_run_faults import records, run, train_cmd
from .test_worker_faults import metrics, pull, start_worker

ROWS = [{"prompt": [{"role": "user", "content": f"Count to {i}."}]} for i in range(6)]


def string_reward(completion_ids, **kwargs):
    return ["high"] * len(completion_ids)


def nonfinite_reward(completion_ids, **kwargs):
    """Per group of 6: -inf, +inf, NaN, then three distinct finite rewards (the group stays trainable)."""
    special = [-math.inf, math.inf, math.nan]
    return [special[i] if i < 3 else float(len(ids) % 3) + 0.1 * i for i, ids in enumerate(completion_ids)]


def index_reward(completion_ids, **kwargs):
    return [0.1 * i for i in range(len(completion_ids))]


# ---- c. a reward that is not a number: named TypeError ---------------------------------------------------------


@pytest.mark.vllm
def test_string_reward_stops_with_a_type_error_naming_the_function(tiny_qwen3, faults_server):
    """It used to stop with a bare `could not convert string to float: 'high'` naming neither the function nor
    the fix."""
    worker = start_worker(tiny_qwen3, faults_server.base_url, rows=ROWS, rewards=[string_reward])
    try:
        named_error(120, pull, "TypeError", "string_reward", "'high'", "(str)", "return floats or None",
                    worker=worker, n=1, expected=RuntimeError)
    finally:
        worker.stop()


class Scripted(AsyncRolloutLoop):
    """No generation: each turn answers a fixed text (the scheduler, environments and scoring are the real ones)."""

    rollout_reward = None

    async def generate_one_turn(self, prompt_ids):
        ids = self.tokenizer.encode("done", add_special_tokens=False) + [self.tokenizer.eos_token_id]
        return TurnRecord(list(prompt_ids), ids, [-1.0] * len(ids), finish_reason="stop")

    async def generate_one(self, prompt, tools, group_id=0):
        rollout = await super().generate_one(prompt, tools, group_id)
        rollout.reward = self.rollout_reward
        return rollout


class WordEnv:
    """get_reward returns a word: a non-number."""

    def reset(self, **row):
        return None

    def get_reward(self):
        return "good"


class InfEnv:
    def reset(self, **row):
        return None

    def get_reward(self):
        return math.inf


class ListReward(Scripted):
    rollout_reward = [1.0]


class NanReward(Scripted):
    rollout_reward = math.nan


def run_scripted(tiny_qwen3, loop_cls=Scripted, rows=ROWS[:2], rewards=(index_reward,), groups=None, **kw):
    """The real scheduler in-process (no server is reached: turns are scripted, /metrics polls fail and are
    counted); returns (groups scored, reduced metrics)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_qwen3)
    config = AsyncGRPOConfig(**({"model": str(tiny_qwen3), "vllm_server_base_url": "http://127.0.0.1:9",
                                 "num_generations": 4, "max_completion_length": 8} | kw.pop("config", {})))
    out, seen = queue.Queue(), []
    shared = SharedState(metrics=out, samples=kw.pop("samples", None))
    options = LoopOptions(group_callback=lambda g, adv, kept: seen.append((g, adv, kept)), **kw)
    loop = loop_cls(config, config.model, rows, list(rewards), tokenizer, [tokenizer.eos_token_id], shared, options)
    try:
        within(60, asyncio.run, loop.run(max_groups=groups if groups is not None else len(rows)))
    finally:
        w = MetricsWindow()
        while not out.empty():
            w.extend(out.get())
        loop.test_metrics = w.reduce()
    return seen, loop.test_metrics


@pytest.mark.parametrize("source", ["get_reward", "Rollout.reward"])
def test_non_number_from_an_environment_or_a_rollout_is_a_named_type_error(tiny_qwen3, source):
    """get_reward() returning "good" used to stop with `could not convert string to float`; a list in
    Rollout.reward the same way, naming neither the source nor the fix."""
    if source == "get_reward":
        needles = ("WordEnv.get_reward()", "'good'", "(str)", "return floats or None")
        kw = dict(rewards=(), environment_factory=WordEnv)
    else:
        needles = ("Rollout.reward", "[1.0]", "(list)", "return floats or None")
        kw = dict(loop_cls=ListReward)
    named_error(90, run_scripted, *needles, expected=TypeError, tiny_qwen3=tiny_qwen3, **kw)


# ---- d. NaN / ±inf: scored as None, counted, warned ------------------------------------------------------------


@pytest.mark.vllm
def test_nonfinite_rewards_are_unscored_and_counted_not_nan_advantages(tiny_qwen3, faults_server):
    """-inf / +inf / NaN from a reward function: those rollouts are unscored (advantage 0), the others keep their
    group-normalised advantages, and `rewards/nonfinite_count` counts them. An -inf reward used to make every
    advantage of its group NaN (and the loss with it)."""
    worker = start_worker(tiny_qwen3, faults_server.base_url, rows=ROWS, rewards=[nonfinite_reward],
                          num_generations=6)
    try:
        samples = pull(worker, 12)
        advantages = np.array([s.advantage for s in samples])
        assert np.isfinite(advantages).all(), advantages
        assert np.isfinite([s.reward for s in samples if s.advantage != 0.0]).all()
        out = metrics(worker)
        assert out["rewards/nonfinite_count"] >= 3, out
        assert out["rewards/nonfinite_reward/nonfinite_count"] >= 3, out
    finally:
        worker.stop()


@pytest.mark.parametrize("source", ["get_reward", "Rollout.reward"])
def test_nonfinite_environment_or_rollout_reward_is_unscored_counted_and_warned(tiny_qwen3, caplog, source):
    """The same rule for an environment's get_reward() (inf) and for Rollout.reward (an explicit NaN): scored as
    None, counted per source, one warning naming the source (not one per rollout)."""
    name = "InfEnv.get_reward()" if source == "get_reward" else "Rollout.reward"
    kw = dict(environment_factory=InfEnv) if source == "get_reward" else dict(loop_cls=NanReward)
    with caplog.at_level(logging.WARNING, logger="grpo.rollout"):
        seen, out = run_scripted(tiny_qwen3, **kw)
    assert len(seen) == 2
    for group, advantages, kept in seen:
        assert kept and np.isfinite(advantages).all() and np.isfinite(group.rewards).all(), group.rewards
    key = "InfEnv" if source == "get_reward" else "rollout_reward"
    assert out["rewards/nonfinite_count"] == 8 and out[f"rewards/{key}/nonfinite_count"] == 8, out
    warnings = [r.getMessage() for r in caplog.records if "non-finite" in r.getMessage()]
    assert len(warnings) == 1 and name in warnings[0] and "None" in warnings[0], warnings


# ---- g. reset() failing: retried, then the prompt dropped with a counted reason ----------------------------------


class FlakyEnv:
    """reset() fails for "broken" rows every time; for "flaky" rows once per process (a retry succeeds)."""

    failed_once: set[str] = set()

    def reset(self, **row):
        text = row["prompt"][-1]["content"]
        if "broken" in text:
            raise ConnectionError(f"sandbox refused {text!r}")
        if "flaky" in text and text not in FlakyEnv.failed_once:
            FlakyEnv.failed_once.add(text)
            raise TimeoutError(f"sandbox slow for {text!r}")
        return None


ENV_ROWS = [{"prompt": [{"role": "user", "content": c}]}
            for c in ("Say one.", "Say broken.", "Say flaky.", "Say two.")]


def test_failing_reset_is_retried_then_its_prompt_dropped_and_counted(tiny_qwen3, caplog):
    """In-process: the flaky prompt trains after one retry, the broken one is dropped (reason env_reset_failed,
    on the trainer queue like every other drop), the other prompts train. One failing reset used to end the run."""
    FlakyEnv.failed_once = set()
    buffer = queue.Queue()
    with caplog.at_level(logging.WARNING, logger="grpo.rollout"):
        seen, out = run_scripted(tiny_qwen3, rows=ENV_ROWS, environment_factory=FlakyEnv, samples=buffer)
    assert sorted(g.row_index for g, _, _ in seen) == [0, 2, 3]
    from grpo.samples import ConsumedGroup

    items = []
    while not buffer.empty():
        items.append(buffer.get())
    assert [(i.group_id, i.reason) for i in items if isinstance(i, ConsumedGroup)] == [(1, "env_reset_failed")]
    assert out["env/reset_retry_count"] >= 5, out  # 4 rollouts of "broken" + 1 of "flaky"
    dropped = [r.getMessage() for r in caplog.records if "env_reset_failed" in r.getMessage()]
    assert len(dropped) == 1 and "FlakyEnv" in dropped[0] and "sandbox refused" in dropped[0], dropped


@pytest.mark.vllm
def test_failing_reset_in_a_real_run_is_dropped_recorded_and_not_lost(faults_server, tmp_path):
    """train.py, one epoch over 4 prompts against the real server: the run ends normally, the broken prompt is in
    dropped_prompts.jsonl with reason env_reset_failed, and the audit finds no prompt lost or trained twice."""
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in ENV_ROWS))
    out = tmp_path / "run"
    cmd = train_cmd(faults_server.base_url, out, "--num-train-epochs", "1", "--save-strategy", "no",
                    "--environment-factory", "faults.test_reward_values:FlakyEnv")
    cmd[cmd.index("builtin:letters")] = str(data)
    proc = run(cmd)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    drops = [(p, reason) for r in records(out, "dropped_prompts.jsonl") for p, reason in r["prompts"]]
    assert (1, "env_reset_failed") in drops, drops
    result = audit(out, 4)
    assert result["lost"] == [] and result["twice"] == [], result
    assert "env_reset_failed" in proc.stderr


# ---- h. max_completion_length above the server's max_model_len: one warning -----------------------------------


@pytest.mark.vllm
def test_completion_length_above_max_model_len_is_warned_once(tiny_qwen3, faults_server, caplog):
    """The server (max_model_len 512) clamps each request to the room the prompt leaves; a 600-token
    max_completion_length used to be clamped without a word."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_qwen3)
    config = AsyncGRPOConfig(model=str(tiny_qwen3), vllm_server_base_url=faults_server.base_url,
                             num_generations=2, max_completion_length=600, vllm_server_timeout=60)
    loop = AsyncRolloutLoop(config, config.model, ROWS[:2], [index_reward], tokenizer, [tokenizer.eos_token_id])
    with caplog.at_level(logging.WARNING, logger="grpo.rollout"):
        within(180, asyncio.run, loop.run(max_groups=2))
    lines = [r for r in caplog.records if "max_model_len" in r.getMessage()]
    assert len(lines) == 1 and lines[0].levelname == "WARNING", [r.getMessage() for r in lines]
    assert "600" in lines[0].getMessage() and "512" in lines[0].getMessage()
