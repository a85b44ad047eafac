"""Summarise a run's metrics.jsonl: reward over the first and last 10 logged steps, staleness bound, throughput.

    python scripts/summarize_run.py outputs/quickstart/metrics.jsonl [--max-staleness 4]
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import tyro


@dataclass(frozen=True)
class Args:
    metrics: tyro.conf.Positional[Path]
    """metrics.jsonl written by train.py."""
    max_staleness: int = 4
    """The run's max_staleness, to check sample/staleness_max against."""
    window: int = 10
    """Logged steps averaged at each end."""


def _mean(values) -> float:
    values = [v for v in values if v is not None and not math.isnan(v)]
    return sum(values) / len(values) if values else math.nan


def summarize(args: Args) -> dict:
    rows = [json.loads(line) for line in args.metrics.read_text().splitlines() if line.strip()]
    if not rows:
        raise SystemExit(f"{args.metrics} has no logged step")
    first = _mean(r.get("reward") for r in rows[: args.window])
    last = _mean(r.get("reward") for r in rows[-args.window:])
    staleness = max((r.get("sample/staleness_max") or 0) for r in rows)
    seconds = rows[-1]["time"] - rows[0]["time"]
    return {"steps": rows[-1]["step"], "reward_first": first, "reward_last": last, "reward_gain": last - first,
            "staleness_max": staleness, "staleness_ok": staleness <= args.max_staleness, "seconds": seconds}


if __name__ == "__main__":
    s = summarize(tyro.cli(Args))
    print(f"steps {s['steps']} in {s['seconds']:.0f} s | reward first {s['reward_first']:.3f} -> last "
          f"{s['reward_last']:.3f} (gain {s['reward_gain']:+.3f}) | staleness_max {s['staleness_max']} "
          f"({'within' if s['staleness_ok'] else 'ABOVE'} max_staleness)")
