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
                gradient_checkpointing: bool = False, router_aux_loss_coef: float | None = None):
    """The trainable model, its text decoder frozen-or-not split applied, ready for tree-packed forwards.

    Train/eval semantics: the model is put in train mode (so gradient checkpointing and any training-only code
    path are live) with every dropout probability forced to 0. RL on sampled data trains the policy the sampler
    ran: dropout would make the trainer's log-probs a different, noisier policy than vLLM's (which never drops),
    and the importance ratios would carry that noise.
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    cache_triton_autotuning()
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
    disable_dropout(model)
    model.train()
    set_gradient_checkpointing(model, 1.0 if gradient_checkpointing else 0.0)
    model.config.use_cache = False
    return model


def cache_triton_autotuning() -> bool:
    """Keep Triton autotune results on disk (`TRITON_CACHE_AUTOTUNING=1`, unless the environment says otherwise),
    read by every autotuner built after this: flash-linear-attention's kernels (Qwen3.5's GDN layers) otherwise
    benchmark their candidate configurations again in every new process (~3 min on a fresh H200, 2026-12-03).
    Returns whether caching is on."""
    import os

    os.environ.setdefault("TRITON_CACHE_AUTOTUNING", "1")
    return os.environ["TRITON_CACHE_AUTOTUNING"].lower() in ("1", "true", "yes", "on")


def disable_dropout(model) -> int:
    """p = 0 on every dropout module and attention-dropout config field; returns how many were non-zero."""
    changed = 0
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout) and module.p:
            module.p, changed = 0.0, changed + 1
        if hasattr(module, "attention_dropout") and isinstance(module.attention_dropout, float):
            changed += module.attention_dropout > 0
            module.attention_dropout = 0.0
    for cfg in (model.config, getattr(model.config, "text_config", None)):
        for key in ("attention_dropout", "hidden_dropout", "dropout"):
            if cfg is not None and getattr(cfg, key, None):
                setattr(cfg, key, 0.0)
    if changed:
        log.info("dropout disabled in %d modules (RL trains the policy the sampler ran)", changed)
    return changed


def set_gradient_checkpointing(model, fraction: float) -> int:
    """Checkpoint the first round(fraction x L) decoder layers (0 = off, 1 = all: selective in between);
    returns how many layers recompute their activations in the backward pass.

    transformers checkpoints a layer only when the layer's `gradient_checkpointing` flag is set AND the model
    is in train mode, so the flag is set per layer after enabling it model-wide."""
    from grpo.distributed import decoder_layers

    layers = decoder_layers(model)
    count = max(0, min(len(layers), round(fraction * len(layers))))
    if count:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_disable()
    for i, layer in enumerate(layers):
        if hasattr(layer, "gradient_checkpointing"):
            layer.gradient_checkpointing = i < count
    return count


def compile_layer_regions(model, scope: str = "regions") -> int:
    """torch.compile the elementwise-heavy regions of every decoder layer: the dense MLP (SiLU x mul fused with
    its casts), the RMSNorms (one kernel instead of ~8 fp32 passes; Gated DeltaNet's gated norm too) and the rotary
    embedding; Gated DeltaNet's tree causal conv with its SiLU (`grpo.kernels.gdn.compile_tree_conv`: ~3 fp32 passes over
    [N, C] per tap eager). Attention (tree layouts), the GDN recurrence and MoE routing stay eager. dynamic=True:
    packed rows change length every micro-batch, static shapes would recompile each time. With Gated DeltaNet
    layers, the torch GDN kernel's
    state-free regions are compiled too (`grpo.kernels.gdn.compile_chunk_regions`; measured on one H200, Qwen3.5-2B GDN
    shapes: fwd+bwd 34.3 -> 27.8 ms per layer on a tree row, 16.5 -> 12.5 on a plain one, same errors against the
    fp32 reference: scripts/bench_gdn.py --compile) when GRPO_GDN_COMPILE=1: off by default, because in the first
    GPU run with them on (Qwen3.5-tiny against vLLM, 2026-12-02) the trainer had not finished its first step two
    minutes after its memory probe (each region compiles again for the first rows of 2+ segments and for new ranks;
    on CPU one such compile takes ~70 s), and their gain in the whole step is not measured yet. Returns the number
    of compiled modules. `scope="layers"` compiles each dense attention layer whole instead (`whole_layers`) and the
    regions of the other layers; `scope="layers_gdn"` also each Gated DeltaNet layer whole where FLA runs it in one
    pass per row (`whole_gdn_layers`), and the mixer of the other GDN layers (grpo/kernels/gdn_graph.py)."""
    import sys

    from grpo.distributed import decoder_layers
    from grpo.kernels.gdn import is_gdn_layer

    if scope not in ("regions", "layers", "layers_gdn"):
        raise ValueError(f"compile_scope must be regions, layers or layers_gdn, got {scope!r}")
    whole = whole_layers(model) if scope in ("layers", "layers_gdn") else []
    gdn_whole = whole_gdn_layers(model) if scope == "layers_gdn" else []
    if gdn_whole:  # their packed forwards read the row's mixer tables, built before the decoder runs
        from grpo.kernels.gdn_graph import row_tables
        from grpo.row_context import set_row_hook
        from grpo.tree_attention import text_decoder

        kernel_size = gdn_whole[0].linear_attn.conv_kernel_size
        set_row_hook(text_decoder(model), "gdn_tables",
                     lambda ctx: setattr(ctx, "gdn_tables", row_tables(ctx, kernel_size)))
    whole += gdn_whole
    for layer in whole:
        layer.compile(dynamic=True)
    inside = {id(m) for layer in whole for m in layer.modules()}
    compiled = len(whole)
    if any(is_gdn_layer(m) for m in model.modules()):
        compiled += _compile_gdn_regions(scope)
    norms = [m for m in model.modules()
             if type(m).__name__.endswith(("RMSNorm", "RMSNormGated")) and id(m) not in inside]
    mlps = [layer.mlp for layer in decoder_layers(model)
            if hasattr(layer, "mlp") and type(layer.mlp).__name__.endswith("MLP") and id(layer.mlp) not in inside]
    for module in norms + mlps:
        module.compile(dynamic=True)
        compiled += 1
    for layer in decoder_layers(model):  # rotary embedding: a module-level function of the modelling file
        attn = getattr(layer, "self_attn", None)
        modeling = sys.modules.get(type(attn).__module__) if attn is not None else None
        rope = getattr(modeling, "apply_rotary_pos_emb", None)
        if rope is not None and not hasattr(rope, "_grpo_compiled"):
            fast = torch.compile(rope, dynamic=True)
            fast._grpo_compiled = True
            modeling.apply_rotary_pos_emb = fast
            compiled += 1
    return compiled


def _compile_gdn_regions(scope: str) -> int:
    """Gated DeltaNet's compiled regions (module-wide, so counted once): the tree conv and gates; with `layers_gdn` the
    mixer of GDN layers not compiled whole; with GRPO_GDN_COMPILE=1 the torch kernel's regions."""
    import os

    from grpo.kernels.gdn import compile_chunk_regions, compile_tree_conv

    compile_tree_conv()
    compiled = 1
    if scope == "layers_gdn":
        from grpo.kernels.gdn_graph import compile_gdn_mixer

        compile_gdn_mixer()  # used where FLA runs in one pass per row (grpo/kernels/gdn_graph.py)
        compiled += 1
    if os.environ.get("GRPO_GDN_COMPILE", "0") == "1":
        compile_chunk_regions()
        compiled += 2
    return compiled


def whole_layers(model) -> list:
    """The decoder layers `compile_scope="layers"` compiles whole: attention + a dense MLP, nothing dynamo should not
    trace (a Gated DeltaNet layer's tree scan calls FLA's Triton kernels; MoE routing has data-dependent shapes)."""
    from grpo.distributed import decoder_layers
    from grpo.kernels.gdn import is_gdn_layer

    return [layer for layer in decoder_layers(model)
            if hasattr(layer, "self_attn") and type(getattr(layer, "mlp", None)).__name__.endswith("MLP")
            and not any(is_gdn_layer(m) for m in layer.modules())]


def whole_gdn_layers(model) -> list:
    """The decoder layers `compile_scope="layers_gdn"` also compiles whole: a Gated DeltaNet mixer that
    grpo/kernels/gdn_graph.py's formula covers, run by FLA in one pass per row on its device (decided here, FLA's check
    included), and a dense MLP. Elsewhere (the torch kernel, an adapter on a projection) the layer keeps its regions."""
    from grpo.kernels import gdn
    from grpo.distributed import decoder_layers
    from grpo.kernels.gdn_graph import mixer_weights

    chosen = []
    for layer in decoder_layers(model):
        mixer = getattr(layer, "linear_attn", None)
        if (mixer is None or not gdn.is_gdn_layer(mixer) or mixer_weights(mixer) is None
                or not type(getattr(layer, "mlp", None)).__name__.endswith("MLP")):
            continue
        heads = (mixer.num_k_heads, mixer.num_v_heads, mixer.head_k_dim, mixer.head_v_dim)
        kernels, _ = gdn.gdn_kernels(getattr(mixer, "_tree_gdn_kernel", "auto"), mixer.in_proj_qkv.weight.device, heads)
        if kernels.for_forward(True) == "fla" and kernels.one_pass:
            chosen.append(layer)
    return chosen


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
        if not is_text_param(name):
            p.requires_grad_(False)
            n += p.numel()
    return n


def is_text_param(name: str) -> bool:
    return "language_model" in name or name.startswith("lm_head")


def decoder(model):
    """The text decoder (the module with embed_tokens and layers)."""
    for m in model.modules():
        if hasattr(m, "embed_tokens") and hasattr(m, "layers"):
            return m
    raise ValueError(f"no text decoder found in {type(model).__name__}")


def trainable_parameters(model) -> list[torch.nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]
