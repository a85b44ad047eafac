"""What a model does to its logits and attention scores beyond h·Wᵀ and softmax(q·kᵀ scale), read from its config.

The trainer computes log-probs from the final hidden states and the LM head weight itself
(grpo/kernels/logprobs.py), and attention through its own tree function (grpo/tree_attention.py), so anything the
model's `forward` does on top must be done there too, or the model refused (docs/design.md §7.3). Known
transforms, in transformers' order:

- logit multiplier: Granite family and MiniCPM3 divide by `logits_scaling`; HyperCLOVAX MULTIPLIES by a field of
  the same name; Cohere multiplies by `logit_scale`, Falcon-H1 by `lm_head_multiplier`, MuseGlimmer by
  `output_multiplier`. A model type not in `_MULTIPLIERS` with one of those fields set off 1 is refused (the
  direction is not knowable from the name);
- final-logit soft cap (`final_logit_softcapping`: Gemma 2/3/3n/4, VaultGemma, NanoChat), after the multiplier;
- attention-logit soft cap (`attn_logit_softcapping`, Gemma 2): done by the tree backends that can
  (grpo/tree_attention.py `CAP_BACKENDS`), refused by the others;
- a bias on the LM head: refused.

What no config field reveals (remote code, a future model) is caught by the start-up probe (grpo/model_check.py).
"""

from __future__ import annotations

from grpo.kernels.logprobs import HeadTransform


class UnsupportedModelError(ValueError):
    """The model transforms its logits or attention scores in a way the trainer does not reproduce."""


# model_type -> (config field, whether the logits are divided by it)
_MULTIPLIERS = {
    **{t: ("logits_scaling", True) for t in ("granite", "granitemoe", "granitemoeshared", "granitemoehybrid",
                                             "granite_swa", "granitemoe_swa", "granite4_vision", "minicpm3")},
    **{t: ("logits_scaling", False) for t in ("hyperclovax", "hyperclovax_vision_v2")},
    **{t: ("logit_scale", False) for t in ("cohere", "cohere2", "cohere2_moe")},
    "falcon_h1": ("lm_head_multiplier", False),
    "muse_glimmer": ("output_multiplier", False),
}
_MULTIPLIER_FIELDS = ("logits_scaling", "logit_scale", "lm_head_multiplier", "output_multiplier")


def _configs(model) -> list:
    """The text config first (where VLMs keep the language model's fields), then the top-level config."""
    config = model.config
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return [text] if text is config else [text, config]


def _field(model, name: str):
    for cfg in _configs(model):
        value = getattr(cfg, name, None)
        if value is not None:
            return value
    return None


def _types(model) -> set[str]:
    return {getattr(cfg, "model_type", "") for cfg in _configs(model)}


def head_transform(model) -> HeadTransform:
    """The model's own logit transform; raises UnsupportedModelError for one the trainer cannot reproduce."""
    name = type(model).__name__
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if getattr(head, "bias", None) is not None:
        raise UnsupportedModelError(f"{name}'s LM head has a bias, which the trainer's log-prob head "
                                    "(grpo/kernels/logprobs.py) does not add; train a model without an LM-head bias")
    multiplier = 1.0
    known = [_MULTIPLIERS[t] for t in _types(model) if t in _MULTIPLIERS]
    if known:
        field, divides = known[0]
        value = float(_field(model, field) if _field(model, field) is not None else 1.0)
        multiplier = 1.0 / value if divides else value
    else:
        for field in _MULTIPLIER_FIELDS:
            value = _field(model, field)
            if isinstance(value, (int, float)) and float(value) != 1.0:
                raise UnsupportedModelError(
                    f"{name} sets {field}={value}, a logit transform grpo does not know the direction of for "
                    f"model type {sorted(_types(model))}; add the type to _MULTIPLIERS in grpo/logit_transforms.py "
                    "once you have read its modelling code")
    softcap = _field(model, "final_logit_softcapping")
    return HeadTransform(multiplier, float(softcap) if softcap else None)


def attention_softcap(model) -> float | None:
    """The attention-logit soft cap the model's attention layers apply (None: none)."""
    cap = _field(model, "attn_logit_softcapping")
    return float(cap) if cap else None
