"""One process with bf16 compute and no FSDP2 (the default; `--one-process-fsdp` shards through FSDP2 instead):
bf16 copies of the weights for the forward and backward, fp32 masters for the optimizer, checkpoints and syncs.

On one GPU FSDP2 shards over a group of one: its mixed-precision policy still casts every layer's fp32 weights
to bf16 before each forward (copy-in, a one-rank all-gather, copy-out) and runs a one-rank reduce-scatter per
layer after the backward, with hooks per layer. `MasterWeights` keeps the same numerics without that machinery:

- every parameter keeps its fp32 tensor (the master) and gets a bf16 copy (the compute weight), FSDP2's
  `param_dtype`; a forward pre-hook on the policy puts the compute weights in (`param.data`) until the step ends;
- after each backward, `accumulate` adds the bf16 gradients autograd left on the parameters into fp32 buffers
  (one multi-tensor copy for a step's first micro-batch, one multi-tensor add after) and drops them: FSDP2's
  `reduce_dtype=float32` accumulation over micro-batches. grpo/step.py calls it after each micro-batch's
  backward; `to_master` calls it too. (A per-parameter post-accumulate-grad hook did this before: 310 Python
  calls and copy launches on autograd's thread per Qwen3 backward, each a wait for the GPU on a small model);
- `to_master` (grpo/step.py `optimizer_step`, before clipping) puts the masters back with the fp32 sums as their
  `.grad`; the optimizer steps the masters; the next forward refreshes the trainable compute copies in one
  multi-tensor copy. Frozen parameters (a LoRA base) are cast once.

Between steps the parameters hold the masters, so `state_dict`, the weight sync and checkpoints see fp32 exactly
as with FSDP2 (a `state_dict` also swaps the masters in first). Memory: 2 bytes per parameter more than FSDP2 on
one rank, whose bf16 copy lives only during the step, and the bf16 gradients of one backward (2 bytes per
parameter) until `accumulate` folds them in.
"""

from __future__ import annotations

import torch


class MasterWeights:
    """bf16 compute copies beside fp32 master parameters for one module (see the module docstring)."""

    def __init__(self, module: torch.nn.Module, dtype: torch.dtype = torch.bfloat16):
        self.params = list(module.parameters())  # tied weights appear once
        self.masters = [p.data for p in self.params]
        self.computes = [m.to(dtype) for m in self.masters]
        self.trainable = [i for i, p in enumerate(self.params) if p.requires_grad]
        self.grads: list[torch.Tensor | None] = [None] * len(self.params)
        self.in_compute = False
        self.stale = False
        module.register_forward_pre_hook(lambda _module, _args: self.to_compute())
        for sub in module.modules():  # whichever module a checkpoint saves or loads, it sees the masters
            sub.register_state_dict_pre_hook(lambda *_: self.use_masters())
            sub.register_load_state_dict_pre_hook(lambda *_: self.use_masters())

    def to_compute(self) -> None:
        """The compute weights into the parameters (a no-op while they are in), refreshed after a step."""
        if self.in_compute:
            return
        if self.stale:
            torch._foreach_copy_([self.computes[i] for i in self.trainable],
                                 [self.masters[i] for i in self.trainable])
            self.stale = False
        for param, compute in zip(self.params, self.computes):
            param.data = compute
        self.in_compute = True

    def use_masters(self) -> None:
        """The fp32 masters into the parameters; gradients stay in their buffers."""
        if not self.in_compute:
            return
        for param, master in zip(self.params, self.masters):
            param.data = master
        self.in_compute = False

    def to_master(self) -> None:
        """Before the optimizer: masters in, each with its accumulated fp32 gradient (None if it got none) as
        `.grad`; the compute copies are refreshed at the next forward."""
        self.accumulate()
        self.use_masters()
        for i in self.trainable:
            self.params[i].grad, self.grads[i] = self.grads[i], None
        self.stale = True

    def accumulate(self) -> None:
        """The bf16 gradients of the last backward added into the fp32 buffers (copied into new ones for the
        first micro-batch of a step) and dropped from the parameters; a no-op when none waits."""
        fresh, fresh_from, summed, summed_from = [], [], [], []
        for i in self.trainable:
            param = self.params[i]
            grad = param.grad
            if grad is None or grad.dtype != self.computes[i].dtype:  # none, or a master's (to_master's) gradient
                continue
            param.grad = None
            if self.grads[i] is None:
                self.grads[i] = torch.empty_like(grad, dtype=torch.float32)
                fresh.append(self.grads[i])
                fresh_from.append(grad)
            else:
                summed.append(self.grads[i])
                summed_from.append(grad)
        if fresh:
            torch._foreach_copy_(fresh, fresh_from)
        if summed:
            torch._foreach_add_(summed, summed_from)

    def reset(self) -> None:
        """After a forward + backward that must leave no trace (the memory probe): gradients dropped, masters in."""
        for param in self.params:
            param.grad = None
        self.grads = [None] * len(self.params)
        self.use_masters()


def attach(module: torch.nn.Module, dtype: torch.dtype = torch.bfloat16) -> torch.nn.Module:
    """`module` with a `MasterWeights` as its `master_weights` attribute (grpo/step.py and grpo/policy.py look
    for it)."""
    module.master_weights = MasterWeights(module, dtype)
    return module


def of(policy) -> MasterWeights | None:
    """The `MasterWeights` of `policy` (or of the module it wraps), None without one (FSDP2, plain fp32)."""
    return getattr(getattr(policy, "module", policy), "master_weights", None)
