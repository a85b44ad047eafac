"""Two optimizer steps of train.py's real step (build_policy, train_micro_batch, optimizer_step, save_checkpoint) on
a fixed batch, no vLLM server: the body of tests/test_multinode.py, run by one process (the reference) or by every
rank of a torchrun launch (`torchrun --nnodes 2 ... tests/multinode_step.py MODEL OUT_DIR`).

Per sharding (`--hsdp-replicas 1` = FSDP, `auto` = HSDP with one replica per node): step 1 on batch A, a checkpoint,
step 2 on batch B. Rank 0 writes `<OUT_DIR>/<name>.pt` with the full gradients and parameters after each step, the
tensors the weight sync would send (gathered through grpo/weight_sync.py's plan), Adam's moments after step 1 and
the mesh shape. `run(..., resume=CKPT)` loads CKPT and runs step 2 only: a 1-node resume of a 2-node checkpoint,
and (`--resume`) a 2-node resume of a 1-node one.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from test_train import random_samples as fixed_batch  # noqa: E402 - the same fixed batches as the FSDP2 test


def full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


def one_step(policy, optimizer, scheduler, info, samples, autocast) -> dict:
    """Rows split over ranks by group (as the batcher would), forward/backward, clip + AdamW step."""
    from grpo.losses import get_loss
    from grpo.step_plan import StepPlan
    from grpo.step import optimizer_step, train_micro_batch

    rows = [[s for s in samples if s.group_id % info.world_size == r] for r in range(info.world_size)]
    plan = StepPlan(rows, sum(s.num_trained for s in samples))
    train_micro_batch(policy, rows[info.rank], plan, *get_loss("clipped_surrogate"), info.world_size, 1, autocast)
    grads = {n: full(p.grad) for n, p in policy.named_parameters() if p.grad is not None}
    optimizer_step(policy, optimizer, scheduler, max_grad_norm=1.0)
    return {"grads": grads, "params": {n: full(p) for n, p in policy.named_parameters()}}


def run(model_dir: str, out_dir: Path, sharding: str, info, resume: str | None = None) -> dict:
    from grpo import checkpoint as ckpt
    from grpo.config import AsyncGRPOConfig
    from grpo.weight_sync import build_plan
    from grpo.policy import build_policy

    # Adam moves a weight by ~lr x g / (|g| + eps): reduction-order noise (~1e-9) on a gradient near eps would
    # move it by ~lr x 10%; eps = 1e-6 keeps that at ~1e-7, so parameters are comparable at 1e-6 too
    config = AsyncGRPOConfig(model=model_dir, hsdp_replicas=sharding, learning_rate=1e-4, adam_epsilon=1e-6,
                             output_dir=str(out_dir / sharding), attn_backend="sdpa")
    torch.manual_seed(0)
    model, policy, optimizer, scheduler, autocast = build_policy(config, info, token_budget=256)
    param = next(policy.parameters())
    result = {"mesh": tuple(param.device_mesh.shape) if hasattr(param, "device_mesh") else ()}
    if resume is None:
        result["step1"] = one_step(policy, optimizer, scheduler, info, fixed_batch(0), autocast)
        result["exp_avg"] = {n: full(optimizer.state[p]["exp_avg"]) for n, p in policy.named_parameters()
                              if p in optimizer.state}
        ckpt.save_checkpoint(config.output_dir, 1, model, None, optimizer, scheduler,
                             {"prompt_index": 4, "model_version": 1})
    else:
        result["state"] = ckpt.start_state(resume, config.output_dir, model, optimizer, scheduler)
        result["scheduler_epoch"] = scheduler.state_dict()["last_epoch"]
        result["loaded"] = {n: full(p) for n, p in policy.named_parameters()}
        result["loaded_exp_avg"] = {n: full(optimizer.state[p]["exp_avg"]) for n, p in policy.named_parameters()
                                     if p in optimizer.state}
    result["step2"] = one_step(policy, optimizer, scheduler, info, fixed_batch(1), autocast)
    result["synced"] = dict(build_plan(model).iter_tensors())  # every rank gathers (collective), as sync() does
    return result


def main() -> None:
    from grpo import checkpoint as ckpt
    from grpo.distributed import init_distributed

    parser = argparse.ArgumentParser()
    parser.add_argument("model_dir")
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--shardings", nargs="+", default=["1", "auto"])
    parser.add_argument("--resume", help="then also, per sharding: load this checkpoint, step 2 (resume-<name>.pt)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    info = init_distributed(timeout_s=300)
    try:  # one output_dir per rank stands in for nodes without a shared filesystem: must fail, naming the rank
        ckpt.check_shared_output_dir(args.out_dir / f"private-{info.rank}", wait_s=1.0)
        not_shared_error = None
    except RuntimeError as e:
        not_shared_error = str(e)
    ckpt.check_shared_output_dir(args.out_dir)
    for sharding in args.shardings:
        result = run(args.model_dir, args.out_dir, sharding, info)
        if info.is_main:
            torch.save(result | {"world": info.world_size, "nodes": info.num_nodes,
                                 "not_shared_error": not_shared_error}, args.out_dir / f"{sharding}.pt")
    for sharding in args.shardings if args.resume else ():
        result = run(args.model_dir, args.out_dir, sharding, info, resume=args.resume)
        if info.is_main:
            torch.save(result, args.out_dir / f"resume-{sharding}.pt")
    torch.distributed.barrier()  # nobody tears the groups down while another rank still uses them
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
