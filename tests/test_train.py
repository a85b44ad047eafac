"""train.py end to end: FSDP2 ranks agree with one process, the loop trains against a real vLLM server and pushes
its weights there, checkpoints resume at the trained position after a kill, and torchrun with 2 CPU ranks runs."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch

from conftest import REPO
from grpo.config import AsyncGRPOConfig

PY = sys.executable


def random_samples(seed: int, groups: int = 4, group_size: int = 3, vocab: int = 1024) -> list:
    from grpo.samples import TrainingSample

    rng = np.random.default_rng(seed)
    out = []
    for g in range(groups):
        prompt = rng.integers(4, vocab, rng.integers(4, 10)).tolist()
        for _ in range(group_size):
            completion = rng.integers(4, vocab, rng.integers(2, 8)).tolist()
            ids = prompt + completion
            mask = [0] * len(prompt) + [1] * len(completion)
            out.append(TrainingSample(input_ids=ids, completion_mask=mask,
                                      sampler_logprobs=(rng.normal(-6.9, 0.3, len(ids)) * np.array(mask)).tolist(),
                                      advantage=float(rng.normal()), group_id=g, model_version=0))
    return out


def _grads_after_one_micro_batch(rank: int, world: int, rows: list[list], trained: int, tiny: str, out: str):
    """Run in each process: FSDP2-shard the policy, one micro-batch, write the full gradients from rank 0."""
    import contextlib

    from grpo.distributed import init_distributed, shard_model
    from grpo.kernels.gdn import patch_gdn_layers
    from grpo.losses import get_loss
    from grpo.model import load_policy
    from grpo.policy import PackedPolicy
    from grpo.step import train_micro_batch
    from grpo.step_metrics import resolve_metrics
    from grpo.step_plan import StepPlan

    if world > 1:
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1")
    info = init_distributed()
    model = load_policy(tiny, gradient_checkpointing=False)
    patch_gdn_layers(model)
    policy = shard_model(PackedPolicy(model, "sdpa", temperature=1.0), info, mixed_precision=False)
    plan = StepPlan(rows, trained)
    metrics = resolve_metrics([train_micro_batch(policy, rows[info.rank], plan, *get_loss("clipped_surrogate"),
                                                 world, 1, contextlib.nullcontext)])[0]
    grads = {}
    for name, p in policy.named_parameters():
        if not p.requires_grad:
            continue
        g = p.grad
        grads[name] = (g.full_tensor() if hasattr(g, "full_tensor") else g).detach().clone()
    if info.rank == 0:
        torch.save({"grads": grads, "loss": metrics["loss"]}, out)
    if world > 1:
        torch.distributed.destroy_process_group()


def _spawned(rank, world, rows, trained, tiny, out, port):
    os.environ["MASTER_PORT"] = str(port)
    _grads_after_one_micro_batch(rank, world, rows, trained, tiny, out)


@pytest.mark.parametrize("kind", ["qwen3", "qwen3_5"])
def test_two_fsdp_ranks_match_one_process(tiny_models, tmp_path, kind):
    """Rows split over 2 gloo ranks (FSDP2 on CPU) give the gradient of one process training all of them:
    each rank normalises by N_glob / W and FSDP averages over W (docs/design.md §6.4). Also for the Qwen3.5 VLM
    checkpoint (Gated DeltaNet layers, frozen vision tower)."""
    import torch.multiprocessing as mp

    from grpo.vllm_server import free_port

    samples = random_samples(0)
    rows = [[s for s in samples if s.group_id % 2 == r] for r in range(2)]
    trained = sum(s.num_trained for s in samples)
    model_dir = str(tiny_models[kind])
    _grads_after_one_micro_batch(0, 1, [samples], trained, model_dir, str(tmp_path / "one.pt"))
    mp.spawn(_spawned, args=(2, rows, trained, model_dir, str(tmp_path / "two.pt"), free_port()), nprocs=2)
    one, two = torch.load(tmp_path / "one.pt"), torch.load(tmp_path / "two.pt")
    assert one["grads"].keys() == two["grads"].keys()
    for name, g in one["grads"].items():
        torch.testing.assert_close(two["grads"][name], g, atol=1e-6, rtol=1e-4, msg=name)
    assert any(g.abs().sum() > 0 for g in one["grads"].values())


# ----------------------------------------------------------------------------------------- against a real server

def _train_cmd(server_url: str, out: Path, *extra: str) -> list[str]:
    return [PY, str(REPO / "train.py"), "--model", str(REPO / ".tiny" / "qwen3"), "--dataset", "builtin:letters",
            "--reward-funcs", "letters", "--vllm-server-base-url", server_url, "--num-generations", "4",
            "--max-completion-length", "8", "--learning-rate", "1e-3", "--output-dir", str(out),
            "--rollout-worker-timeout", "120", *extra]


def _metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _prompt_logprobs(server_url: str, model: str, ids: list[int]) -> torch.Tensor:
    import httpx

    body = httpx.post(f"{server_url}/v1/completions", timeout=60, json={
        "model": model, "prompt": ids, "max_tokens": 1, "temperature": 1.0, "prompt_logprobs": 0}).json()
    entries = body["choices"][0]["prompt_logprobs"][1:]
    return torch.tensor([entries[i][str(t)]["logprob"] for i, t in enumerate(ids[1:])])


def _model_logprobs(path, ids: list[int]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        logp = model(input_ids=torch.tensor([ids])).logits[0].log_softmax(-1)
    return logp[:-1].gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]


@pytest.fixture(scope="module")
def train_server(scratch_server):
    """Training changes the server's weights: the shared server, lent and restored at the module's end."""
    return scratch_server


@pytest.mark.vllm
@pytest.mark.slow
def test_train_end_to_end_weights_reach_server(train_server, tiny_qwen3, tmp_path):
    out = tmp_path / "run"
    ids = [1, 77, 300, 12, 500, 42, 2, 1, 9, 600]
    model_name = str(tiny_qwen3)
    before = _prompt_logprobs(train_server.base_url, model_name, ids)
    import httpx

    # as a trainer killed mid-sync would leave it: the next run's cold sync (pause ... resume) must bring it back
    httpx.post(f"{train_server.base_url}/pause?mode=keep", timeout=60).raise_for_status()
    # bf16 compute over fp32 weights in one process (what one GPU runs: grpo/master_weights.py, no FSDP2): the syncs
    # and checkpoints must carry the fp32 masters, not the bf16 compute copies (the CPU server serves fp32)
    # weight syncs every 2 steps: steps 1 and 3 are queued ahead (the next one planned before they are read back)
    proc = subprocess.run(_train_cmd(train_server.base_url, out, "--max-steps", "4", "--save-steps", "2",
                                     "--bf16", "True", "--weight-sync-steps", "2"),
                          capture_output=True, text=True, timeout=900, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    rows = _metrics(out)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert all(r["sample/staleness_max"] is None or r["sample/staleness_max"] <= 4 for r in rows)
    for key in ("reward", "loss", "perf/weight_sync_s", "batch/packing_ratio", "rollout/concurrency_cap"):
        assert any(r.get(key) is not None for r in rows), key
    assert [r["step"] for r in rows if r.get("perf/weight_sync_s") is not None] == [2, 4]
    assert list((out / "tensorboard").glob("events.out.tfevents.*"))
    assert (out / "repro" / "config.json").exists() and (out / "repro" / "env.json").exists()
    final = out / "checkpoint-4"
    assert (out / "checkpoint-2" / "rollout_state.json").exists() and (final / "model.safetensors").exists()
    # The last sync pushed the final weights: the server now scores exactly like the saved model.
    after = _prompt_logprobs(train_server.base_url, model_name, ids)
    torch.testing.assert_close(after, _model_logprobs(final, ids), atol=1e-4, rtol=0)
    assert (after - before).abs().max() > 1e-3


@pytest.mark.vllm
@pytest.mark.slow
def test_kill_and_resume_trains_each_prompt_once(train_server, tmp_path):
    """SIGKILL a run after its first checkpoint (at any point: mid-sync leaves the server paused with half-written
    weights), resume from `latest` against the same server (its cold sync rewrites every weight and resumes it):
    prompts below the checkpoint's low-water mark are never trained again, every prompt below it was trained, and
    the step count continues."""
    out = tmp_path / "run"
    cmd = _train_cmd(train_server.base_url, out, "--max-steps", "50", "--save-steps", "3", "--max-staleness", "100")
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=open(tmp_path / "run1.log", "w"), stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 600
        while not (out / "checkpoint-3").exists():
            assert proc.poll() is None, (tmp_path / "run1.log").read_text()[-4000:]
            assert time.monotonic() < deadline, "no checkpoint within 10 minutes"
            time.sleep(0.5)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    state = json.loads((out / "checkpoint-3" / "rollout_state.json").read_text())
    low_water = state["prompt_index"]
    first_run = [json.loads(line) for line in (out / "trained_prompts.jsonl").read_text().splitlines()]
    resumed = subprocess.run(_train_cmd(train_server.base_url, out, "--max-steps", "6", "--save-steps", "3",
                                        "--max-staleness", "100", "--resume-from-checkpoint", "latest"),
                             capture_output=True, text=True, timeout=900, cwd=REPO)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-5000:]
    assert not httpx.get(f"{train_server.base_url}/is_paused").json()["is_paused"]
    records = [json.loads(line) for line in (out / "trained_prompts.jsonl").read_text().splitlines()]
    second_run = records[len(first_run):]
    assert [r["step"] for r in second_run] == [4, 5, 6]
    trained_before = {p for r in first_run if r["step"] <= 3 for p in r["prompts"]}
    trained_after = {p for r in second_run for p in r["prompts"]}
    dropped_before = {p for r in map(json.loads, (out / "dropped_prompts.jsonl").read_text().splitlines())
                      if r["step"] <= 3 for p, _ in r["prompts"]} if (out / "dropped_prompts.jsonl").exists() else set()
    assert low_water > 0
    # nothing skipped: at max_staleness 100 no group goes stale, but one may still be dropped for equal rewards
    assert set(range(low_water)) <= trained_before | dropped_before
    assert not trained_after & set(range(low_water))  # nothing below the low-water mark trained twice
    assert min(trained_after) >= low_water


@pytest.mark.vllm
@pytest.mark.slow
def test_torchrun_two_cpu_ranks(train_server, tmp_path):
    out = tmp_path / "run"
    torchrun = [PY, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    cmd = torchrun + _train_cmd(train_server.base_url, out, "--max-steps", "3", "--save-strategy", "no",
                                "--advantage-batch-transforms", "batch_std")[1:]  # the hook on every rank
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    rows = _metrics(out)
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(r["batch/microbatches_per_step"] == 1 for r in rows)
    assert (out / "checkpoint-3" / "model.safetensors").exists()


def test_moe_load_balancing_loss_is_added(tiny_models):
    """With router_aux_loss_coef > 0 the packed forward adds coef x aux_loss: with zero advantages the policy
    term has no gradient, so the routers' gradient comes from the load-balancing loss alone."""
    import contextlib

    from grpo.losses import get_loss
    from grpo.model import aux_loss_coef, load_policy
    from grpo.policy import PackedPolicy
    from grpo.step import train_micro_batch
    from grpo.step_metrics import resolve_metrics
    from grpo.step_plan import StepPlan

    model = load_policy(str(tiny_models["qwen3_moe"]), gradient_checkpointing=False)
    coef = aux_loss_coef(model, None)
    assert coef == model.config.router_aux_loss_coef > 0
    samples = random_samples(1)
    for s in samples:
        s.advantage = 0.0
    policy = PackedPolicy(model, "sdpa", 1.0, aux_coef=coef)
    plan = StepPlan([samples], sum(s.num_trained for s in samples))
    metrics = resolve_metrics([train_micro_batch(policy, samples, plan, *get_loss("clipped_surrogate"), 1, 1,
                                                 contextlib.nullcontext)])[0]
    assert 1.0 < metrics["aux_loss"] < 4.0  # ~top_k for a near-uniform router
    gate_grads = [p.grad for n, p in model.named_parameters() if "mlp.gate." in n]
    lm_head = model.get_output_embeddings().weight.grad
    assert gate_grads and all(g is not None and g.abs().sum() > 0 for g in gate_grads)
    assert lm_head is None or lm_head.abs().sum() == 0


@pytest.mark.vllm
@pytest.mark.slow
def test_epoch_stop_trains_every_prompt_once(train_server, tmp_path):
    """Without max_steps the run stops by itself after num_train_epochs passes over the prompts, each prompt
    trained at most once per pass (dropped groups are consumed without training)."""
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": [{"role": "user", "content": f"Write {w} words."}]}) + "\n"
                            for w in ("two", "three", "four", "five", "six")))
    out = tmp_path / "run"
    cmd = _train_cmd(train_server.base_url, out, "--num-train-epochs", "2", "--save-strategy", "no")
    cmd[cmd.index("builtin:letters")] = str(data)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    trained = [p for line in (out / "trained_prompts.jsonl").read_text().splitlines()
               for p in json.loads(line)["prompts"]]
    assert trained and len(trained) == len(set(trained)) and set(trained) <= set(range(10))


@pytest.mark.vllm
@pytest.mark.slow
def test_python_api_with_custom_reward_dataset_and_loop(train_server, tmp_path):
    """`train.main(config, reward_funcs=[fn], train_dataset=rows, loop_cls=Subclass)` with a config subclass
    carrying an extra field read by the loop (the spec's curriculum example)."""
    out = tmp_path / "run"
    proc = subprocess.run([PY, str(REPO / "tests" / "api_example.py"), train_server.base_url,
                           str(REPO / ".tiny" / "qwen3"), str(out)], capture_output=True, text=True, timeout=900,
                          cwd=REPO, env=os.environ | {"PYTHONPATH": f"{REPO}:{REPO / 'tests'}"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    result = json.loads(proc.stdout.split("RESULT ")[-1].splitlines()[0])
    assert result["step"] == 3
    rows = _metrics(out)
    assert any(r.get("rewards/short_reward/mean") is not None for r in rows)


class CounterEnv:
    """Owns its data: reset() returns the prompt."""

    def reset(self, **kwargs) -> str:
        self.counter = 0
        return "Increment the counter by 2."

    def get_reward(self) -> float:
        return float(self.counter == 2)

    def increment(self, step: int) -> int:
        """Increment the counter.

        Args:
            step: Value to add.
        """
        self.counter += step
        return self.counter


def test_inputs_resolution_environment_owns_the_data():
    from grpo.config import AsyncGRPOConfig
    from grpo.inputs import resolve_inputs

    funcs, dataset, tools, env, loop = resolve_inputs(AsyncGRPOConfig(max_steps=5), [], None, None, CounterEnv, None)
    assert dataset is None and env is CounterEnv and funcs == [] and tools == [] and loop is None
    with pytest.raises(ValueError, match="max-steps"):
        resolve_inputs(AsyncGRPOConfig(), [], None, None, CounterEnv, None)
    _, rows, _, _, _ = resolve_inputs(AsyncGRPOConfig(dataset="builtin:letters", reward_funcs=("letters",)),
                                      None, None, None, None, None)
    assert len(rows) > 0 and rows[0]["prompt"][0]["role"] == "user"


def test_step_metrics_follow_the_one_reduction_rule_and_skip_nan():
    """A fully masked row yields NaN clip ratios; the step's value comes from the other micro-batches (it used to be
    NaN), counts are summed and extremes kept, as in every logged window."""
    from types import SimpleNamespace

    from grpo.step_metrics import step_summary
    from grpo.step_plan import StepPlan

    samples = random_samples(0, groups=1, group_size=2)
    for s in samples:
        s.reward = 1.0
    plans = [StepPlan([samples], sum(s.num_trained for s in samples))] * 2
    base = {"_forwarded": 10, "_attended_keys": 50, "_head_tokens": 10, "perf/fwd_bwd_s": 0.1, "perf/fwd_s": 0.05}
    micro = [base | {"clip_ratio/low_mean": math.nan, "ratio_max": 1.5, "masked_count": 1.0},
             base | {"clip_ratio/low_mean": 0.25, "ratio_max": 2.0, "masked_count": 2.0}]
    out = step_summary(plans, samples, micro, SimpleNamespace(world_size=1, rank=0), 1.0, 0.1, {},
                       SimpleNamespace(model_type="none"), None)
    assert out["clip_ratio/low_mean"] == 0.25 and out["ratio_max"] == 2.0 and out["masked_count"] == 3.0


def test_missing_model_path_is_named_and_hub_ids_pass(tiny_qwen3):
    from grpo.inputs import check_model_path

    with pytest.raises(FileNotFoundError, match="does not exist"):
        check_model_path("/no/such/dir")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        check_model_path("outputs/run/checkpoint-3")
    check_model_path("Qwen/Qwen3-0.6B")
    check_model_path(str(tiny_qwen3))


def test_config_cls_is_taken_out_of_argv():
    from grpo.config import config_class

    cls, rest = config_class(["--max-steps", "3", "--config-cls", "grpo.config:AsyncGRPOConfig", "--seed", "1"])
    assert cls is AsyncGRPOConfig and rest == ["--max-steps", "3", "--seed", "1"]
    with pytest.raises(TypeError, match="not a subclass"):
        config_class(["--config-cls=grpo.rollout_worker:RolloutWorker"])


@pytest.mark.vllm
@pytest.mark.slow
def test_research_workflow_end_to_end(train_server, tmp_path):
    """One short run with every research-workflow option: a plug-in estimator with an option, the batch transform,
    held-out evaluation, wandb (offline) and trackio trackers and the completions table."""
    out = tmp_path / "run"
    held_out = tmp_path / "held_out.jsonl"
    from grpo.data import builtin_dataset

    held_out.write_text("".join(json.dumps(row) + "\n" for row in builtin_dataset("letters")[-5:]))
    env = os.environ | {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "TRACKIO_DIR": str(tmp_path / "trackio")}
    cmd = _train_cmd(train_server.base_url, out, "--max-steps", "4", "--save-strategy", "no", "--eval-dataset",
                     str(held_out), "--eval-max-prompts", "3", "--eval-steps", "2", "--eval-num-generations", "2",
                     "--report-to", "tensorboard", "wandb", "trackio", "--log-completions",
                     "--num-completions-to-print", "2", "--advantage-batch-transforms", "batch_std",
                     "advantage:pass-at-k", "--advantage.k", "2")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=REPO, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    rows = _metrics(out)
    evals = [r for r in rows if r.get("eval/model_version") is not None]
    # evaluations at the weights after steps 2 and 4, the final one waited for: version 1 (the cold sync) + one
    # per step that trained (a step skipped as non-finite syncs nothing), so 5 unless a step was skipped
    per_step = {}  # each step's own row (the final evaluation adds a second row for the last step)
    for r in rows:
        if "train/skipped_nonfinite_count" in r:  # not an evaluation's own row (two finished in one window)
            per_step.setdefault(r["step"], r)
    final = 1.0 + sum(1 for r in per_step.values() if r.get("train/skipped_nonfinite_count") == 0.0)
    seen = [(r.get("step"), r.get("eval/model_version"), r.get("train/skipped_nonfinite_count"),
             r.get("eval/skipped_count")) for r in rows]
    assert final >= 4 and rows[-1].get("eval/model_version") == final, (
        f"(step, eval version, skipped step, skipped eval) per row: {seen}\n{proc.stderr[-4000:]}")
    assert all(r["eval/num_prompts"] == 3 and 0 <= r["eval/mean@k"] <= r["eval/pass@k"] <= 1 for r in evals)
    assert "completions at step 1" in proc.stdout and "staleness" in proc.stdout
    assert list((out / "wandb").glob("offline-run-*/run-*.wandb"))
    assert (tmp_path / "trackio" / "huggingface.db").exists()
    config = json.loads((out / "repro" / "config.json").read_text())
    assert config["advantage"] == {"k": 2} and config["advantage_batch_transforms"] == ["batch_std"]


@pytest.mark.parametrize("moved", [False, True])
def test_loss_inputs_structure_from_the_rows_host_twin(moved):
    """`loss_inputs` builds the group index and sequence lengths from the row's CPU twin (on a GPU: no wait for the
    device): equal to each trained token's sample group and each sample's trained-token count."""
    from types import SimpleNamespace

    from grpo.step import loss_inputs
    from grpo.step_plan import StepPlan
    from grpo.trie import pack_samples

    samples = random_samples(3, groups=3, group_size=4)
    row = pack_samples(samples)
    row = row.to("cpu") if moved else row
    assert (row.host is not None) == moved
    out = SimpleNamespace(policy_logprobs=row.sampler_logprobs.clone(), policy_top_logprobs=None)
    inputs = loss_inputs(out, row, samples, StepPlan([samples], sum(s.num_trained for s in samples)), 8)
    token_sample = row.sample_id.tolist()
    assert inputs.group_index.tolist() == [samples[i].group_id for i in token_sample]
    assert inputs.sequence_lengths.tolist() == [s.num_trained for s in samples]
