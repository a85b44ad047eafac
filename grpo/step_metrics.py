"""Per-step metrics of the trainer: micro-batch metrics resolved without stalling the GPU, the step summary with
the spec's names (batch/*, sample/*, perf/*), and the logging window."""

from __future__ import annotations

import math
import time


def to_host_async(t):
    """A CUDA tensor's copy into pinned host memory, queued behind the work that makes it (the host does not wait);
    a tensor on any other device as it is. Read it after an event recorded later on the stream has completed: a
    read of the device tensor itself would wait for everything queued by then (the next step's forward/backward)."""
    return t.to("cpu", non_blocking=True) if t.device.type == "cuda" else t


def stage_metrics(metrics: dict) -> dict:
    """`metrics` with its tensor values' host copy queued now (`to_host_async`, as `_staged`); `resolve_metrics`
    reads that copy after the micro-batch's timer, without draining what was queued after it."""
    import torch

    keys = [k for k, v in metrics.items() if isinstance(v, torch.Tensor)]
    if not keys:
        return metrics
    return metrics | {"_staged": (keys, to_host_async(torch.stack([metrics[k].float().reshape(()) for k in keys])))}


def resolve_metrics(micro: list[dict]) -> list[dict]:
    """train_micro_batch's metrics as plain floats, with perf/fwd_s and perf/fwd_bwd_s: waits for each micro-batch's
    timer, then reads its staged host copy (`stage_metrics`); unstaged tensors are read in one device sync."""
    import torch

    out = [{k: v for k, v in m.items() if k not in ("_timer", "_staged")} for m in micro]
    for m, resolved in zip(micro, out):
        if (timer := m.get("_timer")) is not None:
            resolved["perf/fwd_s"], resolved["perf/fwd_bwd_s"] = timer.seconds()
        if (staged := m.get("_staged")) is not None:
            keys, values = staged
            resolved.update(zip(keys, values.tolist()))
    keys = [(i, k) for i, m in enumerate(out) for k, v in m.items() if isinstance(v, torch.Tensor)]
    values = torch.stack([out[i][k].float().reshape(()) for i, k in keys]).tolist() if keys else []
    for (i, k), value in zip(keys, values):
        out[i][k] = value
    return out


class StepTimer:
    """Forward and forward+backward time of one micro-batch: CUDA events on a GPU (no host sync), wall clock on
    CPU (where every op is synchronous anyway)."""

    def __init__(self, device):
        import torch

        self.cuda = device.type == "cuda"
        self.marks = [torch.cuda.Event(enable_timing=True) if self.cuda else time.perf_counter()]
        if self.cuda:
            self.marks[0].record()

    def mark(self) -> None:
        import torch

        if self.cuda:
            self.marks.append(torch.cuda.Event(enable_timing=True))
            self.marks[-1].record()
        else:
            self.marks.append(time.perf_counter())

    def seconds(self) -> list[float]:
        """Seconds from the start to each mark (waits for the last one)."""
        start, *marks = self.marks
        if self.cuda:
            marks[-1].synchronize()
            return [start.elapsed_time(m) / 1e3 for m in marks]
        return [m - start for m in marks]


def step_summary(plans, samples, micro, info, step_s, optimizer_s, sync_metrics, model_config, peak) -> dict:
    """Per-step metrics with the spec's names (batch/*, sample/*, perf/*), summed over ranks where they are counts;
    loss and sampling metrics over every rank's micro-batches (mean, or the extreme for max/min names)."""
    import numpy as np

    from grpo.distributed import all_reduce_sum
    from grpo.flops import mfu, training_flops
    from grpo.metrics import MetricsWindow

    forwarded = all_reduce_sum(sum(m["_forwarded"] for m in micro), info)
    flops = training_flops(model_config, forwarded, all_reduce_sum(sum(m["_attended_keys"] for m in micro), info),
                           all_reduce_sum(sum(m["_head_tokens"] for m in micro), info))
    trained = sum(p.trained_tokens for p in plans)
    fwd_bwd_s = sum(m["perf/fwd_bwd_s"] for m in micro)
    out = {"batch/forwarded_tokens_per_step": forwarded, "batch/trained_tokens_per_step": trained,
           "batch/samples_per_step": len(samples), "batch/groups_per_step": len({s.group_id for s in samples}),
           "batch/microbatches_per_step": len(plans), "batch/masked_token_frac": 1 - trained / max(forwarded, 1),
           "batch/pad_frac": 0.0,
           "sample/forwarded_tokens_mean": float(np.mean([len(s) for s in samples])) if samples else math.nan,
           "sample/forwarded_tokens_max": max((len(s) for s in samples), default=math.nan),
           "sample/trained_tokens_mean": float(np.mean([s.num_trained for s in samples])) if samples else math.nan,
           "reward_kept": float(np.nanmean([s.reward for s in samples])) if samples else math.nan,
           "perf/step_s": step_s, "perf/fwd_bwd_s": fwd_bwd_s, "perf/fwd_s": sum(m["perf/fwd_s"] for m in micro),
           "perf/optimizer_s": optimizer_s,
           "perf/fwd_bwd_forwarded_tokens_per_s": forwarded / max(fwd_bwd_s, 1e-9),
           "perf/wall_clock_forwarded_tokens_per_s": forwarded / step_s,
           "perf/wall_clock_trained_tokens_per_s": trained / step_s} | sync_metrics
    for name, value in (("perf/fwd_bwd_mfu", fwd_bwd_s), ("perf/wall_clock_mfu", step_s)):
        m = mfu(flops, value, peak, info.world_size)
        if m is not None:
            out[name] = m
    for p in plans:
        out |= {k: v for k, v in p.stats.items() if not k.endswith("_count")}
    out["batch/dropped_oversize_count"] = sum(p.stats.get("batch/dropped_oversize_count", 0) for p in plans)
    losses = [{k: v for k, v in m.items() if not k.startswith("_") and not k.startswith("perf/")} for m in micro]
    if info.world_size > 1:  # every rank's micro-batches, so loss/sampling metrics describe the whole step
        import torch.distributed as dist

        gathered = [None] * info.world_size
        dist.all_gather_object(gathered, losses)
        losses = [m for rank_losses in gathered for m in rank_losses]
    window = MetricsWindow()  # the one reduction rule (by name), NaNs dropped
    for m in losses:
        window.extend(m.items())
    return out | window.reduce()


def split_evaluations(items: list) -> tuple[list, list[dict[str, float]]]:
    """Worker items -> (the other items, one dict of eval/* metrics per evaluation, in the order they finished).
    An evaluation's items arrive together; a name seen again starts the next evaluation. `eval/skipped_count` is
    the trainer's counter, reduced with the window like any count."""
    rest, evals = [], []
    for name, value in items:
        if not name.startswith("eval/") or name == "eval/skipped_count":
            rest.append((name, value))
            continue
        if not evals or name in evals[-1]:
            evals.append({})
        evals[-1][name] = float(value)
    return rest, evals


def log_window(logger, step: int, window: list[dict], rollout_metrics: list) -> None:
    """One row of the window's reduced metrics at `step`: the trainer's step metrics and the rollout worker's
    (name, value) items drained for it. Evaluations are never averaged together: the newest one finished in the
    window goes into that row, any earlier one in a row of its own just before it (same step; each row names its
    `eval/model_version`)."""
    from grpo.metrics import ALWAYS_LOGGED_COUNTERS, MetricsWindow

    agg = MetricsWindow(always=ALWAYS_LOGGED_COUNTERS)
    for metrics in window:
        agg.extend(metrics.items())
    rest, evals = split_evaluations(rollout_metrics)
    agg.extend(rest)
    for earlier in evals[:-1]:
        logger.log(step, earlier)
    logger.log(step, agg.reduce() | (evals[-1] if evals else {}))
