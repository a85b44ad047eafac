"""The trainer's micro-batch queues its device work without reading the device: packing, forward (tree attention
through `flash_split`'s FlashAttention ops, the Gated DeltaNet tree scan, MoE routing), every registered loss, the
backward and the master weights' gradient accumulation run with the model on PyTorch's meta device, where any
read of device data raises (`.item()`, `.tolist()`, `bool(t)`, `nonzero`, boolean indexing, `repeat_interleave`
without an output size, a copy back to the host). On a GPU each of those is a wait for the GPU's queue to drain;
`optimizer_step` runs on fake CUDA tensors and reads the device first at its end. `tests/test_gpu_step.py` checks the
whole step on CUDA with the compiled layers; these run everywhere."""

from __future__ import annotations

import contextlib
import traceback

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from grpo.losses import registered_losses


class CrossDeviceCopies(TorchDispatchMode):
    """Records each op whose tensors live on more than one device (a host-to-device copy from pageable memory makes
    CUDA synchronise), except those of `grpo/trie.py`'s `PackedRow.to` and `to_device` (on CUDA one pinned,
    non-blocking copy; field by field here, as on any device but CUDA) and `grpo/step_metrics.py`'s
    `to_host_async` (a non-blocking copy into pinned memory, read after an event)."""

    def __init__(self):
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        devices = {t.device.type for t in [*args, *kwargs.values()] if isinstance(t, torch.Tensor)}
        if kwargs.get("device") is not None:
            devices.add(torch.device(kwargs["device"]).type)
        if len(devices) > 1:
            stack = traceback.extract_stack()[:-1]
            if not any(f.name in ("to", "to_device") and f.filename.endswith("trie.py")
                       or f.name == "to_host_async" and f.filename.endswith("step_metrics.py") for f in stack):
                self.seen.append(f"{func} at " + " <- ".join(f"{f.name}:{f.lineno}" for f in reversed(stack[-6:])))
        return func(*args, **kwargs)


def _on_meta_as_cuda(monkeypatch):
    """The CUDA code paths on meta tensors: `is_cuda` true for them, torch's FlashAttention ops declared available
    (their meta kernels give the shapes), autocast a no-op on meta (it has no autocast dtype)."""
    import grpo.tree_attention as tree_attention

    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda t: t.device.type in ("cuda", "meta")))
    monkeypatch.setattr(tree_attention, "_split_available", lambda device: True)
    autocast = torch.autocast
    monkeypatch.setattr(torch, "autocast", lambda device_type, *a, **kw: contextlib.nullcontext()
                        if device_type == "meta" else autocast(device_type, *a, **kw))


# every architecture with the default loss, and every loss (its sampler inputs: top-k ids and log-probs or none) on
# Qwen3; tests/loss_checks.py runs each loss alone on meta tensors too
CASES = ([(kind, "score_centering") for kind in ("qwen3", "qwen3_5", "qwen3_moe")]
         + [("qwen3", loss) for loss in registered_losses() if loss != "score_centering"])


@pytest.mark.parametrize("kind, loss", CASES)
def test_a_micro_batch_reads_nothing_from_the_device(tiny_models, monkeypatch, kind, loss):
    from bench_groups import synthetic_groups

    from grpo import master_weights
    from grpo.config import AsyncGRPOConfig
    from grpo.kernels.gdn import patch_gdn_layers
    from grpo.lora import packed_forward_module
    from grpo.losses import get_loss, loss_function
    from grpo.model import load_policy
    from grpo.policy import PackedPolicy
    from grpo.step import train_micro_batch
    from grpo.step_plan import StepPlan

    _on_meta_as_cuda(monkeypatch)
    config = AsyncGRPOConfig(model=str(tiny_models[kind]), loss=get_loss(loss)[1])
    model = load_policy(config.model, "float32", False, False, None)
    model = model._apply(lambda t: torch.empty(t.shape, dtype=t.dtype, device="meta"))
    patch_gdn_layers(model, "auto")
    policy = master_weights.attach(PackedPolicy(packed_forward_module(model), "flash_split", 1.0))
    stream = synthetic_groups(model.config.get_text_config().vocab_size, True, config.num_sampler_logprobs,
                              group_size=4, prompt_len=60, completion_len=20)
    batches = [[next(stream) for _ in range(4)] for _ in range(2)]  # a group of 4 rollouts each
    plan = StepPlan(batches, sum(s.num_trained for b in batches for s in b))
    copies = CrossDeviceCopies()
    with copies:
        for samples in batches:  # two micro-batches: the fp32 gradient buffers are made, then added to
            metrics = train_micro_batch(policy, samples, plan, loss_function(config.loss), config.loss, 1, 2,
                                        contextlib.nullcontext, config.max_completion_length)
        policy.master_weights.to_master()
    assert copies.seen == []
    assert metrics["loss"].device.type == "meta"
    grads = [p.grad for p in policy.parameters() if p.requires_grad]
    assert grads and all(g is not None and g.dtype == torch.float32 for g in grads)


def test_optimizer_step_is_queued_without_a_device_read(monkeypatch):
    """`queue_optimizer_step` on fake CUDA tensors (FakeTensorMode: no GPU needed; a read of device data raises
    there): clipping, the non-finite verdict and the fused AdamW step queue without a device read or a copy between
    devices (the verdict's host copy is queued, not waited for), so train.py's loop can plan the next step while
    this one runs; the first read is of that copy, in `finish_optimizer_step`."""
    import inspect

    from torch._subclasses.fake_tensor import DataDependentOutputException, FakeTensorMode

    import grpo.step as step
    from grpo.step_metrics import StepTimer

    monkeypatch.setattr(step, "StepTimer", lambda device: StepTimer(torch.device("cpu")))  # no CUDA events here
    source, start = inspect.getsourcelines(step.finish_optimizer_step)
    end_read = start + next(i for i, line in enumerate(source) if "queued.on_host.tolist()" in line)
    with FakeTensorMode(allow_non_fake_inputs=True):
        policy = torch.nn.ParameterList([torch.nn.Parameter(torch.zeros(8, 8, device="cuda")),
                                         torch.nn.Parameter(torch.zeros(8, device="cuda"))])
        for p in policy.parameters():
            p.grad = torch.randn_like(p)
        optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-3, fused=True)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
        copies = CrossDeviceCopies()
        with copies:
            queued = step.queue_optimizer_step(policy, optimizer, 1.0, [torch.ones((), device="cuda")])
        with copies, pytest.raises(DataDependentOutputException) as read:
            step.finish_optimizer_step(queued, scheduler)
    frames = [(f.filename, f.lineno) for f in traceback.extract_tb(read.tb)]
    assert (step.__file__, end_read) in frames, frames
    assert copies.seen == []
