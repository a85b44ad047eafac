"""Metric windows and the run logger (docs/design.md §12).

Producers (the rollout worker, the queue, the trainer) push `(name, value)` items, or rate pairs
`(name, (numerator, denominator))`. A window collects everything pushed since the previous log and reduces each
name by the spec's rules:

1. rate pairs -> sum(numerators) / sum(denominators) (NaN when the denominators sum to 0);
2. a last name component (after the final "/") holding the word `count` (split on "_") -> sum of the deltas;
3. one holding `max` or `min` -> the extreme;
4. anything else -> the mean over items.
NaNs are dropped first; a name whose every item is NaN reduces to NaN. The trainer, the loss and the worker all
reduce through this one rule. Counters in `ALWAYS_LOGGED_COUNTERS` are logged as 0 in a window without events, so
"nothing happened" is visible rather than a missing key.

`MetricsLogger` writes each reduced window as one line of `metrics.jsonl`, prints a one-line console summary and
passes it to the trackers of `--report-to` (grpo/trackers.py; TensorBoard by default).
"""

from __future__ import annotations

import json
import math
import time
from collections import defaultdict
from collections.abc import Iterable
from pathlib import Path
from typing import Any

MetricItem = tuple[str, Any]
"""`(name, value)` or `(name, (numerator, denominator))`."""


def reduction_of(name: str) -> str:
    """"count" (sum), "max", "min" or "mean" for a non-rate metric name."""
    words = name.rsplit("/", 1)[-1].split("_")
    if "count" in words:
        return "count"
    if "max" in words:
        return "max"
    if "min" in words:
        return "min"
    return "mean"


ALWAYS_LOGGED_COUNTERS = (
    "sample/dropped_stale_count", "batch/dropped_oversize_count", "rollout/dropped_equal_rewards_count",
    "rollout/dropped_unscored_count", "rollout/dropped_no_samples_count", "rollout/dropped_filtered_count",
    "rollout/vllm_retry_count", "rollout/vllm_metrics_error_count", "train/skipped_nonfinite_count",
)
"""Failure and drop counters: present in every logged window (0 when nothing happened)."""


def _is_nan(x: float) -> bool:
    return isinstance(x, float) and math.isnan(x)


class MetricsWindow:
    """Accumulates pushed items until `reduce()`, which returns the window's metrics and starts a new window."""

    def __init__(self, always: Iterable[str] = ()) -> None:
        self.always = tuple(always)
        self._values: dict[str, list[float]] = defaultdict(list)
        self._rates: dict[str, list[tuple[float, float]]] = defaultdict(list)

    def add(self, name: str, value: Any) -> None:
        if isinstance(value, tuple):
            num, den = float(value[0]), float(value[1])
            self._rates[name].append((num, den))
        else:
            self._values[name].append(float(value))

    def extend(self, items: Iterable[MetricItem]) -> None:
        for name, value in items:
            self.add(name, value)

    def __len__(self) -> int:
        return len(self._values) + len(self._rates)

    def reduce(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for name, pairs in self._rates.items():
            pairs = [(n, d) for n, d in pairs if not (_is_nan(n) or _is_nan(d))]
            den = sum(d for _, d in pairs)
            out[name] = sum(n for n, _ in pairs) / den if den != 0 else float("nan")
        for name, values in self._values.items():
            kept = [v for v in values if not _is_nan(v)]
            if not kept:
                out[name] = float("nan")
                continue
            rule = reduction_of(name)
            if rule == "count":
                out[name] = float(sum(kept))
            elif rule == "max":
                out[name] = max(kept)
            elif rule == "min":
                out[name] = min(kept)
            else:
                out[name] = sum(kept) / len(kept)
        for name in self.always:
            out.setdefault(name, 0.0)
        self._values.clear()
        self._rates.clear()
        return out


# Shown first in the console line when present, in this order.
_CONSOLE_KEYS = ("loss", "reward", "reward_kept", "frac_reward_zero_std", "completions/mean_length",
                 "sample/staleness_mean", "rollout/generated_tokens_per_s", "perf/step_s", "perf/rollout_wait_s")


def console_line(step: int, metrics: dict[str, float], total_steps: int | None = None) -> str:
    if total_steps:
        done = min(step / total_steps, 1.0)
        parts = [f"step {step}/{total_steps} [{'#' * round(20 * done):<20}]"]
    else:
        parts = [f"step {step}"]
    for key in _CONSOLE_KEYS:
        if key in metrics:
            parts.append(f"{key.rsplit('/', 1)[-1]} {metrics[key]:.4g}")
    if "eval/model_version" in metrics:  # a held-out evaluation finished in this window
        parts.append(f"eval at v{int(metrics['eval/model_version'])}: reward {metrics.get('eval/reward', math.nan):.4g}"
                     f" pass@k {metrics.get('eval/pass@k', math.nan):.4g}")
    return " | ".join(parts)


class MetricsLogger:
    """`metrics.jsonl` + a console line + the trackers per log. Disabled (non-zero ranks) = no-op.

    `trackers` None = TensorBoard alone (grpo/trackers.py builds the `--report-to` list)."""

    def __init__(self, output_dir: str | Path, enabled: bool = True, console: bool = True,
                 total_steps: int | None = None, trackers: list | None = None):
        self.enabled, self.console, self.total_steps = enabled, console, total_steps
        self.output_dir = Path(output_dir)
        self._jsonl = None
        self.trackers: list = []
        if enabled:
            self.output_dir.mkdir(parents=True, exist_ok=True)
            if trackers is None:
                from grpo.trackers import TensorBoardTracker

                trackers = [TensorBoardTracker(self.output_dir, self.output_dir.name, {})]
            self.trackers = list(trackers)
            self._jsonl = open(self.output_dir / "metrics.jsonl", "a")

    def log(self, step: int, metrics: dict[str, float]) -> None:
        if not self.enabled:
            return
        for tracker in self.trackers:
            tracker.log(step, metrics)
        record = {"step": step, "time": time.time()}
        record.update({k: (None if _is_nan(v) else v) for k, v in metrics.items()})
        self._jsonl.write(json.dumps(record) + "\n")
        self._jsonl.flush()
        if self.console:
            print(console_line(step, metrics, self.total_steps), flush=True)

    def log_table(self, step: int, key: str, columns: list[str], rows: list[list]) -> None:
        """A table (e.g. the completions of --log-completions): printed, and sent to every tracker."""
        if not self.enabled or not rows:
            return
        from grpo.trackers import format_table

        if self.console:
            print(f"{key} at step {step}:\n{format_table(columns, rows)}", flush=True)
        for tracker in self.trackers:
            tracker.log_table(step, key, columns, rows)

    def close(self) -> None:
        if self._jsonl is not None:
            for tracker in self.trackers:
                tracker.close()
            self._jsonl.close()
            self._jsonl, self.trackers = None, []
