"""Window aggregation rules (docs/design.md §12) against hand-computed windows, and the logger's outputs."""

from __future__ import annotations

import json
import math

import pytest

from grpo.metrics import MetricsLogger, MetricsWindow, reduction_of


@pytest.mark.parametrize("name, rule", [
    ("sample/dropped_stale_count", "count"), ("tools/search/call_count", "count"), ("rollout/vllm_retry_count", "count"),
    ("sample/staleness_max", "max"), ("completions/max_length", "max"), ("clip_ratio/low_min", "min"),
    ("sampling/importance_sampling_ratio/min", "min"), ("completions/min_terminated_length", "min"),
    ("reward", "mean"), ("rollout/concurrency_cap", "mean"),
    ("rollout/discount_rate", "mean"),  # "discount" is not the word "count"
    ("completions/maximal", "mean"), ("frac_reward_zero_std", "mean")])
def test_reduction_rule_follows_the_last_component(name, rule):
    assert reduction_of(name) == rule


def test_window_reduces_each_rule_and_resets():
    w = MetricsWindow()
    for v in (1.0, 2.0, 6.0):
        w.add("reward", v)
    w.extend([("sample/dropped_stale_count", 2), ("sample/dropped_stale_count", 3),
              ("sample/staleness_max", 1), ("sample/staleness_max", 4), ("clip_ratio/low_min", 0.3),
              ("clip_ratio/low_min", 0.1),
              ("rollout/generated_tokens_per_s", (100, 2.0)), ("rollout/generated_tokens_per_s", (300, 2.0))])
    out = w.reduce()
    assert out["reward"] == pytest.approx(3.0)
    assert out["sample/dropped_stale_count"] == 5
    assert out["sample/staleness_max"] == 4
    assert out["clip_ratio/low_min"] == pytest.approx(0.1)
    # sum/sum, not the mean of per-item rates (which would be 100)
    assert out["rollout/generated_tokens_per_s"] == pytest.approx(100.0)
    assert w.reduce() == {}


def test_nans_are_dropped_and_all_nan_is_nan():
    w = MetricsWindow()
    w.extend([("reward", float("nan")), ("reward", 1.0), ("reward", 3.0), ("entropy", float("nan")),
              ("tools/failure_frequency", (0, 0)), ("completions/max_length", float("nan")),
              ("completions/max_length", 7)])
    out = w.reduce()
    assert out["reward"] == pytest.approx(2.0)
    assert math.isnan(out["entropy"])
    assert math.isnan(out["tools/failure_frequency"])  # no tool calls in the window: NaN, not 0
    assert out["completions/max_length"] == 7


def test_logger_writes_jsonl_and_tensorboard(tmp_path, capsys):
    logger = MetricsLogger(tmp_path, enabled=True)
    logger.log(3, {"reward": 0.5, "entropy": float("nan")})
    logger.close()
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    record = json.loads(lines[0])
    assert record["step"] == 3 and record["reward"] == 0.5 and record["entropy"] is None
    assert any(p.name.startswith("events.out.tfevents") for p in (tmp_path / "tensorboard").iterdir())
    console = capsys.readouterr().out
    assert "step 3" in console and "reward 0.5" in console


def test_disabled_logger_writes_nothing(tmp_path):
    MetricsLogger(tmp_path / "off", enabled=False).log(1, {"reward": 1.0})
    assert not (tmp_path / "off").exists()


def test_failure_counters_are_logged_as_zero_when_nothing_happened():
    from grpo.metrics import ALWAYS_LOGGED_COUNTERS

    w = MetricsWindow(always=ALWAYS_LOGGED_COUNTERS)
    w.extend([("sample/dropped_stale_count", 2), ("loss", 1.0)])
    out = w.reduce()
    assert out["sample/dropped_stale_count"] == 2.0
    assert all(out[name] == 0.0 for name in ALWAYS_LOGGED_COUNTERS if name != "sample/dropped_stale_count")
    assert w.reduce() == {name: 0.0 for name in ALWAYS_LOGGED_COUNTERS}  # an empty window still says "none"
