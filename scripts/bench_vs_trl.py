"""This project's trainer against TRL's `GRPOTrainer` on one GPU, side by side, with the same settings.

Two workloads:
  real   SmolLM2-135M-Instruct (scripts/get_smollm2.py) on builtin:word_problems, held-out greedy accuracy and
         pass@k on builtin:word_problems_heldout against wall-clock seconds and samples, for both trainers.
  shape  a random-weight Qwen3-0.6B-shaped model, every completion max_completion_length tokens: optimizer steps/s
         and trained tokens/s (the trainer's cost alone, no learning signal expected).

TRL runs in vLLM colocate mode (its own vLLM engine inside the training process, same GPU); this project runs
`train.py` against a vLLM server on the same GPU (weights over CUDA IPC), started by scripts/gpu_outcomes.sh.
TRL is pinned for this bench only (`TRL_PIN`; its vLLM extra admits 0.22-0.31, so the 0.26 GPU bundle) and is
never in requirements*.txt.

    python scripts/bench_vs_trl.py --workload real --dry-run          # mapping + both configs, no TRL, no GPU
    python scripts/bench_vs_trl.py --workload real --side trl --out outputs/trl_real
    python scripts/bench_vs_trl.py --workload real --side trl --cpu-smoke --out outputs/trl_smoke   # CPU, ~1 min
    python scripts/bench_vs_trl.py --workload real --side ours --base-url http://127.0.0.1:8000 --out outputs/ours
    python scripts/bench_vs_trl.py --report outputs/outcomes              # table + curves.png from the runs

How each setting maps (`mapping`): one optimizer step = `prompts_per_step` prompts x `num_generations`
completions on both sides. TRL: `per_device_train_batch_size = num_generations` (one group per micro-batch),
`gradient_accumulation_steps = steps_per_generation = prompts_per_step` (one generation round per optimizer step,
`num_iterations = 1`: on-policy up to the sampler mismatch). Ours: `--token-budget` rows hold whole groups and
`--gradient-accumulation-steps` micro-batches; the batcher packs by tokens, so the groups per step follow from
`token_budget x accumulation / (G x tokens a sample)` -- the bench sizes them from max lengths and logs the
measured `batch/groups_per_step`. Loss family: DAPO on both (token-level clip 0.2 / 0.28, normalised by the
step's loss tokens, no KL); the sampler mismatch is a token-level mask outside [0.5, 5] on both (TRL
`vllm_importance_sampling_mode="token_mask"`). Zero-spread groups are trained on both sides (ours:
`--no-drop-equal-reward-groups`; TRL has no filter), so they count in both normalisers.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TRL_PIN = "trl==1.16.0"
"""Newest TRL on PyPI (2026-12-07); its `vllm` extra requires vllm>=0.22.0,<=0.31.0, which admits 0.26."""


@dataclass(frozen=True)
class BenchSettings:
    """What both trainers share. Defaults are the `real` workload's; `shape` overrides a few (WORKLOADS)."""

    model: str = ".models/smollm2-135m-instruct"
    """Local checkpoint both trainers load (and the server serves)."""
    dataset: str = "builtin:word_problems"
    """Training prompts (grpo/data.py loads them for both sides)."""
    eval_dataset: str | None = "builtin:word_problems_heldout"
    """Held-out prompts; None skips evaluation (the `shape` workload)."""
    reward: str = "accuracy"
    """Reward function, by this project's registry name (TRL receives the same Python function)."""
    num_generations: int = 8
    """G: completions per prompt."""
    prompts_per_step: int = 16
    """Prompts per optimizer step (x G completions)."""
    max_prompt_tokens: int = 128
    """Longest prompt in tokens (sizes our token budget and TRL's vLLM max length)."""
    max_completion_length: int = 256
    """Completion length limit on both sides."""
    learning_rate: float = 5e-6
    """AdamW, constant schedule, no warm-up, no weight decay, grad-norm clip 1.0 on both sides."""
    temperature: float = 1.0
    """Sampling temperature on both sides (ours also scales the trainer's logits by it, as TRL does)."""
    loss: str = "dapo"
    """Loss family: `dapo` here is our `loss:dapo` and TRL's `loss_type="dapo"`."""
    max_steps: int = 60
    """Optimizer steps per run."""
    eval_steps: int = 10
    """Evaluate every this many steps (and at step 0 and the end)."""
    eval_prompts: int = 256
    """Held-out prompts per evaluation."""
    eval_k: int = 4
    """Sampled answers per held-out prompt for pass@k (beside one greedy answer)."""
    gpu_memory_utilization: float = 0.3
    """vLLM's share of the GPU: TRL's colocated engine and our server alike."""
    seed: int = 0
    """Seed for both trainers (data order, sampling)."""
    ignore_eos: bool = False
    """Force every completion to max_completion_length (the `shape` workload)."""
    trl_vllm: bool = True
    """TRL generates with its colocated vLLM (bf16 autocast); False: with transformers in fp32 (`--cpu-smoke`)."""

    @property
    def samples_per_step(self) -> int:
        return self.num_generations * self.prompts_per_step

    @property
    def token_budget(self) -> int:
        """Our packed row: G whole samples of the longest size, so a micro-batch holds one group like TRL's."""
        return self.num_generations * (self.max_prompt_tokens + self.max_completion_length)


WORKLOADS = {
    "real": BenchSettings(),
    "shape": BenchSettings(model="/tmp/models/qwen3-0.6b", dataset="builtin:letters", eval_dataset=None,
                           reward="letters", max_completion_length=384, learning_rate=1e-6, max_steps=20,
                           ignore_eos=True),
}


def cpu_smoke(s: BenchSettings) -> BenchSettings:
    """TRL's side shrunk to run on a CPU in about a minute (G = 2, 2 prompts, 16 tokens, 2 steps, no evaluation,
    transformers' generation): checks the TRL install, its config, our reward under TRL's call and the curve
    callback before device time is spent on them."""
    return dataclasses.replace(s, num_generations=2, prompts_per_step=2, max_completion_length=16, max_steps=2,
                               eval_dataset=None, trl_vllm=False)


def ours_argv(s: BenchSettings, base_url: str, output_dir: str) -> list[str]:
    """train.py's command line for these settings."""
    argv = ["train.py", "--model", s.model, "--dataset", s.dataset, "--reward-funcs", s.reward,
            "--vllm-server-base-url", base_url, "--weight-transfer", "ipc",
            "--num-generations", str(s.num_generations), "--max-completion-length", str(s.max_completion_length),
            "--temperature", str(s.temperature), "--learning-rate", str(s.learning_rate),
            "--token-budget", str(s.token_budget), "--gradient-accumulation-steps", str(s.prompts_per_step),
            "--no-drop-equal-reward-groups", "--max-steps", str(s.max_steps), "--save-steps", str(s.max_steps),
            "--seed", str(s.seed), "--output-dir", output_dir]
    if s.eval_dataset:
        argv += ["--eval-dataset", s.eval_dataset, "--eval-max-prompts", str(s.eval_prompts),
                 "--eval-steps", str(s.eval_steps), "--eval-num-generations", str(s.eval_k)]
    return argv + [f"loss:{s.loss}"]


def trl_config_kwargs(s: BenchSettings, output_dir: str) -> dict:
    """`trl.GRPOConfig(**kwargs)` for these settings (field names as in TRL 1.16's grpo_config.py)."""
    generation_kwargs = {"ignore_eos": True, "min_tokens": s.max_completion_length} if s.ignore_eos else None
    return dict(
        output_dir=output_dir, num_generations=s.num_generations, per_device_train_batch_size=s.num_generations,
        gradient_accumulation_steps=s.prompts_per_step, steps_per_generation=s.prompts_per_step, num_iterations=1,
        max_completion_length=s.max_completion_length, temperature=s.temperature, top_p=1.0, top_k=0,
        learning_rate=s.learning_rate, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
        adam_epsilon=1e-8, max_grad_norm=1.0, loss_type=s.loss, beta=0.0, epsilon=0.2,
        epsilon_high=0.28 if s.loss == "dapo" else 0.2, scale_rewards="group", importance_sampling_level="token",
        vllm_importance_sampling_correction=True, vllm_importance_sampling_mode="token_mask",
        vllm_importance_sampling_clip_min=0.5, vllm_importance_sampling_clip_max=5.0, mask_truncated_completions=False,
        use_vllm=s.trl_vllm, vllm_mode="colocate", vllm_gpu_memory_utilization=s.gpu_memory_utilization,
        vllm_max_model_length=s.max_prompt_tokens + s.max_completion_length, vllm_enable_sleep_mode=False,
        generation_kwargs=generation_kwargs, bf16=s.trl_vllm, gradient_checkpointing=False, max_steps=s.max_steps,
        seed=s.seed, logging_steps=1, save_strategy="no", report_to="none", log_completions=False)


MAPPING = [  # (setting, ours, TRL, note)
    ("group size G", "--num-generations", "num_generations", "same value"),
    ("prompts per step", "--gradient-accumulation-steps (one group per packed row)",
     "gradient_accumulation_steps = steps_per_generation", "per_device_train_batch_size = G"),
    ("completion length", "--max-completion-length", "max_completion_length", "same value"),
    ("learning rate", "--learning-rate, constant", "learning_rate, lr_scheduler_type=constant", "AdamW both"),
    ("temperature", "--temperature", "temperature", "top_p 1, top_k off both"),
    ("loss", "loss:dapo (clip 0.2/0.28, token normaliser)", "loss_type=dapo, epsilon 0.2, epsilon_high 0.28",
     "no KL (beta 0) both"),
    ("advantage", "advantage:group_std (default)", "scale_rewards=group", "(r - mean) / std per group"),
    ("sampler mismatch", "token mask outside [0.5, 5]", "vllm_importance_sampling_mode=token_mask, [0.5, 5]",
     "same rule"),
    ("zero-spread groups", "--no-drop-equal-reward-groups", "(always trained)", "counted in normalisers both"),
    ("updates per batch", "one (async: up to max_staleness behind)", "num_iterations=1", ""),
    ("generation", "vLLM server, same GPU, CUDA-IPC sync", "vllm_mode=colocate", "gpu share equal"),
    ("precision", "--dtype float32 master weights (default)", "bf16=True autocast, fp32 weights", "closest"),
]


def print_dry_run(name: str, s: BenchSettings) -> None:
    print(f"workload {name}: {json.dumps(dataclasses.asdict(s))}")
    print(f"pinned for the bench only: {TRL_PIN} (pip install --target a throwaway dir; vLLM 0.22-0.31)")
    print("| setting | ours | TRL | note |\n|---|---|---|---|")
    for row in MAPPING:
        print("| " + " | ".join(row) + " |")
    print("ours: python " + " ".join(ours_argv(s, "http://127.0.0.1:8000", "outputs/ours")))
    print("trl GRPOConfig: " + json.dumps(trl_config_kwargs(s, "outputs/trl"), sort_keys=True))


def score(reward_name: str, rows: list, answers: list[list[str]]) -> list[list[float]]:
    """Rewards of each row's answers (None -> 0, as the trainer's eval counts unscored answers)."""
    from grpo.rewards import resolve_reward

    reward = resolve_reward(reward_name)
    flat_rows = [row for row, texts in zip(rows, answers) for _ in texts]
    columns = {key: [row[key] for row in flat_rows] for key in rows[0] if key != "prompt"}
    flat = reward(completions=[[{"role": "assistant", "content": t}] for texts in answers for t in texts], **columns)
    out, i = [], 0
    for texts in answers:
        out.append([float(r or 0.0) for r in flat[i:i + len(texts)]])
        i += len(texts)
    return out


def trl_eval(trainer, s: BenchSettings, rows: list) -> dict:
    """Greedy accuracy and pass@k on the held-out rows with the colocated engine, after syncing the policy."""
    from vllm import SamplingParams

    generation = trainer.vllm_generation
    generation.sync_weights()
    conversations = [row["prompt"] for row in rows]
    greedy = generation.llm.chat(conversations, SamplingParams(temperature=0.0, max_tokens=s.max_completion_length),
                                 use_tqdm=False)
    sampled = generation.llm.chat(conversations, SamplingParams(temperature=s.temperature, n=s.eval_k, seed=s.seed,
                                                                max_tokens=s.max_completion_length), use_tqdm=False)
    greedy_r = score(s.reward, rows, [[o.outputs[0].text] for o in greedy])
    sampled_r = score(s.reward, rows, [[c.text for c in o.outputs] for o in sampled])
    return {"eval/reward": sum(r[0] for r in greedy_r) / len(rows),
            "eval/pass@k": sum(max(r) for r in sampled_r) / len(rows),
            "eval/mean@k": sum(sum(r) / len(r) for r in sampled_r) / len(rows)}


def run_trl(s: BenchSettings, out: Path) -> None:
    """TRL's GRPOTrainer on these settings; writes out/curve.jsonl (one record a step, eval records beside)."""
    start = time.time()
    import datasets
    import trl
    from transformers import TrainerCallback

    from grpo.data import load_prompts

    config = trl.GRPOConfig(**trl_config_kwargs(s, str(out / "checkpoints")))
    print(f"TRL {trl.__version__} GRPOConfig:\n{config.to_json_string()}", flush=True)
    if s.trl_vllm:
        use_attention_backend(os.environ.get("GPUVLLM_ATTN", "TRITON_ATTN"))
    held_out = list(load_prompts(s.eval_dataset))[:s.eval_prompts] if s.eval_dataset else []
    curve = open(out / "curve.jsonl", "w")
    # the training clock starts when TRL's trainer does (its colocated vLLM engine is built by then, as our server
    # is before our trainer starts) and leaves out TRL's evaluations, which pause its training (ours overlap with
    # training and stay in our clock)
    state_box = {"eval_s": 0.0, "t0": None}

    class Curve(TrainerCallback):
        def write(self, record: dict) -> None:
            curve.write(json.dumps(record) + "\n")
            curve.flush()

        def evaluate(self, step: int) -> None:
            if not held_out:
                return
            t = time.time()
            metrics = trl_eval(trainer, s, held_out)
            state_box["eval_s"] += time.time() - t
            self.write({"step": step, "samples": step * s.samples_per_step, "wall_s": t - start,
                        "train_wall_s": t - state_box["t0"] - (state_box["eval_s"] - (time.time() - t)),
                        "eval_s": time.time() - t, **metrics})

        def on_train_begin(self, args, state, control, **kwargs):
            state_box["t0"] = time.time()
            print(f"TRL start-up (imports, model, its colocated vLLM engine if any): {state_box['t0'] - start:.1f} s", flush=True)
            self.evaluate(0)

        def on_log(self, args, state, control, logs=None, **kwargs):
            logs = logs or {}
            # trained tokens as ours counts them: completion tokens of the step's samples
            trained = logs.get("completions/mean_length", 0.0) * s.samples_per_step
            self.write({"step": state.global_step, "time": time.time(), "wall_s": time.time() - start,
                        "train_wall_s": time.time() - state_box["t0"] - state_box["eval_s"],
                        "batch/trained_tokens_per_step": trained, **logs})

        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step % s.eval_steps == 0 or state.global_step == s.max_steps:
                self.evaluate(state.global_step)

    from grpo.data import load_prompts as load
    from grpo.rewards import resolve_reward

    train = datasets.Dataset.from_list(list(load(s.dataset)))
    trainer = trl.GRPOTrainer(model=s.model, reward_funcs=[resolve_reward(s.reward)], args=config,
                              train_dataset=train, callbacks=[Curve()])
    trainer.train()
    curve.close()


def use_attention_backend(backend: str) -> None:
    """TRL builds its colocated `vllm.LLM` without an attention-backend argument, and vLLM 0.26 has no environment
    variable for it: pass the backend our server uses (the GPU bundle has no FlashAttention), so both sides generate
    with the same kernels."""
    import trl.generation.vllm_generation as generation

    build = generation.LLM

    def llm(*args, **kwargs):
        kwargs.setdefault("attention_backend", backend)
        print(f"TRL's colocated vLLM: attention_backend={kwargs['attention_backend']}", flush=True)
        return build(*args, **kwargs)

    generation.LLM = llm


def run_ours(s: BenchSettings, out: Path, base_url: str, max_staleness: int) -> int:
    """train.py against a running server; the step-0 point is scripts/eval_heldout.py's, taken by the caller."""
    import subprocess

    argv = [sys.executable, *ours_argv(s, base_url, str(out)), "--max-staleness", str(max_staleness)]
    print("ours: " + " ".join(argv), flush=True)
    start = time.time()
    rc = subprocess.run(argv, cwd=ROOT).returncode
    (out / "wall.json").write_text(json.dumps({"start": start, "end": time.time(), "rc": rc}))
    return rc


def load_curve(run: Path) -> tuple[list[dict], list[dict]]:
    """(step records, eval records) of one run: ours (metrics.jsonl + wall.json) or TRL's (curve.jsonl). Every
    record gets `train_wall_s`, the run's training clock: TRL's from its trainer's start with its (pausing)
    evaluations left out; ours from the train.py process start (model load and compile included), evaluations
    included since they overlap with training. An eval point sits where its weights were made: TRL's at the step it
    ran after, ours at the step that produced weight version v (v - 1: version 1 is the cold sync of the step-0
    weights)."""
    if (run / "curve.jsonl").exists():
        records = [json.loads(line) for line in open(run / "curve.jsonl")]
        return [r for r in records if "eval/reward" not in r], [r for r in records if "eval/reward" in r]
    start = json.loads((run / "wall.json").read_text())["start"]
    steps, evals = [], []
    for r in map(json.loads, open(run / "metrics.jsonl")):
        r = r | {"wall_s": r["time"] - start, "train_wall_s": r["time"] - start}
        (evals if "eval/reward" in r else steps).append(r)
    per_step = next((r["batch/samples_per_step"] for r in steps if "batch/samples_per_step" in r), 0)
    step_time = {r["step"]: r["train_wall_s"] for r in steps if "step" in r}
    for r in evals:
        trained = int(r.get("eval/model_version", r["step"] + 1)) - 1
        r.update(step=trained, samples=trained * per_step, train_wall_s=step_time.get(trained, r["train_wall_s"]))
    return steps, evals


def throughput(steps: list[dict], warmup: int = 3) -> dict:
    """Steady-state optimizer steps/s and trained tokens/s (the first `warmup` steps left out)."""
    steady = [r for r in steps if r.get("step", 0) > warmup and "time" in r]
    if len(steady) < 2:
        return {}
    seconds = steady[-1]["time"] - steady[0]["time"]
    tokens = sum(r.get("batch/trained_tokens_per_step", 0) for r in steady[1:])
    return {"steps_per_s": (len(steady) - 1) / seconds, "trained_tokens_per_s": tokens / seconds}


def time_to(points: list[dict], target: float) -> float | None:
    """Training-clock seconds at the first eval point whose greedy accuracy reaches `target` (None: never)."""
    return next((p["train_wall_s"] for p in points if p["eval/reward"] is not None and p["eval/reward"] >= target - 1e-9),
                None)


def report(folder: Path, baseline: Path | None) -> dict:
    """Curves of every run under `folder` (held-out greedy accuracy and pass@k vs the training clock and vs samples,
    the step-0 baseline first) -> folder/curves.json, folder/curves.png and the comparisons the outcomes issue asks
    for, printed: every eval point, gain over step 0 with its interval, time to the peer's final accuracy."""
    from eval_heldout import wilson_interval

    runs = {d.name: load_curve(d) for d in sorted(folder.iterdir()) if (d / "curve.jsonl").exists()
            or ((d / "wall.json").exists() and (d / "metrics.jsonl").exists())}
    base = json.loads(baseline.read_text()) if baseline and baseline.exists() else None
    curves = {}
    for name, (steps, evals) in runs.items():
        points = [{"step": 0, "train_wall_s": 0.0, "samples": 0, "eval/reward": base["greedy_accuracy"],
                   "eval/pass@k": base.get(f"pass@{base.get('k', 0)}")}] if base and name != "trl" else []
        points += [{k: r.get(k) for k in ("step", "train_wall_s", "samples", "eval/reward", "eval/pass@k")}
                   for r in evals]
        curves[name] = {"points": points, **throughput(steps)}
        print(f"{name}: {len(steps)} steps, {throughput(steps)}")
        for p in points:
            print(f"  step {p['step']:>4}  t {p['train_wall_s']:7.1f} s  samples {p['samples']:>6}  "
                  f"greedy {p['eval/reward']:.3f}  pass@k {p['eval/pass@k'] if p['eval/pass@k'] is None else round(p['eval/pass@k'], 3)}")
    n = int(base["num_prompts"]) if base else 0
    summary = {}
    start = base["greedy_accuracy"] if base else None
    for name, curve in curves.items():
        pts = [p for p in curve["points"] if p["eval/reward"] is not None]
        if not pts:
            continue
        first, last = pts[0]["eval/reward"], pts[-1]["eval/reward"]
        zero = start if start is not None and name != "trl" else first
        low, high = wilson_interval(round(last * n), n) if n else (float("nan"), float("nan"))
        summary[name] = {"step0": zero, "final": last, "final_ci95": [low, high], "final_t": pts[-1]["train_wall_s"],
                         "gain_points": 100 * (last - zero), "t_to_plus20": time_to(pts, zero + 0.20),
                         "t_to_own_final": time_to(pts, last)}
        print(f"{name}: held-out greedy {zero:.3f} -> {last:.3f} (95 % [{low:.3f}, {high:.3f}], n={n}) = "
              f"{100 * (last - zero):+.1f} points at t={pts[-1]['train_wall_s']:.0f} s; +20 points first at "
              f"{summary[name]['t_to_plus20']} s")
    for peer in ("trl", "sync"):
        if peer in summary and "async" in curves:
            target = summary[peer]["final"]
            ours_t = time_to(curves["async"]["points"], target)
            peer_t = summary[peer]["t_to_own_final"]
            ratio = ours_t / peer_t if ours_t is not None and peer_t else None
            summary[f"async_vs_{peer}"] = {"target": target, "async_s": ours_t, "peer_s": peer_t, "ratio": ratio}
            print(f"time to {peer}'s final accuracy {target:.3f}: async {ours_t} s, {peer} {peer_t} s, ratio {ratio}")
    (folder / "curves.json").write_text(json.dumps({"curves": curves, "summary": summary}, indent=1))
    try:
        import matplotlib
    except ImportError:
        print("matplotlib not installed: no curves.png (curves.json has the points)")
        return summary
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for name, curve in curves.items():
        for ax, x in zip(axes, ("train_wall_s", "samples")):
            xs = [p[x] for p in curve["points"]]
            ax.plot(xs, [p["eval/reward"] for p in curve["points"]], marker="o", label=f"{name} greedy")
            ax.plot(xs, [p["eval/pass@k"] for p in curve["points"]], linestyle="--", label=f"{name} pass@k")
    for ax, label in zip(axes, ("training seconds", "samples trained")):
        ax.set_xlabel(label)
        ax.set_ylabel("held-out accuracy")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(folder / "curves.png", dpi=120)
    return summary


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", choices=sorted(WORKLOADS), default="real")
    parser.add_argument("--side", choices=["ours", "trl"], help="which trainer to run")
    parser.add_argument("--dry-run", action="store_true", help="print the mapping and both configs, run nothing")
    parser.add_argument("--out", type=Path, default=ROOT / "outputs" / "bench_vs_trl")
    parser.add_argument("--base-url", default="http://127.0.0.1:8000", help="our side's vLLM server")
    parser.add_argument("--max-staleness", type=int, default=4, help="our side: 4 async, 0 synchronous")
    parser.add_argument("--model", default=None, help="override the workload's model path")
    parser.add_argument("--max-steps", type=int, default=None, help="override the workload's optimizer steps")
    parser.add_argument("--learning-rate", type=float, default=None, help="override the workload's learning rate")
    parser.add_argument("--eval-steps", type=int, default=None, help="override the workload's evaluation interval")
    parser.add_argument("--cpu-smoke", action="store_true",
                        help="with --side trl: a two-step run on CPU without vLLM (cpu_smoke), before device time")
    parser.add_argument("--report", type=Path, default=None, help="summarise the runs under this folder")
    parser.add_argument("--baseline", type=Path, default=None, help="eval_heldout.py JSON: the step-0 point")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    if args.report:
        report(args.report, args.baseline)
        return
    s = WORKLOADS[args.workload]
    s = dataclasses.replace(s, **{k: v for k, v in (("model", args.model), ("max_steps", args.max_steps),
                                                     ("learning_rate", args.learning_rate),
                                                     ("eval_steps", args.eval_steps)) if v})
    if args.cpu_smoke:
        if args.side != "trl":
            parser.error("--cpu-smoke runs TRL's side only (--side trl); ours needs a vLLM server")
        s = cpu_smoke(s)
    if args.dry_run or not args.side:
        return print_dry_run(args.workload, s)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "settings.json").write_text(json.dumps(dataclasses.asdict(s) | {"side": args.side}))
    if args.side == "trl":
        return run_trl(s, args.out)
    sys.exit(run_ours(s, args.out, args.base_url, args.max_staleness))


if __name__ == "__main__":
    main()
