"""PEFT/LoRA policies: wrap the model, choose how the adapter reaches vLLM, keep the served adapter versions on disk.

A LoRA policy reaches the server in one of two ways, chosen once at start (`choose_sync_mode`):

- **merged** (the fallback): `weight_sync.WeightSync` sends the full weights through the ordinary transfer with
  each LoRA delta added to its gathered base weight (`lora_terms`), so the server serves exactly the trained
  policy. About the model's full size per sync (15 GB for a 7B model in bf16).
- **adapter**: the server runs `--enable-lora` with `VLLM_ALLOW_RUNTIME_LORA_UPDATING=1`. Each version is written
  in PEFT format to `<output_dir>/.vllm_lora/<name>-v<N>/` and registered under the name `<name>-v<N>` through
  vLLM's runtime LoRA route (vLLM reads adapters from disk, so the server must see that directory). Rollouts ask
  for the adapter of the version they started under, so a rollout finishes under one policy. `max_staleness + 1`
  versions stay registered (older samples are dropped as stale anyway); the oldest is unloaded after the next one
  is loaded (hence `--max-loras >= max_staleness + 2`) and its directory removed one sync later. The adapter is
  about 1% of the model (160 MB at r=32 on a 7B model), but vLLM generates about 1.33-1.39x slower per token with
  an adapter than with merged weights: when generation is the bottleneck, merged sync is often the better choice.

`.vllm_lora/` is a serving cache: the trained adapter is kept by the checkpoints (`checkpoint-<step>/` holds
`adapter_model.safetensors` + `adapter_config.json`).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
from torch import nn

from grpo.vllm_server import LORA_RANKS

log = logging.getLogger(__name__)

SyncMode = Literal["merged", "adapter"]
_UNSERVABLE_TARGETS = ("lm_head", "embed_tokens")


class LoraServerError(ValueError):
    """The server cannot serve this adapter as it was started; the message says which flags to restart with."""


# ---- building the PEFT model ---------------------------------------------------------------------------------------
def peft_config_from_run(config):
    """The CLI's `lora_*` fields as a `peft.LoraConfig` (None when lora_r is 0: full fine-tuning)."""
    if config.lora_r <= 0:
        return None
    from peft import LoraConfig

    targets = config.lora_target_modules
    return LoraConfig(r=config.lora_r, lora_alpha=config.lora_alpha_value,
                      target_modules=targets[0] if targets == ("all-linear",) else list(targets), bias="none")


def wrap_policy(model: nn.Module, peft_config) -> nn.Module:
    """`get_peft_model`, refusing adapters on the LM head: the packed log-prob head reads `lm_head.weight` directly
    and never calls the module, so an adapter (or a trainable copy) there would silently not train. lora_dropout
    is forced to 0 like every other dropout (grpo/model.py: RL trains the policy the sampler ran)."""
    from peft import get_peft_model

    from grpo.model import disable_dropout, is_text_param, is_vlm_config

    targets, vlm = peft_config.target_modules, is_vlm_config(model.config)
    if targets == "all-linear" and vlm:
        targets = text_linear_targets(model)
        peft_config = dataclasses.replace(peft_config, target_modules=targets)
    named = [targets] if isinstance(targets, str) else list(targets or [])
    saved = list(getattr(peft_config, "modules_to_save", None) or [])
    if any(t == "lm_head" or t.endswith(".lm_head") for t in named + saved):
        raise ValueError("PEFT adapters on lm_head are not supported: drop lm_head from target_modules / "
                         "modules_to_save (`all-linear` already leaves it out)")
    peft_model = get_peft_model(model, peft_config)
    disable_dropout(peft_model)
    if any(is_lora_name(n) and ".lm_head." in f".{n}" for n, _ in peft_model.named_parameters()):
        raise ValueError(f"target_modules={targets!r} matched lm_head, which is not supported; name the "
                         "decoder's linear layers or use `all-linear`")
    outside = sorted({n.split(".lora_")[0] for n, _ in peft_model.named_parameters()
                      if vlm and is_lora_name(n) and not is_text_param(n)})
    if outside:
        raise ValueError(f"target_modules={targets!r} put adapters outside the language model ({outside[:4]}...): "
                         "this VLM checkpoint trains text-only and vLLM refuses such adapters; name text modules "
                         "or use `all-linear` (which keeps to the language model here)")
    trainable = sum(p.numel() for p in peft_model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in peft_model.parameters())
    log.info("PEFT %s: %d trainable parameters of %d (%.2f%%)", type(peft_config).__name__, trainable, total,
             100 * trainable / max(total, 1))
    return peft_model


def text_linear_targets(model: nn.Module) -> str:
    """`all-linear` for a VLM checkpoint, kept to the language model: a PEFT regex over the text decoder's linear
    layers. PEFT's own `all-linear` also adapts the vision tower and projector, which the text-only trainer never
    runs (their adapters would be dead weight in the optimizer) and vLLM's language-model-only server refuses."""
    suffixes = sorted({name.rsplit(".", 1)[-1] for name, module in model.named_modules()
                       if isinstance(module, nn.Linear) and "language_model." in name})
    return rf".*language_model\..*\.({'|'.join(suffixes)})"


def packed_forward_module(model: nn.Module) -> nn.Module:
    """The module the packed (tree) forward runs: a PEFT model's base model, which holds the injected LoRA layers
    (PEFT replaces the targeted linears in place) and has the transformers layout the tree forward walks."""
    return model.get_base_model() if is_peft_model(model) else model


@dataclass(frozen=True)
class LoraTerm:
    """One active adapter of one LoRA linear: merged weight = base + scale * B @ A (transposed for Conv1D layouts)."""

    lora_a: nn.Parameter  # [r, in]
    lora_b: nn.Parameter  # [out, r]
    scale: float
    fan_in_fan_out: bool

    def delta(self, materialize) -> torch.Tensor:
        """`materialize` turns a (possibly FSDP2-sharded) parameter into its full tensor: a collective."""
        a, b = materialize(self.lora_a), materialize(self.lora_b)
        delta = (b.float() @ a.float()) * self.scale  # [out, in]
        return delta.T if self.fan_in_fan_out else delta


def lora_terms(model: nn.Module) -> dict[str, list[LoraTerm]] | None:
    """`<module>.base_layer.weight` (as named in `model`) -> its active LoRA terms, for merging gathered tensors on
    the fly (exact on FSDP2 shards, and the trainer's weights are never touched). None when some adapter layer is
    not a plain LoRA linear (DoRA, embeddings, convolutions, other PEFT methods): PEFT's own merge is needed."""
    from peft.tuners.lora.layer import Linear as LoraLinear
    from peft.tuners.tuners_utils import BaseTunerLayer

    terms: dict[str, list[LoraTerm]] = {}
    for path, module in model.named_modules():
        if not isinstance(module, BaseTunerLayer):
            continue
        if type(module) is not LoraLinear or any(module.use_dora.get(a) for a in module.active_adapters):
            return None
        active = [a for a in module.active_adapters if a in module.lora_A]
        terms[f"{path}.base_layer.weight"] = [
            LoraTerm(module.lora_A[a].weight, module.lora_B[a].weight, float(module.scaling[a]),
                     bool(module.fan_in_fan_out)) for a in active]
    return terms


def is_lora_name(name: str) -> bool:
    return any(part.startswith("lora_") for part in name.split("."))


def is_peft_model(model: nn.Module) -> bool:
    return callable(getattr(model, "merge_adapter", None)) and hasattr(model, "peft_config")


def adapter_rank(model: nn.Module) -> int:
    """The largest rank the server must hold (`r`, or the biggest of a rank_pattern)."""
    cfg = model.peft_config[model.active_adapter]
    return max([int(cfg.r), *map(int, (getattr(cfg, "rank_pattern", None) or {}).values())])


def adapter_sync_problems(model: nn.Module) -> list[str]:
    """Why this PEFT model cannot be served as a vLLM runtime LoRA adapter (empty list: it can)."""
    if not is_peft_model(model):
        return ["the policy has no PEFT adapter"]
    problems = []
    if len(model.peft_config) != 1:
        problems.append(f"{len(model.peft_config)} adapters (vLLM serves one per request)")
    cfg = model.peft_config[model.active_adapter]
    if str(getattr(cfg, "peft_type", "")) not in ("LORA", "PeftType.LORA"):
        problems.append(f"peft_type {cfg.peft_type} (only LoRA)")
    if getattr(cfg, "use_dora", False):
        problems.append("DoRA")
    if getattr(cfg, "bias", "none") != "none":
        problems.append(f"bias={cfg.bias!r}")
    if getattr(cfg, "modules_to_save", None):
        problems.append(f"modules_to_save={cfg.modules_to_save}")
    if any(t in name for name, _ in model.named_parameters() if is_lora_name(name) for t in _UNSERVABLE_TARGETS):
        problems.append("an adapter on embed_tokens/lm_head")
    return problems


# ---- the server ----------------------------------------------------------------------------------------------------
def server_lora_facts(server_info: dict) -> dict:
    """What the sync-mode choice needs from `/server_info` (small and picklable, broadcast to every rank)."""
    vllm_config = server_info.get("vllm_config") or {}
    lora = vllm_config.get("lora_config") or None
    env = server_info.get("vllm_env") or {}
    return {"max_lora_rank": lora and lora.get("max_lora_rank"), "max_loras": lora and lora.get("max_loras"),
            "runtime_updating": str(env.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "")).lower() in ("1", "true"),
            "data_parallel_size": int((vllm_config.get("parallel_config") or {}).get("data_parallel_size", 1))}


def restart_flags(rank: int, max_staleness: int) -> str:
    needed_rank = next((r for r in LORA_RANKS if r >= rank), None)
    if needed_rank is None:
        raise LoraServerError(f"LoRA rank {rank} exceeds vLLM's largest --max-lora-rank 512: lower lora_r")
    return (f"VLLM_ALLOW_RUNTIME_LORA_UPDATING=1 vllm serve ... --enable-lora --max-lora-rank {needed_rank} "
            f"--max-loras {max_staleness + 2} (or `python rollout.py serve --server.lora-rank {rank} "
            f"--server.max-loras {max_staleness + 2}`)")


def check_lora_server(facts: dict, rank: int, max_staleness: int) -> None:
    """Raise `LoraServerError` naming the restart flags when an --enable-lora server cannot serve the adapter."""
    problems = []
    if not facts["runtime_updating"]:
        problems.append("VLLM_ALLOW_RUNTIME_LORA_UPDATING is not set, so /v1/load_lora_adapter is disabled")
    if facts["max_lora_rank"] < rank:
        problems.append(f"--max-lora-rank {facts['max_lora_rank']} < adapter rank {rank}")
    if facts["max_loras"] < max_staleness + 2:
        problems.append(f"--max-loras {facts['max_loras']} < max_staleness + 2 = {max_staleness + 2} "
                        f"({max_staleness + 1} versions stay registered and each sync loads one more before "
                        "unloading the oldest)")
    if facts["data_parallel_size"] > 1:
        problems.append(f"data_parallel_size {facts['data_parallel_size']} > 1 (a load reaches one replica only)")
    if problems:
        raise LoraServerError("the vLLM server cannot serve the LoRA adapter: " + "; ".join(problems)
                              + f".\n  Fix: restart it with {restart_flags(rank, max_staleness)}, or pass "
                              "--lora-sync merged to send merged weights instead")


def choose_sync_mode(requested: str, model: nn.Module, facts: dict, max_staleness: int) -> SyncMode | None:
    """None for a full model; `adapter` when asked or (auto) when the server runs --enable-lora; else `merged`."""
    if not is_peft_model(model):
        return None
    if requested == "merged" or (requested == "auto" and facts["max_lora_rank"] is None):
        return "merged"
    problems = adapter_sync_problems(model)
    if facts["max_lora_rank"] is None:
        problems.append("the server was started without --enable-lora")
    if problems:
        if requested == "adapter":
            raise LoraServerError(f"lora_sync='adapter' is impossible: {'; '.join(problems)}. Fix: "
                                  f"{restart_flags(adapter_rank(model), max_staleness)} or --lora-sync merged")
        log.warning("adapter sync impossible (%s): sending merged weights", "; ".join(problems))
        return "merged"
    check_lora_server(facts, adapter_rank(model), max_staleness)
    return "adapter"


# ---- the adapter versions --------------------------------------------------------------------------------------
def adapter_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """The adapter in PEFT's file format (`...q_proj.lora_A.weight`, no adapter name), full tensors on CPU.
    Collective under FSDP2: every rank must call it."""
    from peft import get_peft_model_state_dict
    from torch.distributed.tensor import DTensor

    with torch.no_grad():
        full = {name: (p.full_tensor() if isinstance(p, DTensor) else p.detach()).to("cpu").clone()
                for name, p in model.named_parameters() if is_lora_name(name)}
    return get_peft_model_state_dict(model, state_dict=full)


@dataclass
class AdapterVersions:
    """The served adapter versions: directories under `root`, names `<name>-v<N>`, `keep` of them registered."""

    root: Path
    name: str
    keep: int
    """Versions registered on the server at once: max_staleness + 1."""

    def __post_init__(self):
        self.root = Path(self.root)
        self.loaded: list[int] = []
        self._retired: list[int] = []

    def served_name(self, version: int) -> str:
        return f"{self.name}-v{version}"

    def path(self, version: int) -> Path:
        return (self.root / self.served_name(version)).resolve()

    def clear(self) -> None:
        """Remove this name's directories left by an earlier run (the server forgot them at its restart, or the
        trainer unloads them first: see `WeightSync`)."""
        for stale in self.root.glob(f"{self.name}-v*"):
            shutil.rmtree(stale, ignore_errors=True)

    def write(self, version: int, tensors: dict[str, torch.Tensor], peft_config) -> Path:
        """adapter_model.safetensors + adapter_config.json into `<name>-v<N>.tmp`, renamed when complete, so the
        server never reads a half-written adapter."""
        from safetensors.torch import save_file

        final = self.path(version)
        tmp = final.with_name(final.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        save_file({k: v.contiguous() for k, v in tensors.items()}, tmp / "adapter_model.safetensors",
                  metadata={"format": "pt"})
        peft_config.save_pretrained(str(tmp))
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        return final

    def loaded_version(self, version: int) -> list[int]:
        """Record `version` as registered; returns the versions to unload now (beyond the window). Directories of
        versions retired at the previous call are deleted here, one sync after their unload."""
        for old in self._retired:
            shutil.rmtree(self.path(old), ignore_errors=True)
        self.loaded.append(version)
        self._retired = self.loaded[:-self.keep] if len(self.loaded) > self.keep else []
        self.loaded = self.loaded[len(self._retired):]
        return list(self._retired)


def adapter_versions_for(config, mode: SyncMode | None) -> AdapterVersions | None:
    """The version store of an adapter-sync run (None otherwise): `<output_dir>/.vllm_lora/`, max_staleness + 1."""
    if mode != "adapter":
        return None
    return AdapterVersions(Path(config.output_dir) / ".vllm_lora", config.lora_name, config.max_staleness + 1)
