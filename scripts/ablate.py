"""Ablation runner: a grid of loss variants x seeds trained against one vLLM server, then a table and plots.

    python scripts/ablate.py --variants score_centering grpo dapo "dr_grpo+advantage=no_std" \\
        --seeds 0 1 2 --set max_steps=40 num_generations=8 --out docs/ablation

A variant is a registered loss name (`train.py --help` lists them) optionally followed by `+key=value` overrides
for that variant only (`loss.key` sets a loss option, `advantage=NAME` and `advantage.key` the estimator,
`advantage_batch_transforms=a,b` the transforms and `transform.NAME.key` their options, anything else a run
option); `--set` applies to every run.
Runs go one at a time (one server holds one policy's weights; every run starts with a cold weight sync), each in
`OUT/runs/VARIANT/seedS/` with train.py's reproduction bundle, train.log and metrics.jsonl. Existing finished runs
are kept (delete a run directory to redo it); `--report-only` rebuilds the table and plots from the run
directories; `--dry-run` prints every run's command and starts nothing. With held-out evaluation in the runs
(`--set eval_dataset=held_out.jsonl eval_steps=10`) the table has each run's final eval/reward, eval/pass@k and
eval/mean@k beside the training reward. Output: OUT/ablation.md, OUT/ablation.csv, OUT/reward.png,
OUT/sampling.png, OUT/entropy.png, and OUT/eval.png (held-out pass@k and mean@k vs weight version) with eval.
"""

from __future__ import annotations

import csv
import math
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import tyro

from plot_run import plot_bands, read_metrics, series

REPO = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Args:
    variants: tuple[str, ...] = ("score_centering", "grpo", "dapo", "dr_grpo+advantage=no_std", "gspo",
                                 "cispo")
    """Loss variants: registered name, optionally `name+key=value+...` (run or `loss.` options for that variant)."""
    seeds: tuple[int, ...] = (0, 1, 2)
    """Seeds per variant."""
    set: tuple[str, ...] = ()
    """`key=value` run options for every run (train.py field names, e.g. max_steps=40, loss.epsilon=0.1)."""
    out: Path = Path("outputs/ablation")
    """Where runs, the table and the plots go."""
    model: str = ".tiny/qwen3"
    """Model directory (the tiny local model is built if it is missing)."""
    dataset: str = "builtin:letters"
    reward_funcs: tuple[str, ...] = ("letters",)
    server_url: str | None = None
    """A running vLLM server (serving `model`); None = start a CPU server for the grid and stop it after."""
    threshold: float = 0.5
    """Reward level for the `steps to threshold` column (first step whose 5-step mean reaches it)."""
    window: int = 10
    """Final reward = mean reward of the last `window` logged steps."""
    report_only: bool = False
    """Skip training; rebuild the table and plots from OUT/runs."""
    dry_run: bool = False
    """Print the train.py command of every run and exit (nothing is started)."""
    run_timeout: float = 1800.0
    """Seconds after which a run is killed and reported as failed."""
    base_args: tuple[str, ...] = field(default=(
        "--num-generations", "8", "--max-completion-length", "12", "--learning-rate", "1e-3", "--max-steps", "40",
        "--save-strategy", "no", "--rollout-worker-timeout", "300"))
    """train.py arguments every run starts from (overridden by --set and variant options)."""


# ---------------------------------------------------------------------------------------------- the grid

def parse_variant(spec: str) -> tuple[str, dict[str, str]]:
    """`dr_grpo+advantage=no_std` -> ("dr_grpo", {"advantage": "no_std"})."""
    name, *pairs = spec.split("+")
    return name, dict(_pair(p) for p in pairs)


def _pair(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise SystemExit(f"option {text!r} must look like key=value")
    return key.strip(), value.strip()


def _flag(key: str, value: str, variadic: frozenset[str] = frozenset()) -> list[str]:
    """`key=value` -> train.py flags: `a.b_c=x` -> `--a.b-c x`; booleans -> `--a.b-c` / `--a.no-b-c`; a variadic
    run option takes several values separated by commas (`advantage_batch_transforms=batch_std,token_whiten`)."""
    flag = "--" + key.replace("_", "-")
    if value.lower() in ("true", "false"):  # tyro booleans are --flag / --no-flag (nested: --group.no-flag)
        head, dot, name = flag[2:].rpartition(".")
        return [flag if value.lower() == "true" else f"--{head}{dot}no-{name}"]
    if key in variadic:
        return [flag, *[v for v in value.split(",") if v]]
    return [flag, value]


def _variadic_keys() -> frozenset[str]:
    """The run options that take several values (tuple fields of the config)."""
    from grpo.cli_order import variadic_flags
    from grpo.config import AsyncGRPOConfig

    return frozenset(f[2:].replace("-", "_") for f in variadic_flags(AsyncGRPOConfig))


def train_command(args: Args, variant: str, seed: int, url: str, run_dir: Path) -> list[str]:
    """train.py argv for one run: base args, --set, the variant's options, then `loss:NAME --loss.x v` and
    `advantage:NAME --advantage.x v` (`advantage=NAME` picks the estimator; `advantage_estimator=` is its old name)."""
    name, overrides = parse_variant(variant)
    options = dict(_pair(s) for s in args.set) | overrides
    estimator = options.pop("advantage", None) or options.pop("advantage_estimator", None)
    options.pop("advantage_estimator", None)
    nested = ("loss.", "advantage.")
    variadic = _variadic_keys()
    run_opts = [a for k, v in options.items() if not k.startswith(nested) for a in _flag(k, v, variadic)]
    loss_opts = [a for k, v in options.items() if k.startswith("loss.") for a in _flag(k, v)]
    advantage_opts = [a for k, v in options.items() if k.startswith("advantage.") for a in _flag(k, v)]
    if advantage_opts and estimator is None:
        raise SystemExit(f"{variant}: advantage.* options need the estimator too (advantage=NAME)")
    advantage = [f"advantage:{estimator}", *advantage_opts] if estimator else []
    # run options before --seed: a variadic one (--advantage-batch-transforms a b) ends at the next flag, never at
    # the `loss:` subcommand it would swallow (train.py also reorders argv: grpo/cli_order.py)
    return [sys.executable, str(REPO / "train.py"), "--model", args.model, "--dataset", args.dataset,
            "--reward-funcs", *args.reward_funcs, "--vllm-server-base-url", url, *args.base_args, *run_opts,
            "--seed", str(seed), "--output-dir", str(run_dir), f"loss:{name}", *loss_opts, *advantage]


def run_one(args: Args, variant: str, seed: int, url: str) -> Path:
    run_dir = args.out / "runs" / variant / f"seed{seed}"
    if (run_dir / "DONE").exists():
        print(f"[ablate] {variant} seed {seed}: done earlier, kept")
        return run_dir
    run_dir.mkdir(parents=True, exist_ok=True)
    for stale in ("metrics.jsonl", "trained_prompts.jsonl"):
        (run_dir / stale).unlink(missing_ok=True)
    cmd = train_command(args, variant, seed, url, run_dir)
    (run_dir / "command.txt").write_text(" ".join(cmd) + "\n")
    start = time.time()
    env = os.environ | {"PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    with open(run_dir / "train.log", "w") as log:
        try:
            rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, env=env,
                                timeout=args.run_timeout).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    seconds = time.time() - start
    if rc == 0:
        (run_dir / "DONE").write_text(f"{seconds:.1f}\n")
    print(f"[ablate] {variant} seed {seed}: rc={rc} in {seconds:.0f} s ({run_dir})", flush=True)
    return run_dir


def start_server(args: Args):
    from grpo.vllm_server import ServeConfig, free_port, launch

    model = Path(args.model)
    if not model.exists() and model.parts[0] == ".tiny":
        sys.path.insert(0, str(REPO / "scripts"))
        from make_tiny_model import make

        make(REPO / ".tiny")
    cfg = ServeConfig(model=args.model, port=free_port(), max_model_len=512, dtype="float32", cpu=True,
                      weight_transfer_backend="cpu_file")
    args.out.mkdir(parents=True, exist_ok=True)
    return launch(cfg, log_path=args.out / "vllm.log")


# ---------------------------------------------------------------------------------------------- the report

COLUMNS = ("variant", "seeds", "final_reward_mean", "final_reward_std", "first_reward_mean", "steps_to_threshold",
           "final_eval_reward", "final_eval_pass@k", "final_eval_mean@k", "trained_tokens_per_s", "staleness_mean",
           "is_masked_frac", "is_ratio_mean", "wall_s_per_run")
EVAL_KEYS = {"final_eval_reward": "eval/reward", "final_eval_pass@k": "eval/pass@k", "final_eval_mean@k": "eval/mean@k"}
"""Each run's last logged value of the eval metric (runs with --set eval_dataset=...; nan without)."""


def _mean(values) -> float:
    values = [v for v in values if v is not None and math.isfinite(v)]
    return sum(values) / len(values) if values else math.nan


def _std(values) -> float:
    values = [v for v in values if math.isfinite(v)]
    if len(values) < 2:
        return math.nan
    mu = sum(values) / len(values)
    return math.sqrt(sum((v - mu) ** 2 for v in values) / (len(values) - 1))


def run_summary(rows: list[dict], threshold: float, window: int) -> dict:
    """Per-run numbers: final/first reward, first step whose 5-step mean reward reaches the threshold, means."""
    steps, rewards = series(rows, "reward")
    reached = next((steps[i] for i in range(len(rewards)) if _mean(rewards[max(0, i - 4): i + 1]) >= threshold),
                   None)
    return {"final_reward": _mean(rewards[-window:]), "first_reward": _mean(rewards[:window]), "reached": reached,
            "tokens_per_s": _mean(series(rows, "perf/wall_clock_trained_tokens_per_s")[1]),
            "staleness": _mean(series(rows, "sample/staleness_mean")[1]),
            "masked": _mean(series(rows, "sampling/masked_mean")[1]),
            "is_ratio": _mean(series(rows, "sampling/importance_sampling_ratio/mean")[1]),
            "seconds": rows[-1]["time"] - rows[0]["time"] if rows and "time" in rows[0] else math.nan,
            **{column: _last(series(rows, key)[1]) for column, key in EVAL_KEYS.items()}}


def _last(values) -> float:
    values = [v for v in values if v is not None and math.isfinite(v)]
    return values[-1] if values else math.nan


def summarize(variants: dict[str, list[list[dict]]], threshold: float, window: int) -> list[dict]:
    table = []
    for variant, runs in variants.items():
        s = [run_summary(rows, threshold, window) for rows in runs]
        reached = [r["reached"] for r in s]
        finals = [r["final_reward"] for r in s]
        table.append({
            "variant": variant, "seeds": len(runs), "final_reward_mean": _mean(finals),
            "final_reward_std": _std(finals), "first_reward_mean": _mean(r["first_reward"] for r in s),
            "steps_to_threshold": (f"{_mean([x for x in reached if x is not None]):.0f} "
                                   f"({sum(x is not None for x in reached)}/{len(reached)})"
                                   if any(x is not None for x in reached) else f"- (0/{len(reached)})"),
            **{column: _mean(r[column] for r in s) for column in EVAL_KEYS},
            "trained_tokens_per_s": _mean(r["tokens_per_s"] for r in s),
            "staleness_mean": _mean(r["staleness"] for r in s), "is_masked_frac": _mean(r["masked"] for r in s),
            "is_ratio_mean": _mean(r["is_ratio"] for r in s), "wall_s_per_run": _mean(r["seconds"] for r in s)})
    return table


def _fmt(value) -> str:
    if isinstance(value, float):
        return "nan" if not math.isfinite(value) else f"{value:.4g}"
    return str(value)


def write_report(args: Args, variants: dict[str, list[list[dict]]]) -> None:
    table = summarize(variants, args.threshold, args.window)
    with open(args.out / "ablation.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows(table)
    header = ("| variant | seeds | final reward (mean ± std) | first reward | steps to "
              f"{args.threshold:g} (runs reaching) | final eval reward (greedy) | final eval pass@k | "
              "final eval mean@k | trained tok/s | staleness | IS masked frac | IS ratio | wall s/run |")
    lines = [header, "|" + "---|" * 13]
    for r in table:
        lines.append(f"| {r['variant']} | {r['seeds']} | {_fmt(r['final_reward_mean'])} ± "
                     f"{_fmt(r['final_reward_std'])} | {_fmt(r['first_reward_mean'])} | {r['steps_to_threshold']} | "
                     f"{_fmt(r['final_eval_reward'])} | {_fmt(r['final_eval_pass@k'])} | "
                     f"{_fmt(r['final_eval_mean@k'])} | "
                     f"{_fmt(r['trained_tokens_per_s'])} | {_fmt(r['staleness_mean'])} | "
                     f"{_fmt(r['is_masked_frac'])} | {_fmt(r['is_ratio_mean'])} | {_fmt(r['wall_s_per_run'])} |")
    (args.out / "ablation.md").write_text("\n".join(lines) + "\n")
    title = (f"{args.dataset}, {len(args.seeds)} seeds per variant\n"
             f"line: mean over seeds, band: min-max; 5-step trailing mean")
    plot_bands(variants, ("reward",), args.out / "reward.png", title, smooth=5)
    plot_bands(variants, ("sampling/importance_sampling_ratio/mean", "sampling/masked_mean"),
               args.out / "sampling.png", title, smooth=5)
    plot_bands(variants, ("entropy",), args.out / "entropy.png", title, smooth=5)
    evals = {label: [[{**r, "step": r["eval/model_version"]} for r in rows if "eval/model_version" in r]
                     for rows in seeds] for label, seeds in variants.items()}
    if any(rows for seeds in evals.values() for rows in seeds):  # held-out eval ran: x = the weight version scored
        plot_bands(evals, ("eval/pass@k", "eval/mean@k"), args.out / "eval.png",
                   f"held-out eval ({len(args.seeds)} seeds per variant); x: weight version evaluated\n"
                   f"line: mean over seeds, band: min-max")
    print("\n".join(lines))


def collect(args: Args) -> dict[str, list[list[dict]]]:
    variants = {}
    for variant in args.variants:
        runs = [read_metrics(d) for seed in args.seeds
                if (d := args.out / "runs" / variant / f"seed{seed}" / "metrics.jsonl").exists()]
        runs = [rows for rows in runs if rows]
        if runs:
            variants[variant] = runs
        else:
            print(f"[ablate] {variant}: no finished run, left out of the report")
    return variants


def main(args: Args) -> None:
    if args.dry_run:
        import shlex

        url = args.server_url or "http://SERVER:PORT"
        for seed in args.seeds:
            for variant in args.variants:
                run_dir = args.out / "runs" / variant / f"seed{seed}"
                print(shlex.join(train_command(args, variant, seed, url, run_dir)))
        return
    if not args.report_only:
        server = None if args.server_url else start_server(args)
        url = args.server_url or server.base_url
        try:
            for seed in args.seeds:  # seeds outermost: a cut-short grid still has every variant
                for variant in args.variants:
                    run_one(args, variant, seed, url)
        finally:
            if server is not None:
                server.stop()
    write_report(args, collect(args))


if __name__ == "__main__":
    main(tyro.cli(Args, description=__doc__))
