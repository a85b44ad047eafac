"""Generation side: `python rollout.py serve ...` prints and runs the exact `vllm serve` command the trainer's
features need; `python rollout.py sample ...` runs the rollout loop standalone and writes groups as JSONL.

`sample` takes the trainer's flags (`--model`, `--dataset`, `--reward-funcs`, `--num-generations`, ...) and runs
`AsyncRolloutLoop` (or `--loop-cls`) against a running server with no trainer: the model version stays fixed and
the token allowance is unlimited. Use it to check a reward function, a tool or an environment before training.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated

import tyro

from grpo.config import AsyncGRPOConfig
from grpo.vllm_server import ServeConfig


@dataclass(frozen=True)
class Serve:
    server: ServeConfig
    dry_run: bool = False
    """Only print the command."""


@dataclass(frozen=True)
class Sample:
    config: tyro.conf.OmitArgPrefixes[AsyncGRPOConfig] = field(default_factory=AsyncGRPOConfig)
    num_prompts: int = 8
    """Prompts to draw (in dataset order); each yields `num_generations` rollouts."""
    output: Path = Path("outputs/samples.jsonl")
    """Where the groups are written, one JSON object per line."""
    model_version: int = 0
    """Version stamped on the groups (there is no trainer to advance it)."""


def serve(cmd: Serve) -> int:
    from grpo.vllm_server import format_command, serve_command

    argv, env = serve_command(cmd.server)
    print(format_command(argv, env), flush=True)
    if cmd.dry_run:
        return 0
    return subprocess.call(argv, env=os.environ | env)


def _nan_to_none(values) -> list:
    return [None if v != v else float(v) for v in values]


def group_record(group, advantages, kept: bool) -> dict:
    return {"group_id": group.group_id, "row_index": group.row_index, "model_version": group.model_version,
            "kept": kept, "prompt": group.prompts[0], "rewards": _nan_to_none(group.rewards),
            "advantages": _nan_to_none(advantages), "completions": group.completions,
            "completion_ids": group.completions_ids,
            "num_turns": [len(r.turns) for r in group.rollouts],
            "finish_reasons": [r.turns[-1].finish_reason if r.turns else None for r in group.rollouts],
            "tool_call_counts": group.tool_call_counts}


def sample(cmd: Sample) -> int:
    import asyncio
    import json
    import queue
    import time
    from types import SimpleNamespace

    import numpy as np
    from transformers import AutoTokenizer

    from grpo.metrics import MetricsWindow
    from grpo.rollout_loop import AsyncRolloutLoop
    from grpo.shared_state import LoopOptions, SharedState
    from grpo.inputs import resolve_inputs

    config = cmd.config
    reward_funcs, dataset, tools, env_factory, loop_cls = resolve_inputs(config, None, None, None, None, None)
    tokenizer = AutoTokenizer.from_pretrained(config.model, trust_remote_code=config.trust_remote_code)
    cmd.output.parent.mkdir(parents=True, exist_ok=True)
    rewards, lengths, kept_flags = [], [], []
    metrics = queue.Queue()
    with open(cmd.output, "w") as out:
        def on_group(group, advantages, kept):
            out.write(json.dumps(group_record(group, advantages, kept), default=str) + "\n")
            rewards.extend(group.rewards[~np.isnan(group.rewards)].tolist())
            lengths.extend(len(ids) for ids in group.completions_ids)
            kept_flags.append(kept)

        shared = SharedState(metrics=metrics, model_version=SimpleNamespace(value=cmd.model_version))
        options = LoopOptions(tools=tuple(tools), environment_factory=env_factory, group_callback=on_group)
        loop = (loop_cls or AsyncRolloutLoop)(config, config.model, dataset, reward_funcs, tokenizer,
                                              [tokenizer.eos_token_id], shared, options)
        start = time.perf_counter()
        asyncio.run(loop.run(max_groups=cmd.num_prompts))
        wall = time.perf_counter() - start
    window = MetricsWindow()
    while not metrics.empty():
        window.extend(metrics.get())
    summary = window.reduce()
    print(f"groups {len(kept_flags)} (kept {sum(kept_flags)}) | rollouts {len(lengths)} | "
          f"reward mean {np.mean(rewards) if rewards else float('nan'):.4f} | "
          f"pass rate {np.mean(np.array(rewards) > 0) if rewards else float('nan'):.3f} | "
          f"length mean {np.mean(lengths) if lengths else 0:.1f} max {max(lengths, default=0)} | "
          f"clipped {summary.get('completions/clipped_ratio', float('nan')):.3f} | "
          f"duplicates {summary.get('completions/duplicate_frac', float('nan')):.3f} | "
          f"generated tokens/s {sum(lengths) / wall:.0f} | wall {wall:.1f} s | -> {cmd.output}", flush=True)
    return 0


Command = (Annotated[Serve, tyro.conf.subcommand("serve")]
           | Annotated[Sample, tyro.conf.subcommand("sample")])

if __name__ == "__main__":
    cmd = tyro.cli(Command, description=__doc__)
    sys.exit(serve(cmd) if isinstance(cmd, Serve) else sample(cmd))
