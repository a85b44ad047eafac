"""FLOPs per token and MFU (algorithms.md section 13, the reference trainer's formula, kept for comparability).

Attention is counted as full (4 n_h d L, not causal); L is the forwarded-token-weighted mean of forwarded tokens
per sample. Recompute from gradient checkpointing is not counted (MFU, not HFU). GDN hybrids are not covered.
"""

from __future__ import annotations

import torch

# Dense bf16 peak FLOP/s per device.
PEAK_BF16 = {"H100": 989e12, "H200": 989e12, "A100": 312e12, "B200": 2.25e15}
SUPPORTED = ("llama", "qwen2", "qwen3", "qwen3_moe", "qwen3_vl", "qwen3_vl_text")


def forward_flops_per_token(config, attn_len: float) -> float | None:
    """Forward FLOPs per token at mean attention length `attn_len`; None for unsupported architectures."""
    text = getattr(config, "text_config", None) or config
    if getattr(text, "model_type", None) not in SUPPORTED:
        return None
    h, n_h = text.hidden_size, text.num_attention_heads
    n_kv = getattr(text, "num_key_value_heads", None) or n_h
    d = getattr(text, "head_dim", None) or h // n_h
    attn = 2 * h * (n_h * d + 2 * n_kv * d) + 2 * n_h * d * h + 4 * n_h * d * attn_len
    n_experts = getattr(text, "num_experts", 0) or 0
    sparse_step = getattr(text, "decoder_sparse_step", 1) or 1
    total = 0.0
    for i in range(text.num_hidden_layers):
        if n_experts and (i + 1) % sparse_step == 0:
            mlp = text.num_experts_per_tok * 6 * h * text.moe_intermediate_size + 2 * h * n_experts
        else:
            mlp = 6 * h * text.intermediate_size
        total += attn + mlp
    return total + 2 * text.vocab_size * h


def device_peak_flops(device: torch.device) -> float | None:
    """Peak dense bf16 FLOP/s of `device`, None when unknown (then MFU is not logged)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAK_BF16.items() if k in name), None)


def mfu(config, forwarded_tokens: int, attn_len: float, seconds: float, peak: float | None, world: int):
    """Training (3x forward) MFU, or None when the architecture or the peak is unknown."""
    per_token = forward_flops_per_token(config, attn_len)
    if per_token is None or peak is None or seconds <= 0:
        return None
    return 3 * per_token * forwarded_tokens / seconds / (peak * world)
