"""Gradient checkpointing policy: `--gradient-checkpointing {auto,true,false}`.

Recomputing activations costs ~a third of a forward per checkpointed layer (21 % of the step measured on
Qwen3-1.7B), so it should be on only where memory needs it. `auto` measures instead of guessing: before the first
step every rank runs one synthetic worst-case micro-batch (a `token_budget`-token row, three quarters of it
trained) forward and backward with checkpointing off, reads the allocator's peak, adds the AdamW state the first
optimizer step will allocate, and compares that with the memory this process may use (what was free when it
started the probe, so a vLLM server sharing the GPU is accounted for). It fits: off. It does not: a second probe
with every layer checkpointed gives the per-layer saving, and just enough layers are checkpointed to fit
(selective), all of them when even that is not enough. CPU runs: `auto` = off. The decision is logged.
"""

from __future__ import annotations

import logging
import math

import torch

log = logging.getLogger(__name__)

HEADROOM = 0.90
"""Fraction of the usable memory the estimated peak may reach (allocator fragmentation, NCCL buffers)."""


def checkpointing_fraction(mode, policy, model, info, token_budget: int, run_probe) -> float:
    """Fraction of decoder layers to checkpoint for `mode` ("auto" / "true" / "false", or a bool).

    `run_probe()` runs one worst-case micro-batch forward + backward and drops its gradients."""
    mode = {True: "true", False: "false"}.get(mode, mode)
    if mode in ("true", "false"):
        return 1.0 if mode == "true" else 0.0
    if mode != "auto":
        raise ValueError(f"gradient_checkpointing must be auto, true or false, got {mode!r}")
    if info.device.type != "cuda":
        return 0.0
    from grpo.model import set_gradient_checkpointing

    usable = _usable_bytes(info.device)
    optimizer_state = 8 * sum(p.numel() for p in model.parameters() if p.requires_grad) / info.world_size
    set_gradient_checkpointing(model, 0.0)
    peak_off = _probe_peak(run_probe, info)
    estimate_off = peak_off + optimizer_state
    if estimate_off <= HEADROOM * usable:
        log.info("gradient checkpointing auto: off (estimated peak %.1f GiB of %.1f GiB usable)",
                 estimate_off / 2**30, usable / 2**30)
        return 0.0
    set_gradient_checkpointing(model, 1.0)
    peak_all = _probe_peak(run_probe, info)
    layers = _num_layers(model)
    saving = (peak_off - peak_all) / layers if math.isfinite(peak_off) else math.inf
    excess = estimate_off - HEADROOM * usable
    needed = layers if not math.isfinite(excess) or saving <= 0 else min(layers, math.ceil(excess / saving))
    log.info("gradient checkpointing auto: %d of %d layers (peak without: %s GiB, with all: %.1f GiB, usable "
             "%.1f GiB)", needed, layers, "OOM" if not math.isfinite(peak_off) else f"{peak_off / 2**30:.1f}",
             peak_all / 2**30, usable / 2**30)
    return needed / layers


KEPT_LOGITS_SHARE = 16
"""The log-prob head may keep its forward logits for the backward in up to 1/16 of the device's memory: 8.9 GB on
an H200 (a whole 16k-token row of a 248k vocabulary in bf16, one block: grpo/kernels/logprobs.py), 5 GB on an 80 GB card.
The probe above counts them like any activation."""


def kept_logits_bytes(device: torch.device) -> int:
    """Bytes of head logits the backward may keep on `device`; 0 off CUDA (the CPU recomputes them)."""
    if device.type != "cuda":
        return 0
    return torch.cuda.get_device_properties(device).total_memory // KEPT_LOGITS_SHARE


def _usable_bytes(device: torch.device) -> float:
    free, _total = torch.cuda.mem_get_info(device)
    return free + torch.cuda.memory_reserved(device)


def _num_layers(model) -> int:
    from grpo.distributed import decoder_layers

    return len(decoder_layers(model))


def _probe_peak(run_probe, info) -> float:
    """Allocator peak (bytes, max over ranks) of one probe micro-batch; inf when it runs out of memory."""
    torch.cuda.synchronize(info.device)
    torch.cuda.reset_peak_memory_stats(info.device)
    try:
        run_probe()
        peak = float(torch.cuda.max_memory_allocated(info.device))
    except torch.cuda.OutOfMemoryError:
        peak = math.inf
    torch.cuda.empty_cache()
    if info.world_size > 1:
        import torch.distributed as dist

        t = torch.tensor([peak], dtype=torch.float64, device=info.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        peak = float(t.item())
    return peak


def probe_samples(token_budget: int, vocab_size: int, seed: int = 0) -> list:
    """The probe's micro-batch: one `token_budget`-token sample, its last three quarters trained, group -1 (a
    sample no accounting ever sees)."""
    from grpo.samples import TrainingSample

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(10, max(11, vocab_size), (token_budget,), generator=g).tolist()
    prompt = token_budget // 4
    mask = [0] * prompt + [1] * (token_budget - prompt)
    return [TrainingSample(ids, mask, [-1.0] * token_budget, 1.0, -1, 0)]
