"""Model FLOPs of a training step and MFU, counted once, here, for the trainer, the benches and the README.

What is counted (matmul FLOPs, 2 per multiply-add; training = 3 x forward: the backward is twice the forward):

- every decoder layer's projections and MLP on every FORWARDED token (a shared prompt forwarded once by the
  trie counts once: that is the work the GPU really did);
- attention scores and values on the keys each query really attends to: 4 n_h d per (query, key) pair, summed
  over queries as `attended_keys` = sum over forwarded tokens of (depth + 1). Causal, not full: a plain sequence
  of length L contributes L (L + 1) / 2 pairs, not L^2;
- the LM head only where log-probs are computed (`head_tokens`, the trained positions): the chunked head never
  runs on prompt tokens;
- Gated DeltaNet layers (Qwen3.5): their projections, the causal conv, and the recurrent-form delta rule,
  6 dk dv per value head and token (state decay + update, the k.S delta term, the q.S readout);
- MoE layers: the routed experts (top-k) and the router.

Not counted: norms, rotary, softmax and other elementwise work, and recompute from gradient checkpointing (this
is MFU, not HFU). Peak = dense bf16 tensor-core FLOP/s of the device.
"""

from __future__ import annotations

import torch

# Dense bf16 peak FLOP/s per device.
PEAK_BF16 = {"H100": 989e12, "H200": 989e12, "A100": 312e12, "B200": 2.25e15}
SUPPORTED = ("llama", "qwen2", "qwen3", "qwen3_moe", "qwen3_vl", "qwen3_vl_text", "qwen3_5", "qwen3_5_text")


def _text_config(config):
    return getattr(config, "text_config", None) or config


def _layer_types(text) -> list[str]:
    types = getattr(text, "layer_types", None)
    return list(types) if types else ["full_attention"] * text.num_hidden_layers


def _attention_dims(text) -> tuple[int, int, int]:
    n_h = text.num_attention_heads
    n_kv = getattr(text, "num_key_value_heads", None) or n_h
    d = getattr(text, "head_dim", None) or text.hidden_size // n_h
    return n_h, n_kv, d


def _full_attention_proj(text) -> float:
    h = text.hidden_size
    n_h, n_kv, d = _attention_dims(text)
    q_out = 2 * n_h * d if str(text.model_type).startswith("qwen3_5") else n_h * d  # Qwen3.5: gated attention
    return 2 * h * (q_out + 2 * n_kv * d) + 2 * n_h * d * h


def _gdn_per_token(text) -> float:
    h = text.hidden_size
    nk, nv = text.linear_num_key_heads, text.linear_num_value_heads
    dk, dv = text.linear_key_head_dim, text.linear_value_head_dim
    proj = 2 * h * (2 * nk * dk + 2 * nv * dv + 2 * nv) + 2 * nv * dv * h  # in_proj_qkvz, in_proj_ba, out_proj
    conv = 2 * text.linear_conv_kernel_dim * (2 * nk * dk + nv * dv)
    return proj + conv + 6 * nv * dk * dv


def _mlp_per_token(text, layer: int) -> float:
    h = text.hidden_size
    n_experts = getattr(text, "num_experts", 0) or 0
    sparse_step = getattr(text, "decoder_sparse_step", 1) or 1
    if n_experts and (layer + 1) % sparse_step == 0:
        return text.num_experts_per_tok * 6 * h * text.moe_intermediate_size + 2 * h * n_experts
    return 6 * h * text.intermediate_size


def forward_flops(config, forwarded_tokens: float, attended_keys: float, head_tokens: float) -> float | None:
    """Forward FLOPs of one packed forward; None for architectures this module does not count."""
    text = _text_config(config)
    if getattr(text, "model_type", None) not in SUPPORTED:
        return None
    n_h, _, d = _attention_dims(text)
    per_token, full_layers = 0.0, 0
    for i, kind in enumerate(_layer_types(text)):
        if kind == "linear_attention":
            per_token += _gdn_per_token(text)
        else:
            per_token += _full_attention_proj(text)
            full_layers += 1
        per_token += _mlp_per_token(text, i)
    attention = full_layers * 4 * n_h * d * attended_keys
    head = 2 * text.vocab_size * text.hidden_size * head_tokens
    return per_token * forwarded_tokens + attention + head


def training_flops(config, forwarded_tokens: float, attended_keys: float, head_tokens: float) -> float | None:
    """Forward + backward FLOPs (3 x forward)."""
    fwd = forward_flops(config, forwarded_tokens, attended_keys, head_tokens)
    return None if fwd is None else 3 * fwd


def row_attended_keys(position_ids: torch.Tensor) -> int:
    """Sum over a packed row's tokens of the keys each one attends to: its depth (= position id) + 1."""
    return int(position_ids.long().sum()) + int(position_ids.numel())


def device_peak_flops(device: torch.device) -> float | None:
    """Peak dense bf16 FLOP/s of `device`, None when unknown (then MFU is not logged)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAK_BF16.items() if k in name), None)


def mfu(flops: float | None, seconds: float, peak: float | None, world: int) -> float | None:
    """Model FLOPs utilisation of `flops` done in `seconds` by `world` devices, or None when unknown."""
    if flops is None or peak is None or seconds <= 0:
        return None
    return flops / seconds / (peak * world)
