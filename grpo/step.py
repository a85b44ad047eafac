"""One optimizer step on this rank: a micro-batch's forward/backward (`train_micro_batch`), what its loss sees
(`loss_inputs`), the row loss, and the clip/step/zero with its non-finite guard (`optimizer_step`).

Nothing here waits for the GPU before the step's end (docs/design.md, one process; normalisers:
docs/losses.md). `normalized_row_loss` is the one row loss: train.py, the benches and the loss trace all run it; a
fork changes the loss through the registry (docs/losses.md "Adding a loss in a fork").
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from grpo.step_metrics import StepTimer, stage_metrics, to_host_async
from grpo.step_plan import StepPlan

log = logging.getLogger("train")


def loss_inputs(out, row, samples, plan: StepPlan, max_completion_length: int):
    """What a loss sees of one packed row: per-token log-probs (policy and sampler), advantages, the row's
    sequence/group structure, and the micro-batch's global counts (docs/losses.md)."""
    import torch

    from grpo.losses import LossInputs
    from grpo.trie import to_device

    sample_id = (row.host if row.host is not None else row).sample_id  # the CPU twin's when there is one: no GPU wait
    group_of_sample = torch.tensor([s.group_id for s in samples], dtype=torch.long, device=sample_id.device)  # [S]
    group_index, sequence_lengths = group_of_sample[sample_id], torch.bincount(sample_id, minlength=len(samples))
    if sample_id.device != row.sample_id.device:
        group_index, sequence_lengths = to_device([group_index, sequence_lengths], row.sample_id.device)
    return LossInputs(
        policy_logprobs=out.policy_logprobs.float(), sampler_logprobs=row.sampler_logprobs,
        advantages=row.advantages, sequence_index=row.sample_id, group_index=group_index,
        sequence_lengths=sequence_lengths,
        num_tokens_global=plan.trained_tokens, num_sequences_global=plan.trained_sequences,
        max_completion_length=max_completion_length,
        policy_top_logprobs=None if out.policy_top_logprobs is None else out.policy_top_logprobs.float(),
        sampler_top_logprobs=row.sampler_top_logprobs)


def normalized_row_loss(out, row, samples, plan: StepPlan, loss_fn, loss_options, world: int, grad_accum: int,
                        max_completion_length: int):
    """The row loss: (this rank's share of the micro-batch loss, loss metrics). `normalized_loss` divides
    by the count the loss's normaliser names over W ranks and GA steps (docs/losses.md)."""
    from grpo.losses import normalized_loss

    inputs = loss_inputs(out, row, samples, plan, max_completion_length)
    result = loss_fn(inputs, loss_options)
    return normalized_loss(result, inputs, world, grad_accum), result.metrics


def train_micro_batch(policy, samples, plan: StepPlan, loss_fn, loss_options, world: int, grad_accum: int,
                      autocast, max_completion_length: int = 1) -> dict:
    """Pack this rank's samples, forward/backward, return the loss metrics. The normaliser is global over ranks.

    Nothing here waits for the GPU: the metrics stay tensors and the timings CUDA events (resolve_metrics reads
    them once per step, after the optimizer), so the host packs the next micro-batch while this one runs."""
    import torch

    from grpo import master_weights
    from grpo.trie import pack_samples

    device = next(policy.parameters()).device
    row = pack_samples(samples).to(device)
    timer = StepTimer(device)
    with autocast():
        out = policy(row)
    timer.mark()
    metrics: dict = {}
    if row.num_loss_terms == 0:  # a zero-weight dummy row: forward/backward anyway to keep FSDP collectives aligned
        loss = out.policy_logprobs.sum() * 0.0
    else:
        loss, metrics = normalized_row_loss(out, row, samples, plan, loss_fn, loss_options, world, grad_accum,
                                            max_completion_length)
        metrics = {k: torch.as_tensor(v).detach() for k, v in metrics.items()} | {"entropy": out.entropy.mean()}
    if out.aux_loss is not None:  # router_aux_loss_coef x aux_loss / GA (docs/losses.md)
        loss = loss + policy_module(policy).aux_coef * out.aux_loss / grad_accum
        metrics["aux_loss"] = out.aux_loss.detach()
    loss.backward()
    if (weights := master_weights.of(policy)) is not None:  # one process without FSDP2: bf16 grads into fp32
        weights.accumulate()
    metrics = stage_metrics(metrics | {"loss": loss.detach() * grad_accum})  # read back after the timer's end
    timer.mark()
    return metrics | {"_timer": timer, "_forwarded": row.num_tokens, "_attended_keys": row.attention_cost,
                      "_head_tokens": row.num_loss_terms}


def policy_module(policy):
    return getattr(policy, "module", policy)


class NonFiniteStepError(RuntimeError):
    """Too many steps in a row had a non-finite loss or gradient norm."""


def finite_flag(grad_norm, losses):
    """1 (int32, on the device) when the gradient norm and every micro-batch loss are finite on every rank, else 0:
    one tiny all-reduce (the ranks must agree, or one would step while another skips), no wait for the GPU."""
    import torch

    if hasattr(grad_norm, "full_tensor"):  # FSDP2: clip_grad_norm_ returns a (replicated) DTensor
        grad_norm = grad_norm.full_tensor()
    flag = torch.isfinite(grad_norm.detach().float()).all()
    for loss in losses:
        flag = flag & torch.isfinite(loss.float()).all()
    flag = flag.to(torch.int32).reshape(1)
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MIN)
    return flag


@dataclass
class QueuedOptimizerStep:
    """An optimizer step the host has queued and not yet read back: the gradient norm and the finite verdict as
    device tensors, the timer of its GPU work."""

    grad_norm: Any
    flag: Any  # int32 [1] on the device: 1 when the loss and gradient norm were finite on every rank
    timer: StepTimer
    on_host: Any  # [grad norm, flag] as float32, their host copy queued before the timer's end (`to_host_async`)


def queue_optimizer_step(policy, optimizer, max_grad_norm: float | None, losses=()) -> QueuedOptimizerStep:
    """Clip, step, zero, without waiting for the GPU (`finish_optimizer_step` reads the verdict). A non-finite
    loss or gradient norm skips the optimizer (its state and the weights stay as they were) and drops the gradients.

    A fused AdamW (`build_optimizer`'s) gets the verdict as a device tensor (`found_inf`, the flag GradScaler
    uses): its kernel leaves weights, moments and step counts alone when it is 1, so the host queues the
    optimizer behind the backward without waiting for it. Other optimizers are stepped or not on the host's
    reading of the flag (a wait for the backward)."""
    import torch

    from grpo import master_weights

    if (weights := master_weights.of(policy)) is not None:  # one process without FSDP2: fp32 masters and grads in
        weights.to_master()
    params = [p for group in optimizer.param_groups for p in group["params"]]  # what it steps (no module walk)
    timer = StepTimer(params[0].device)
    grad_norm = torch.nn.utils.clip_grad_norm_(params, max_grad_norm or 1e30)
    flag = finite_flag(grad_norm, losses)
    if optimizer.defaults.get("fused"):
        optimizer.found_inf = (1 - flag).float().reshape(())
        try:
            optimizer.step()
        finally:
            del optimizer.found_inf
    elif bool(flag.item()):
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    norm = grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm
    on_host = to_host_async(torch.stack([norm.detach().float().reshape(()), flag.float().reshape(())]))
    timer.mark()
    return QueuedOptimizerStep(grad_norm, flag, timer, on_host)


def finish_optimizer_step(queued: QueuedOptimizerStep, scheduler) -> tuple:
    """(grad_norm before clipping as a float, seconds, stepped) of a queued step, waiting for its own GPU work (its
    timer's end), not for what was queued after it; the scheduler steps only when the optimizer did. It must run
    before the next step's optimizer (that step's learning rate)."""
    seconds = queued.timer.seconds()[0]
    grad_norm, flag = queued.on_host.tolist()
    stepped = flag == 1.0
    if stepped:
        scheduler.step()
    return grad_norm, seconds, stepped


def optimizer_step(policy, optimizer, scheduler, max_grad_norm: float | None, losses=()) -> tuple:
    """Clip, step, zero and wait for it: (grad_norm before clipping, seconds, stepped). `queue_optimizer_step`
    then `finish_optimizer_step`."""
    return finish_optimizer_step(queue_optimizer_step(policy, optimizer, max_grad_norm, losses), scheduler)


def check_nonfinite(stepped: bool, step: int, micro: list[dict], grad_norm: float, in_a_row: int,
                    limit: int) -> int:
    """Count skipped steps in a row; warn on each, raise NonFiniteStepError at `limit` (0 = never)."""
    if stepped:
        return 0
    in_a_row += 1
    losses = [m.get("loss") for m in micro]
    log.warning("step %d skipped: loss %s, grad norm %s are not finite (no optimizer step, no weight sync; %d in a "
                "row)", step, losses, grad_norm, in_a_row)
    if limit and in_a_row >= limit:
        raise NonFiniteStepError(
            f"{in_a_row} steps in a row had a non-finite loss or gradient norm (last: loss {losses}, grad norm "
            f"{grad_norm}); nothing was synced to the servers. Check the reward functions for NaN/inf, lower "
            f"--learning-rate, or use --dtype float32 (max_nonfinite_steps_in_a_row={limit})")
    return in_a_row
