"""Trainer scaling over ranks: trained tokens/s per GPU with tree packing, FSDP2, the real token-budget batcher and
the real training step (grpo/step.py `train_micro_batch`), fed by a synthetic sample source (groups sharing a prompt, as
the rollout worker would deliver them). Random weights, public Qwen3 shapes, no download, no vLLM needed.

    python scripts/bench_scaling.py --ranks 1 2 4 --shape Qwen3-1.7B     # one torchrun per rank count, one table

Each rank count runs `--steps` optimizer steps after `--warmup`; it prints trained tokens/s per GPU, scaling
efficiency against the smallest rank count, batch/row_imbalance and peak memory.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

SHAPES = {  # public Qwen3 configs (text stacks)
    "Qwen3-0.6B": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128, tie_word_embeddings=True),
    "Qwen3-1.7B": dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128, tie_word_embeddings=True),
    "tiny": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=32, tie_word_embeddings=False),
}


def synthetic_groups(seed: int, vocab: int, group_size: int, prompt_len: int, completion_len: int):
    """An endless stream of groups (shared prompt, independent completions), like the rollout worker's output."""
    from grpo.samples import TrainingSample

    rng, group_id = random.Random(seed), 0
    while True:
        prompt = [rng.randrange(10, vocab) for _ in range(rng.randint(prompt_len // 2, prompt_len))]
        for _ in range(group_size):
            completion = [rng.randrange(10, vocab) for _ in range(rng.randint(completion_len // 4, completion_len))]
            ids = prompt + completion
            yield TrainingSample(ids, [0] * len(prompt) + [1] * len(completion), [-1.0] * len(ids),
                                 rng.uniform(-1, 1), group_id, 0)
        group_id += 1


def run_rank(args) -> None:
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from grpo.batcher import TokenBudgetBatcher
    from grpo.distributed import broadcast_object, init_distributed, shard_model
    from grpo.losses import get_loss
    from grpo.policy import PackedPolicy
    from grpo.tree_attention import select_backend
    from bench_step import next_plan
    import grpo.step

    info = init_distributed()
    torch.manual_seed(0)
    vocab = 151_936 if args.shape != "tiny" else 1024
    cfg = Qwen3Config(vocab_size=vocab, **SHAPES[args.shape])
    with torch.device(info.device):
        model = Qwen3ForCausalLM(cfg)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    cuda = info.device.type == "cuda"
    policy = shard_model(PackedPolicy(model, select_backend("auto", info.device), 1.0), info, mixed_precision=cuda)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-6)
    autocast = (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if cuda else contextlib.nullcontext
    loss_fn, loss_cfg = get_loss("clipped_surrogate")
    batcher = TokenBudgetBatcher(args.token_budget, info.world_size)
    source = synthetic_groups(0, vocab, args.group_size, args.prompt_len, args.completion_len)

    trained, imbalance, t0 = 0, [], None
    for step in range(args.warmup + args.steps):
        if step == args.warmup:
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            t0 = time.perf_counter()
        plan = broadcast_object(next_plan(batcher, source) if info.is_main else None, info)
        grpo.step.train_micro_batch(policy, plan.rows[info.rank], plan, loss_fn, loss_cfg, info.world_size, 1, autocast)
        torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step >= args.warmup:
            trained += plan.trained_tokens
            imbalance.append(plan.stats["batch/row_imbalance"])
    if cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else float("nan")
    if info.is_main:
        print("RESULT " + json.dumps({"ranks": info.world_size, "trained_tokens": trained, "seconds": seconds,
                                      "tokens_per_s_per_gpu": trained / seconds / info.world_size,
                                      "row_imbalance": sum(imbalance) / len(imbalance), "peak_gib": peak}),
              flush=True)
    if info.world_size > 1:
        torch.distributed.destroy_process_group()


def drive(args) -> None:
    results = []
    for ranks in args.ranks:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks),
               __file__, "--rank-worker", "--shape", args.shape, "--steps", str(args.steps), "--warmup",
               str(args.warmup), "--token-budget", str(args.token_budget), "--group-size", str(args.group_size),
               "--prompt-len", str(args.prompt_len), "--completion-len", str(args.completion_len)]
        out = subprocess.run(cmd, capture_output=True, text=True, env=os.environ | {"PYTHONPATH": str(REPO)})
        lines = [l for l in out.stdout.splitlines() if l.startswith("RESULT ")]
        if out.returncode != 0 or not lines:
            print(out.stdout[-2000:], out.stderr[-4000:])
            raise SystemExit(f"{ranks} ranks failed (exit {out.returncode})")
        results.append(json.loads(lines[-1][len("RESULT "):]))
    base = results[0]["tokens_per_s_per_gpu"]
    print(f"{args.shape}, budget {args.token_budget} tokens/row, groups of {args.group_size}, {args.steps} steps")
    print(f"{'ranks':>5} {'trained tok/s/GPU':>18} {'efficiency':>10} {'row_imbalance':>13} {'peak GiB':>9}")
    for r in results:
        print(f"{r['ranks']:>5} {r['tokens_per_s_per_gpu']:>18.0f} {r['tokens_per_s_per_gpu'] / base:>10.2f} "
              f"{r['row_imbalance']:>13.2f} {r['peak_gib']:>9.1f}")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, nargs="+", default=[1, 2])
    p.add_argument("--shape", choices=sorted(SHAPES), default="Qwen3-1.7B")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--token-budget", type=int, default=16384)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=1024)
    p.add_argument("--completion-len", type=int, default=512)
    p.add_argument("--rank-worker", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args()
    run_rank(a) if a.rank_worker else drive(a)
