"""Load the policy and its tokenizer through the ordinary `from_pretrained` path.

Vision-language checkpoints (a `vision_config` in config.json, e.g. Qwen3.5) load with
AutoModelForImageTextToText and are trained text-only: everything outside the language model and the LM head
(vision tower, multimodal projector) gets requires_grad=False, so it has no gradients, no optimizer state and is
never sent to the server at a weight sync.
"""

from __future__ import annotations

import logging

import torch

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "auto": "auto"}


def is_vlm_config(config) -> bool:
    return getattr(config, "vision_config", None) is not None


def load_tokenizer(name: str, trust_remote_code: bool = False):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(name, trust_remote_code=trust_remote_code)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok


def load_policy(name: str, dtype: str = "float32", trust_remote_code: bool = False,
                gradient_checkpointing: bool = True, router_aux_loss_coef: float | None = None):
    """The trainable model, its text decoder frozen-or-not split applied, ready for tree-packed forwards."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    config = AutoConfig.from_pretrained(name, trust_remote_code=trust_remote_code)
    is_moe = _is_moe(config)
    if router_aux_loss_coef is not None:
        if not is_moe:
            raise ValueError(f"router_aux_loss_coef={router_aux_loss_coef} was set but {name} is not a "
                             "Mixture-of-Experts model; leave it unset")
    auto = AutoModelForImageTextToText if is_vlm_config(config) else AutoModelForCausalLM
    model = auto.from_pretrained(name, dtype=_DTYPES[dtype], trust_remote_code=trust_remote_code)
    if is_vlm_config(config):
        frozen = freeze_non_text(model)
        log.info("VLM checkpoint: trained text-only, %d parameters outside the text model frozen", frozen)
    if gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    return model


def _is_moe(config) -> bool:
    text = getattr(config, "text_config", None) or config
    return any(getattr(text, k, None) for k in ("num_experts", "num_local_experts", "n_routed_experts"))


def aux_loss_coef(model, override: float | None) -> float:
    """The MoE load-balancing coefficient in force (0.0 for dense models)."""
    if not _is_moe(model.config):
        return 0.0
    if override is not None:
        return float(override)
    text = getattr(model.config, "text_config", None) or model.config
    return float(getattr(text, "router_aux_loss_coef", 0.0) or 0.0)


def freeze_non_text(model) -> int:
    """requires_grad=False for every parameter outside the language model and the LM head; returns the count."""
    n = 0
    for name, p in model.named_parameters():
        if not _is_text_param(name):
            p.requires_grad_(False)
            n += p.numel()
    return n


def _is_text_param(name: str) -> bool:
    return "language_model" in name or name.startswith("lm_head")


def decoder(model):
    """The text decoder (the module with embed_tokens and layers)."""
    for m in model.modules():
        if hasattr(m, "embed_tokens") and hasattr(m, "layers"):
            return m
    raise ValueError(f"no text decoder found in {type(model).__name__}")


def trainable_parameters(model) -> list[torch.nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]
