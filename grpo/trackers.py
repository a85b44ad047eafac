"""Experiment trackers behind `--report-to`: TensorBoard (default), Weights & Biases, Trackio, or none.

Each tracker gets the run name and the resolved config at start, every logged metrics window, and tables (the
completions table of `--log-completions`). metrics.jsonl and the console line are written whatever `--report-to`
says. The libraries are the real ones: wandb honours its own environment (`WANDB_MODE=offline` logs to
`<output_dir>/wandb/` without an account; `wandb sync` uploads later), trackio logs to a local SQLite database
(`TRACKIO_DIR`, default ~/.cache/huggingface/trackio; `trackio show` opens the dashboard). A tracker whose library
is missing fails at start, before any model loads, with the pip command.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

TRACKERS = ("tensorboard", "wandb", "trackio", "none")
_PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb", "trackio": "trackio"}


def selected(report_to) -> list[str]:
    """The trackers named (deduplicated, in order); `none` alone means none, with others it is an error."""
    names = [report_to] if isinstance(report_to, str) else list(report_to)
    unknown = [n for n in names if n not in TRACKERS]
    if unknown:
        raise ValueError(f"--report-to {' '.join(unknown)}: use any of tensorboard, wandb, trackio, or none")
    if "none" in names and len(set(names)) > 1:
        raise ValueError(f"--report-to {' '.join(names)}: `none` cannot be combined with a tracker")
    return [n for i, n in enumerate(names) if n != "none" and n not in names[:i]]


def check_trackers(report_to) -> list[str]:
    """At start: every named tracker's library imports (else an error naming the pip command)."""
    import importlib

    names = selected(report_to)
    for name in names:
        module = "torch.utils.tensorboard" if name == "tensorboard" else name
        try:
            importlib.import_module(module)
        except ImportError as exc:
            raise ValueError(f"--report-to {name} needs the {_PACKAGES[name]} package: `pip install "
                             f"{_PACKAGES[name]}` (or leave {name} out of --report-to); import failed: {exc}") from exc
    return names


def resolved_config(config) -> dict[str, Any]:
    """The run's config as plain values, with the loss's and the estimator's registered names."""
    from grpo.advantages import estimator_name, estimator_options
    from grpo.losses import registered_losses

    out = dataclasses.asdict(config)
    out = {k: (list(v) if isinstance(v, tuple) else v) for k, v in out.items()}
    advantage = estimator_options(config.advantage)  # a registered name from Python -> its options
    out["advantage"] = dataclasses.asdict(advantage)
    out["loss_name"] = next((n for n, o in registered_losses().items() if type(o) is type(config.loss)),
                            type(config.loss).__name__)
    out["advantage_name"] = estimator_name(advantage)
    return out


def run_name(config) -> str:
    return config.run_name or Path(config.output_dir).resolve().name


def _finite(metrics: dict[str, float]) -> dict[str, float]:
    return {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float)) and math.isfinite(v)}


class TensorBoardTracker:
    def __init__(self, output_dir: Path, name: str, config: dict):
        import json

        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(output_dir / "tensorboard"))
        self.writer.add_text("config", f"run {name}\n\n```\n{json.dumps(config, indent=1, default=str)}\n```", 0)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        for name, value in metrics.items():
            self.writer.add_scalar(name, value, step)

    def log_table(self, step: int, key: str, columns: list[str], rows: list[list]) -> None:
        header = "| " + " | ".join(columns) + " |\n|" + "---|" * len(columns) + "\n"
        body = "".join("| " + " | ".join(str(c).replace("|", "\\|").replace("\n", " ") for c in row) + " |\n"
                       for row in rows)
        self.writer.add_text(key, header + body, step)

    def close(self) -> None:
        self.writer.close()


class _RunTracker:
    """wandb and trackio share one run API: `lib` is the module, `run` the run `lib.init` returned."""

    lib = run = None

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.run.log(_finite(metrics), step=step)

    def log_table(self, step: int, key: str, columns: list[str], rows: list[list]) -> None:
        self.run.log({key: self.lib.Table(columns=columns, data=rows)}, step=step)

    def close(self) -> None:
        self.run.finish()


class WandbTracker(_RunTracker):
    def __init__(self, output_dir: Path, name: str, config: dict, project: str):
        import wandb

        self.lib = wandb
        self.run = wandb.init(project=project, name=name, config=config, dir=str(output_dir), reinit="create_new")


class TrackioTracker(_RunTracker):
    def __init__(self, output_dir: Path, name: str, config: dict, project: str):
        import trackio

        self.lib = trackio
        self.run = trackio.init(project=project, name=name, config=config, auto_log_cpu=False, auto_log_gpu=False)


def build_trackers(config) -> list:
    """The trackers `config.report_to` names, started with the run name and the resolved config."""
    names = check_trackers(config.report_to)
    output_dir = Path(config.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    name, resolved = run_name(config), resolved_config(config)
    out = []
    for tracker in names:
        if tracker == "tensorboard":
            out.append(TensorBoardTracker(output_dir, name, resolved))
        elif tracker == "wandb":
            out.append(WandbTracker(output_dir, name, resolved, config.project))
        else:
            out.append(TrackioTracker(output_dir, name, resolved, config.project))
    return out


# ---- the completions table (--log-completions) -------------------------------------------------------------------

COMPLETION_COLUMNS = ["step", "prompt", "completion", "reward", "advantage", "staleness"]


def completion_rows(samples: list, tokenizer, trained_version: int, step: int, limit: int | None) -> list[list]:
    """One row per rollout of the step's first groups: `limit` rows (None = one whole group). The prompt is the
    text before the first trained token, the completion the rest; staleness = trained version - sampled version."""
    rows, seen, first_group = [], set(), None
    for sample in samples:
        if sample.group_id < 0 or (sample.group_id, sample.rollout_id) in seen:
            continue
        if limit is None and first_group is not None and sample.group_id != first_group:
            continue
        first_group = sample.group_id if first_group is None else first_group
        seen.add((sample.group_id, sample.rollout_id))
        start = sample.completion_mask.index(1) if 1 in sample.completion_mask else len(sample.input_ids)
        rows.append([step, tokenizer.decode(sample.input_ids[:start], skip_special_tokens=True),
                     tokenizer.decode(sample.input_ids[start:], skip_special_tokens=True), float(sample.reward),
                     float(sample.advantage), int(trained_version - sample.model_version)])
        if limit is not None and len(rows) >= limit:
            break
    return rows


def format_table(columns: list[str], rows: list[list], width: int = 60) -> str:
    """A plain-text table for the console; long text cells are shortened to `width` characters (tail kept)."""
    def cell(value) -> str:
        text = f"{value:.4g}" if isinstance(value, float) else str(value)
        text = " ".join(text.split())
        return text if len(text) <= width else "..." + text[-(width - 3):]

    cells = [columns] + [[cell(v) for v in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(columns))]
    lines = [" | ".join(c.ljust(w) for c, w in zip(r, widths)) for r in cells]
    lines.insert(1, "-+-".join("-" * w for w in widths))
    return "\n".join(lines)
