"""--report-to through the real libraries (wandb offline, trackio's local SQLite store, TensorBoard), the
completions table of --log-completions, and a check that every config field is read by something."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import sqlite3
import sys
import tempfile
from pathlib import Path

import pytest

os.environ.setdefault("TRACKIO_DIR", tempfile.mkdtemp(prefix="trackio-test-"))  # read when trackio is imported
os.environ["WANDB_MODE"] = "offline"
os.environ.setdefault("WANDB_SILENT", "true")

from grpo.config import AsyncGRPOConfig  # noqa: E402
from grpo.metrics import MetricsLogger  # noqa: E402
from grpo.samples import TrainingSample  # noqa: E402
from grpo.trackers import (COMPLETION_COLUMNS, build_trackers, check_trackers, completion_rows,  # noqa: E402
                           resolved_config, selected)

REPO = Path(__file__).resolve().parents[1]


class _Letters:
    """A tokenizer stand-in: token i is the letter chr(97 + i)."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(97 + i) for i in ids)


def _sample(group_id, rollout_id, prompt, completion, reward, advantage, version):
    ids = prompt + completion
    return TrainingSample(input_ids=ids, completion_mask=[0] * len(prompt) + [1] * len(completion),
                          sampler_logprobs=[0.0] * len(ids), advantage=advantage, group_id=group_id,
                          model_version=version, rollout_id=rollout_id, reward=reward)


def test_every_tracker_logs_metrics_config_and_the_completions_table(tmp_path, capsys):
    project = f"grpo-test-{os.getpid()}-{tmp_path.name}"
    config = AsyncGRPOConfig(output_dir=str(tmp_path / "run"), report_to=("tensorboard", "wandb", "trackio"),
                             run_name="kit-run", project=project, advantage="rloo", log_completions=True)
    logger = MetricsLogger(config.output_dir, trackers=build_trackers(config))
    logger.log(3, {"reward": 0.625, "eval/pass@k": 0.75, "loss": float("nan")})
    samples = [_sample(5, "r0", [0, 1], [2, 3], 1.0, 0.5, 6), _sample(5, "r1", [0, 1], [4], 0.0, -0.5, 7),
               _sample(6, "r2", [0, 1], [5], 1.0, 0.0, 7)]
    rows = completion_rows(samples, _Letters(), trained_version=8, step=3, limit=None)
    assert rows == [[3, "ab", "cd", 1.0, 0.5, 2], [3, "ab", "e", 0.0, -0.5, 1]]  # one group, staleness 8 - version
    logger.log_table(3, "completions", COMPLETION_COLUMNS, rows)
    logger.close()
    printed = capsys.readouterr().out
    assert "completions at step 3" in printed and re.search(r"ab\s+\|\s+cd\s+\|\s+1\s+\|\s+0.5\s+\|\s+2", printed)
    run = Path(config.output_dir)
    assert list((run / "tensorboard").glob("events.out.tfevents.*"))
    # wandb offline: the run's transaction log holds the metric names, the run name and the resolved config
    wandb_runs = list((run / "wandb").glob("offline-run-*"))
    assert len(wandb_runs) == 1
    log = next(wandb_runs[0].glob("run-*.wandb")).read_bytes()
    for needle in (b"eval/pass@k", b"0.625", b"kit-run", b"advantage_name", b"rloo"):
        assert needle in log, needle
    tables = list(wandb_runs[0].glob("files/media/table/completions_3_*.table.json"))
    assert json.loads(tables[0].read_text())["data"][0][1:3] == ["ab", "cd"]
    # trackio: its local SQLite store
    import trackio.utils

    db = sqlite3.connect(Path(trackio.utils.TRACKIO_DIR) / f"{project}.db")
    logged = [(step, json.loads(m)) for step, m in db.execute("select step, metrics from metrics where run_name = ?",
                                                             ("kit-run",))]
    assert (3, {"reward": 0.625, "eval/pass@k": 0.75}) in logged  # NaN left out
    table = next(m["completions"] for _, m in logged if "completions" in m)
    assert table["_value"][1]["completion"] == "e" and table["_value"][1]["staleness"] == 1
    (stored,) = db.execute("select config from configs where run_name = ?", ("kit-run",)).fetchone()
    assert json.loads(stored)["advantage_name"] == "rloo"


def test_report_to_choices_and_missing_library(monkeypatch):
    assert selected(("tensorboard", "wandb", "tensorboard")) == ["tensorboard", "wandb"]
    assert selected(("none",)) == []
    with pytest.raises(ValueError, match="cannot be combined"):
        selected(("none", "wandb"))
    monkeypatch.setitem(sys.modules, "wandb", None)  # as if not installed
    with pytest.raises(ValueError, match="pip install wandb"):
        check_trackers(("wandb",))
    logger = MetricsLogger(Path(tempfile.mkdtemp()), trackers=build_trackers(AsyncGRPOConfig(
        output_dir=tempfile.mkdtemp(), report_to=("none",))))
    logger.log(1, {"reward": 1.0})
    logger.close()
    assert not list(logger.output_dir.glob("tensorboard"))  # none: metrics.jsonl only
    assert (logger.output_dir / "metrics.jsonl").read_text().count("reward") == 1


def test_resolved_config_names_the_loss_and_the_estimator():
    out = resolved_config(AsyncGRPOConfig(advantage="pass_at_k"))
    assert out["loss_name"] == "score_centering" and out["advantage_name"] == "pass_at_k"
    assert out["advantage"] == {"k": 4}


SOURCES = [REPO / "train.py", REPO / "rollout.py", *sorted((REPO / "grpo").glob("*.py"))]


def test_every_config_field_is_read_by_something():
    """A field nothing reads is a flag that silently does nothing: read it, or delete it."""
    text = "\n".join(p.read_text() for p in SOURCES if p.name != "config.py")
    config_text = (REPO / "grpo" / "config.py").read_text()
    body = config_text[config_text.index("class AsyncGRPOConfig"):]
    properties = "\n".join(re.findall(r"    def \w+\(self.*?(?=\n    @|\n    def |\Z)", body, re.S))
    unread = [f.name for f in dataclasses.fields(AsyncGRPOConfig)
              if not re.search(rf"\.{f.name}\b", text) and not re.search(rf"self\.{f.name}\b", properties)]
    assert not unread, f"config fields read by nothing: {unread}"
