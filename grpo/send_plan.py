"""What a weight sync sends: the trainer's parameters under their Hugging Face checkpoint names, in groups.

Names are HF checkpoint names, what vLLM's `load_weights` expects: wrapper prefixes are stripped and transformers'
in-memory conversions (e.g. fused MoE experts `mlp.experts.gate_up_proj`) are reverted with the same
`revert_weight_conversion` that `save_pretrained` uses. Frozen parameters (a VLM's vision tower) are not sent; the
server keeps them as loaded. Floating tensors are cast to the server dtype before sending (fp32 -> bf16 halves the
bytes), and the manifest declares that dtype. A PEFT policy is sent merged: each LoRA delta (scale x B @ A) is added
to its gathered base weight as it is sent. How the tensors travel is the transports' business
(grpo/sync_transport.py).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch import nn

_WRAPPER_PARTS = {"_checkpoint_wrapped_module", "_orig_mod", "_fsdp_wrapped_module", "base_layer"}
_LEADING_WRAPPERS = ("module.", "base_model.model.")


# ---- names ------------------------------------------------------------------------------------------------------
def checkpoint_name(name: str) -> str:
    """`module._orig_mod.model.layers.0._checkpoint_wrapped_module.mlp.up_proj.base_layer.weight` ->
    `model.layers.0.mlp.up_proj.weight` (DDP, torch.compile, activation checkpointing, FSDP1, PEFT wrappers)."""
    changed = True
    while changed:
        changed = False
        for prefix in _LEADING_WRAPPERS:
            if name.startswith(prefix):
                name, changed = name[len(prefix):], True
    return ".".join(part for part in name.split(".") if part not in _WRAPPER_PARTS)


def is_adapter_param(name: str) -> bool:
    """PEFT adapter tensors (`lora_A`, `lora_B`, `lora_embedding_*`, `lora_magnitude_vector`): merged, never sent."""
    return any(part.startswith("lora_") for part in name.split("."))


def _hf_model(model: nn.Module) -> nn.Module | None:
    """The transformers model inside any wrapper: its `_weight_conversions` say how to revert to checkpoint form."""
    from transformers import PreTrainedModel

    return next((m for m in model.modules() if isinstance(m, PreTrainedModel)), None)


def _group_key(name: str) -> str:
    """Parameters converted together live under one numbered module (`model.layers.3.`); the rest by parent."""
    match = re.match(r"^(.*?\.\d+)\.", name)
    return match.group(1) if match else name.rsplit(".", 1)[0]


@dataclass
class _Group:
    params: list[tuple[str, nn.Parameter]]
    """(in-memory checkpoint-style name, parameter), in model order."""
    names: list[str] = field(default_factory=list)
    shapes: list[list[int]] = field(default_factory=list)
    dtypes: list[torch.dtype] = field(default_factory=list)
    """What this group becomes after reverting transformers' conversions (checkpoint names, in send order)."""
    lora: dict = field(default_factory=dict)
    """in-memory checkpoint-style name -> LoRA terms merged into it when sent (grpo.lora.LoraTerm)."""
    identity: bool = False
    """Reverting transformers' conversions leaves this group as it is (same names, same tensors): skipped at sync."""


def _revert(hf_model: nn.Module | None, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    if hf_model is None:
        return tensors
    from transformers.core_model_loading import revert_weight_conversion

    return revert_weight_conversion(hf_model, tensors)


@dataclass
class SendPlan:
    """What every rank iterates (groups, for the gathers) and what rank 0 declares (the manifest)."""

    groups: list[_Group]
    hf_model: nn.Module | None
    send_dtype: torch.dtype | None
    has_dtensors: bool
    peft_merge: bool = False
    """The adapter is not plain LoRA: merge it into the model with PEFT around the transfer (one process only)."""

    @property
    def manifest(self) -> dict:
        names, dtypes, shapes = [], [], []
        for group in self.groups:
            names += group.names
            shapes += group.shapes
            dtypes += [str(self._wire_dtype(d)).removeprefix("torch.") for d in group.dtypes]
        return {"names": names, "dtype_names": dtypes, "shapes": shapes}

    def _wire_dtype(self, dtype: torch.dtype) -> torch.dtype:
        return self.send_dtype if self.send_dtype is not None and dtype.is_floating_point else dtype

    def iter_tensors(self, device: torch.device | None = None, cast: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
        """(checkpoint name, full tensor in the wire dtype) in manifest order. Every rank must run it to the end:
        materialising a DTensor is a collective. `cast=False` yields each tensor in its own dtype, for a consumer
        that casts while copying (one kernel instead of two, `ipc_transfer`'s bucket fill)."""
        with torch.no_grad():
            for group in self.groups:
                full = {name: _materialize(param) for name, param in group.params}
                for name, terms in group.lora.items():
                    full[name] = full[name] + sum(t.delta(_materialize) for t in terms).to(full[name].dtype)
                reverted = full if group.identity else _revert(self.hf_model, full)
                for name, dtype in zip(group.names, group.dtypes):
                    tensor = reverted[name].to(dtype=self._wire_dtype(dtype)) if cast else reverted[name]
                    yield name, (tensor if device is None else tensor.to(device))


def _materialize(param: torch.Tensor) -> torch.Tensor:
    """The full tensor. A DTensor on a one-process mesh already holds it whole: its local tensor, no collective
    (a `full_tensor` per parameter costs ~70 us of dispatch, 20 ms a sync on a 300-tensor model)."""
    from torch.distributed.tensor import DTensor

    if not isinstance(param, DTensor):
        return param.detach()
    if param.device_mesh.size() == 1:
        local = param.to_local()
        if local.shape == param.shape:
            return local.detach()
    return param.full_tensor()


def build_plan(model: nn.Module, send_dtype: torch.dtype | None = None) -> SendPlan:
    """Group the parameters to send and work out their checkpoint names and shapes from meta tensors (no gather:
    a DTensor's shape is global). Frozen parameters are skipped unless the model carries PEFT adapters, whose
    frozen base weights are exactly what a merged sync sends."""
    from torch.distributed.tensor import DTensor

    hf_model = _hf_model(model)
    named = list((hf_model or model).named_parameters())
    peft = any(is_adapter_param(name) for name, _ in named)
    terms = {}
    if peft:
        from grpo.lora import lora_terms

        terms = lora_terms(hf_model or model)
    groups: dict[str, _Group] = {}
    for raw_name, param in named:
        if is_adapter_param(raw_name) or not (param.requires_grad or peft):
            continue
        name = checkpoint_name(raw_name)
        group = groups.setdefault(_group_key(name), _Group(params=[]))
        group.params.append((name, param))
        if terms and raw_name in terms:
            group.lora[name] = terms[raw_name]
    if not groups:
        raise ValueError("no parameter to send: every parameter is frozen (requires_grad=False)")

    def meta(group_params):
        return {n: torch.empty(p.shape, dtype=p.dtype, device="meta") for n, p in group_params}

    for group in groups.values():
        before = meta(group.params)
        reverted = _revert(hf_model, before)
        group.identity = list(reverted) == list(before) and all(reverted[n] is t for n, t in before.items())
        group.names = list(reverted)
        group.shapes = [list(t.shape) for t in reverted.values()]
        group.dtypes = [t.dtype for t in reverted.values()]
    everything = _revert(hf_model, meta([p for g in groups.values() for p in g.params]))
    per_group = {n: s for g in groups.values() for n, s in zip(g.names, g.shapes)}
    if per_group != {n: list(t.shape) for n, t in everything.items()}:
        # A conversion spans groups: revert the whole model at once (more memory, still correct).
        merged = _Group(params=[p for g in groups.values() for p in g.params], names=list(everything),
                        shapes=[list(t.shape) for t in everything.values()],
                        dtypes=[t.dtype for t in everything.values()],
                        lora={n: t for g in groups.values() for n, t in g.lora.items()})
        groups = {"": merged}
    has_dtensors = any(isinstance(p, DTensor) for g in groups.values() for _, p in g.params)
    if terms is None and has_dtensors:
        raise ValueError("merged sync of a sharded PEFT model supports plain LoRA linears only (no DoRA, embedding or "
                         "convolution adapters, no other PEFT methods): change the peft_config")
    return SendPlan(list(groups.values()), hf_model, send_dtype, has_dtensors, peft_merge=terms is None)
