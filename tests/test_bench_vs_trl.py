"""scripts/bench_vs_trl.py on CPU without TRL: the dry run's mapping holds (same samples per step, lengths, learning
rate, temperature and loss family on both sides), our side's command line parses into train.py's config, and TRL's
field names exist in TRL 1.16's GRPOConfig (checked against its source where the wheel is reachable)."""

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))

import bench_vs_trl  # noqa: E402


def parsed_ours(settings):
    import tyro

    from grpo.config import config_class

    argv = bench_vs_trl.ours_argv(settings, "http://127.0.0.1:8000", "outputs/x")[1:]
    cls, args = config_class(argv)
    return tyro.cli(cls, args=args)


@pytest.mark.parametrize("workload", sorted(bench_vs_trl.WORKLOADS))
def test_both_sides_train_the_same_step(workload):
    s = bench_vs_trl.WORKLOADS[workload]
    ours = parsed_ours(s)
    trl = bench_vs_trl.trl_config_kwargs(s, "outputs/trl")
    # one optimizer step: prompts_per_step groups of G on both sides
    assert trl["per_device_train_batch_size"] * trl["gradient_accumulation_steps"] == s.samples_per_step
    assert ours.num_generations * ours.gradient_accumulation_steps == s.samples_per_step
    assert trl["per_device_train_batch_size"] % trl["num_generations"] == 0
    assert trl["steps_per_generation"] == trl["gradient_accumulation_steps"] and trl["num_iterations"] == 1
    # our packed row holds one whole group of the longest samples, as TRL's micro-batch does
    assert ours.token_budget >= s.num_generations * (s.max_prompt_tokens + s.max_completion_length)
    for ours_value, trl_key in ((ours.num_generations, "num_generations"),
                                (ours.max_completion_length, "max_completion_length"),
                                (ours.learning_rate, "learning_rate"), (ours.temperature, "temperature"),
                                (ours.max_steps, "max_steps"), (ours.seed, "seed"),
                                (ours.max_grad_norm, "max_grad_norm"), (ours.weight_decay, "weight_decay")):
        assert ours_value == trl[trl_key], trl_key
    assert ours.lr_scheduler_type == trl["lr_scheduler_type"] == "constant"
    # loss family: DAPO's clip range and the sampler-mismatch mask bounds agree
    assert trl["loss_type"] == s.loss and type(ours.loss).__name__ == "ClippedOptions"
    assert (ours.loss.epsilon, ours.loss.epsilon_high) == (trl["epsilon"], trl["epsilon_high"])
    assert ours.loss.normalizer == "token" and trl["beta"] == 0.0
    assert (ours.loss.vllm_importance_sampling_clip_min, ours.loss.vllm_importance_sampling_clip_max) == \
        (trl["vllm_importance_sampling_clip_min"], trl["vllm_importance_sampling_clip_max"])
    assert trl["vllm_importance_sampling_mode"] == "token_mask" and trl["vllm_mode"] == "colocate"
    assert ours.drop_equal_reward_groups is False  # TRL trains zero-spread groups too
    assert (ours.eval_dataset is None) == (s.eval_dataset is None)


def test_cpu_smoke_changes_only_size_and_generation():
    """--cpu-smoke: TRL generates with transformers in fp32 and the run is tiny; every other TRL setting (loss, clip,
    mask, schedule, optimiser) is the real workload's."""
    real = bench_vs_trl.WORKLOADS["real"]
    smoke = bench_vs_trl.cpu_smoke(real)
    a, b = bench_vs_trl.trl_config_kwargs(real, "x"), bench_vs_trl.trl_config_kwargs(smoke, "x")
    assert a["use_vllm"] and a["bf16"] and not b["use_vllm"] and not b["bf16"]
    changed = {k for k in a if a[k] != b[k]}
    assert changed == {"use_vllm", "bf16", "num_generations", "per_device_train_batch_size",
                       "gradient_accumulation_steps", "steps_per_generation", "max_completion_length", "max_steps",
                       "vllm_max_model_length"}, changed
    assert smoke.eval_dataset is None and b["per_device_train_batch_size"] * b["gradient_accumulation_steps"] == 4
    result = subprocess.run([sys.executable, str(REPO / "scripts" / "bench_vs_trl.py"), "--side", "ours",
                             "--cpu-smoke"], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert result.returncode != 0 and "--side trl" in result.stderr


def test_dry_run_prints_mapping_and_both_configs():
    result = subprocess.run([sys.executable, str(REPO / "scripts" / "bench_vs_trl.py"), "--workload", "real",
                             "--dry-run"], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert bench_vs_trl.TRL_PIN in out and "ours: python train.py" in out and "trl GRPOConfig: {" in out
    assert out.count("\n| ") == len(bench_vs_trl.MAPPING) + 1  # header + one line a mapped setting


def test_trl_field_names_exist_in_its_source(tmp_path):
    """Every GRPOConfig keyword we pass is a field of TRL 1.16 (or of transformers' TrainingArguments)."""
    download = subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "-d", str(tmp_path),
                               bench_vs_trl.TRL_PIN], capture_output=True, text=True, timeout=120)
    if download.returncode != 0:
        pytest.skip(f"cannot download {bench_vs_trl.TRL_PIN} (no PyPI?): {download.stderr[-200:]}")
    wheel = next(tmp_path.glob("trl-*.whl"))
    source = zipfile.ZipFile(wheel).read("trl/trainer/grpo_config.py").decode()
    from transformers import TrainingArguments

    inherited = set(TrainingArguments.__dataclass_fields__)
    kwargs = bench_vs_trl.trl_config_kwargs(bench_vs_trl.WORKLOADS["real"], "x")
    missing = [k for k in kwargs if k not in inherited and f"\n    {k}: " not in source]
    assert not missing, f"not GRPOConfig fields in {bench_vs_trl.TRL_PIN}: {missing}"
    assert '"0.22.0") <= _vllm_base_version <= Version("0.31.0")' in \
        zipfile.ZipFile(wheel).read("trl/import_utils.py").decode()  # the vLLM range that admits the 0.26 bundle


def write_ours(folder, start, step_s, evals, per_step=128):
    """A run of ours: metrics.jsonl with one record a step (step i at start + 10 + step_s * i) and eval records at
    weight versions (version v = the weights after step v - 1)."""
    import json

    folder.mkdir()
    (folder / "wall.json").write_text(json.dumps({"start": start}))
    last = max(v for v, _ in evals)
    records = [{"step": i, "time": start + 10 + step_s * i, "batch/samples_per_step": per_step,
                "batch/trained_tokens_per_step": 5000} for i in range(1, last)]
    records += [{"step": v - 1, "time": start + 10 + step_s * v + 3, "eval/reward": acc, "eval/pass@k": acc + 0.1,
                 "eval/model_version": v} for v, acc in evals]
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


def test_report_builds_curves_from_both_kinds_of_run(tmp_path):
    """Our runs (metrics.jsonl + wall.json) and TRL's (curve.jsonl) -> curves.json: the step-0 baseline first for
    ours, an eval point placed at the step that made its weights, steady-state steps/s and trained tok/s, and the
    comparisons: points gained, time to +20 points, time to the peer's final accuracy and the ratio."""
    import json

    write_ours(tmp_path / "async", 1000.0, 2.0, [(6, 0.30), (11, 0.40)])  # steps 5 and 10: t = 20 s and 30 s
    write_ours(tmp_path / "sync", 5000.0, 4.0, [(6, 0.20), (11, 0.30)])   # steps 5 and 10: t = 30 s and 50 s
    trl = tmp_path / "trl"
    trl.mkdir()
    (trl / "curve.jsonl").write_text("".join(json.dumps(r) + "\n" for r in [
        {"step": 0, "samples": 0, "train_wall_s": 0.0, "eval/reward": 0.13, "eval/pass@k": 0.3},
        {"step": 1, "time": 1.0, "train_wall_s": 4.0, "batch/trained_tokens_per_step": 100},
        {"step": 10, "samples": 1280, "train_wall_s": 80.0, "eval/reward": 0.25, "eval/pass@k": 0.5}]))
    baseline = tmp_path / "baseline.json"
    baseline.write_text(json.dumps({"greedy_accuracy": 0.125, "num_prompts": 256, "k": 4, "pass@4": 0.3}))
    summary = bench_vs_trl.report(tmp_path, baseline)
    curves = json.loads((tmp_path / "curves.json").read_text())["curves"]
    assert curves["async"]["points"][0] == {"step": 0, "train_wall_s": 0.0, "samples": 0, "eval/reward": 0.125,
                                            "eval/pass@k": 0.3}
    assert curves["async"]["points"][1] == {"step": 5, "train_wall_s": 20.0, "samples": 5 * 128, "eval/reward": 0.3,
                                            "eval/pass@k": pytest.approx(0.4)}
    assert curves["async"]["steps_per_s"] == pytest.approx(0.5)  # steps 4..9, 2 s apart
    assert curves["async"]["trained_tokens_per_s"] == pytest.approx(2500)
    assert curves["trl"]["points"][0]["eval/reward"] == 0.13 and (tmp_path / "curves.png").stat().st_size > 0
    assert summary["async"]["gain_points"] == pytest.approx(27.5) and summary["async"]["t_to_plus20"] == 30.0
    assert summary["trl"]["step0"] == 0.13 and summary["trl"]["t_to_plus20"] is None  # TRL's own step 0
    # TRL's final 0.25 reached by async at 20 s (0.30 >= 0.25) against TRL's 80 s; sync's 0.30 at 20 s vs 50 s
    assert summary["async_vs_trl"] == {"target": 0.25, "async_s": 20.0, "peer_s": 80.0, "ratio": 0.25}
    assert summary["async_vs_sync"]["ratio"] == pytest.approx(20.0 / 50.0)
    low, high = summary["async"]["final_ci95"]
    assert low < 0.40 < high and high - low < 0.13  # n = 256
