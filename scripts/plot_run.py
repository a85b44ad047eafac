"""Plot one or several runs' metrics.jsonl (reward, loss, entropy, staleness, throughput), one line per run.

    python scripts/plot_run.py outputs/a/metrics.jsonl outputs/b/metrics.jsonl --out runs.png

`scripts/ablate.py` uses `read_metrics` and `plot_bands` from here for its seed-banded plots.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import tyro

UNITS = {
    "reward": "reward (task units)",
    "loss": "loss (normalised, per step)",
    "entropy": "entropy (nats / token)",
    "sample/staleness_mean": "staleness (weight versions)",
    "perf/wall_clock_trained_tokens_per_s": "trained tokens / s (wall clock)",
    "sampling/importance_sampling_ratio/mean": "IS ratio p/q (mean over tokens)",
    "sampling/masked_mean": "masked fraction of trained tokens",
    "grad_norm": "gradient norm (before clipping)",
}
"""Axis label per metric name; other metrics are labelled by their name."""


@dataclass(frozen=True)
class Args:
    metrics: tyro.conf.Positional[tuple[Path, ...]]
    """metrics.jsonl files written by train.py (a run directory works too)."""
    out: Path = Path("runs.png")
    """PNG to write."""
    keys: tuple[str, ...] = ("reward", "loss", "entropy", "sample/staleness_mean",
                             "perf/wall_clock_trained_tokens_per_s")
    """Metrics to plot, one panel each."""
    labels: tuple[str, ...] = ()
    """Legend label per run (default: the run directory's name)."""


def read_metrics(path: Path) -> list[dict]:
    """The logged steps of a run (path = metrics.jsonl or its run directory)."""
    path = path / "metrics.jsonl" if path.is_dir() else path
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def series(rows: list[dict], key: str) -> tuple[list[int], list[float]]:
    """(steps, values) where the metric was logged and finite."""
    points = [(r["step"], float(r[key])) for r in rows if r.get(key) is not None and math.isfinite(float(r[key]))]
    return [p[0] for p in points], [p[1] for p in points]


def _figure(panels: int, width: float = 5.0):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = min(panels, 3)
    rows = math.ceil(panels / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(width * cols, 3.4 * rows), squeeze=False)
    for ax in axes.flat[panels:]:
        ax.set_visible(False)
    return fig, list(axes.flat[:panels])


def plot_runs(runs: dict[str, list[dict]], keys: tuple[str, ...], out: Path, title: str = "") -> Path:
    """One panel per metric, one line per run."""
    fig, axes = _figure(len(keys))
    for ax, key in zip(axes, keys):
        for label, rows in runs.items():
            steps, values = series(rows, key)
            ax.plot(steps, values, label=label, linewidth=1.2)
        ax.set_xlabel("optimizer step")
        ax.set_ylabel(UNITS.get(key, key))
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(out, dpi=80)
    return out


def plot_bands(variants: dict[str, list[list[dict]]], keys: tuple[str, ...], out: Path, title: str = "",
               smooth: int = 1) -> Path:
    """One panel per metric; per variant the mean over seeds vs step and a band from the seeds' min to max.

    `smooth` > 1 averages each seed's curve over a trailing window of that many logged steps first.
    """
    import numpy as np

    fig, axes = _figure(len(keys), width=5.5)
    for ax, key in zip(axes, keys):
        for label, seeds in variants.items():
            curves = [dict(zip(*series(rows, key))) for rows in seeds]
            steps = sorted(set().union(*curves)) if curves else []
            if not steps:
                continue
            grid = np.array([[c.get(s, np.nan) for s in steps] for c in curves])  # [seeds, steps]
            if smooth > 1:
                grid = np.array([_trailing_mean(row, smooth) for row in grid])
            mean = np.nanmean(grid, axis=0)
            line, = ax.plot(steps, mean, label=f"{label} (n={len(curves)})", linewidth=1.4)
            if len(curves) > 1:
                ax.fill_between(steps, np.nanmin(grid, axis=0), np.nanmax(grid, axis=0), color=line.get_color(),
                                alpha=0.15, linewidth=0)
        ax.set_xlabel("optimizer step")
        ax.set_ylabel(UNITS.get(key, key))
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=72)
    return out


def _trailing_mean(values, window: int):
    import numpy as np

    out = np.full(len(values), np.nan)
    for i in range(len(values)):
        chunk = values[max(0, i - window + 1): i + 1]
        chunk = chunk[~np.isnan(chunk)]
        out[i] = chunk.mean() if len(chunk) else np.nan
    return out


if __name__ == "__main__":
    args = tyro.cli(Args, description=__doc__)
    labels = args.labels or tuple((p if p.is_dir() else p.parent).name for p in args.metrics)
    if len(labels) != len(args.metrics):
        raise SystemExit(f"{len(labels)} labels for {len(args.metrics)} runs: give one label per run")
    print(plot_runs({label: read_metrics(p) for label, p in zip(labels, args.metrics)}, args.keys, args.out))
