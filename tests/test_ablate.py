"""scripts/ablate.py and scripts/plot_run.py on synthetic metrics (no server, no training)."""

from __future__ import annotations

import csv
import json
import math

import ablate
import pytest
from plot_run import plot_runs, read_metrics


def test_variant_options_become_train_flags(tmp_path):
    args = ablate.Args(set=("max_steps=5", "loss.epsilon=0.1"), model="m", out=tmp_path)
    assert ablate.parse_variant("dr_grpo+advantage_estimator=no_std+loss.epsilon_high=0.3") == (
        "dr_grpo", {"advantage_estimator": "no_std", "loss.epsilon_high": "0.3"})
    cmd = ablate.train_command(args, "dapo+drop_equal_reward_groups=false+loss.epsilon=0.2", 7, "http://x", tmp_path)
    tail = cmd[cmd.index("--max-steps", cmd.index("--rollout-worker-timeout")):]
    assert tail == ["--max-steps", "5", "--no-drop-equal-reward-groups", "--seed", "7", "--output-dir", str(tmp_path),
                    "loss:dapo", "--loss.epsilon", "0.2"]  # the variant's option wins over --set; run options
    # before --seed, so that a variadic one ends at a flag (tests/test_cli_commands.py parses them with the CLI)
    with pytest.raises(SystemExit, match="key=value"):
        ablate.parse_variant("grpo+oops")
    for key in ("advantage", "advantage_estimator"):  # the estimator subcommand goes after the loss's options
        cmd = ablate.train_command(args, f"grpo+{key}=pass_at_k+advantage.k=2", 7, "http://x", tmp_path)
        assert cmd[-6:] == ["loss:grpo", "--loss.epsilon", "0.1", "advantage:pass_at_k", "--advantage.k", "2"]


def _write_run(path, rewards, masked=0.1, evals=None):
    path.mkdir(parents=True)
    rows = [{"step": i + 1, "time": 10.0 * i, "reward": r, "entropy": 5 - 0.1 * i, "sampling/masked_mean": masked,
             "sampling/importance_sampling_ratio/mean": 1.0, "perf/wall_clock_trained_tokens_per_s": 100.0,
             "sample/staleness_mean": 2.0, **(evals or {}).get(i + 1, {})} for i, r in enumerate(rewards)]
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_report_table_and_plots(tmp_path):
    args = ablate.Args(variants=("a", "b"), seeds=(0, 1), out=tmp_path, threshold=0.5, window=2)
    _write_run(tmp_path / "runs/a/seed0", [0.1, 0.2, 0.6, 0.6, 0.8, 0.9],
               evals={3: {"eval/reward": 0.25, "eval/pass@k": 0.5, "eval/model_version": 3},
                      6: {"eval/reward": 0.5, "eval/pass@k": 0.75, "eval/model_version": 6}})
    _write_run(tmp_path / "runs/a/seed1", [0.1, 0.1, 0.2, 0.3, 0.4, 0.5])
    _write_run(tmp_path / "runs/b/seed0", [0.1, 0.1, 0.1, 0.1, 0.1, 0.1], masked=0.3)
    ablate.write_report(args, ablate.collect(args))
    rows = {r["variant"]: r for r in csv.DictReader(open(tmp_path / "ablation.csv"))}
    assert float(rows["a"]["final_reward_mean"]) == pytest.approx((0.85 + 0.45) / 2)
    assert float(rows["a"]["final_reward_std"]) == pytest.approx(math.sqrt(2 * 0.2 ** 2))
    # seed 0 first reaches a 5-step mean of 0.5 at step 6 ((0.2 + 0.6 + 0.6 + 0.8 + 0.9) / 5); seed 1 never does
    assert rows["a"]["steps_to_threshold"] == "6 (1/2)"
    assert rows["b"]["seeds"] == "1" and float(rows["b"]["is_masked_frac"]) == pytest.approx(0.3)
    assert float(rows["a"]["wall_s_per_run"]) == pytest.approx(50.0)
    # the last logged eval value of each run, mean over seeds (seed 1 has none: left out); nan without eval
    assert float(rows["a"]["final_eval_pass@k"]) == pytest.approx(0.75)
    assert float(rows["a"]["final_eval_reward"]) == pytest.approx(0.5)
    assert math.isnan(float(rows["b"]["final_eval_reward"]))
    assert "| a | 2 |" in (tmp_path / "ablation.md").read_text()
    for png in ("reward.png", "sampling.png", "entropy.png", "eval.png"):  # eval.png: a run logged eval/*
        assert (tmp_path / png).read_bytes()[:4] == b"\x89PNG"
    out = plot_runs({"a0": read_metrics(tmp_path / "runs/a/seed0")}, ("reward", "entropy"), tmp_path / "r.png")
    assert out.read_bytes()[:4] == b"\x89PNG"


def test_dry_run_prints_every_command_and_starts_nothing(tmp_path, capsys):
    args = ablate.Args(variants=("grpo", "dr_grpo+advantage=no_std"), seeds=(0, 1), out=tmp_path,
                       set=("eval_dataset=held.jsonl", "eval_steps=5"), dry_run=True)
    ablate.main(args)
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 4 and all("--eval-dataset held.jsonl --eval-steps 5" in line for line in lines)
    assert lines[1].endswith("loss:dr_grpo advantage:no_std") and "--seed 0" in lines[1]
    assert not list(tmp_path.iterdir())  # no run directory, no server log
