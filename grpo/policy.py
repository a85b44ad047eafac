"""The trainable policy as one module: packed row in, per-loss-term log-probs out.

Wrapping the Hugging Face model this way keeps FSDP2 correct without special cases: the decoder layers are
sharded one by one and this wrapper is the FSDP root, so the root group's parameters (embeddings, final norm,
LM head) are unsharded exactly while `forward` runs, which is where the chunked log-prob head reads the LM head
weight directly (it never builds the full [tokens x vocab] logits, so it cannot go through `lm_head.forward`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from grpo.logprobs import policy_token_logprobs
from grpo.tree_attention import forward_decoder, lm_head_weight


@dataclass
class PolicyOutput:
    policy_logprobs: torch.Tensor  # [M] with grad
    policy_top_logprobs: torch.Tensor | None  # [M, K] with grad
    entropy: torch.Tensor  # [M] detached
    aux_loss: torch.Tensor | None  # MoE load-balancing loss (unscaled), None for dense models / coefficient 0


class PackedPolicy(torch.nn.Module):
    def __init__(self, model: torch.nn.Module, backend: str, temperature: float, logprob_chunk: int = 4096,
                 aux_coef: float = 0.0, keep_logits_bytes: int = 0, fused_head: bool = False):
        super().__init__()
        self.keep_logits_bytes, self.fused_head = keep_logits_bytes, fused_head  # speed only (grpo/logprobs.py)
        self.aux_coef = aux_coef
        self.model = model
        self.backend = backend
        self.temperature = temperature
        self.logprob_chunk = logprob_chunk

    def forward(self, row) -> PolicyOutput:
        extra = {"output_router_logits": True} if self.aux_coef else {}
        out = forward_decoder(self.model, row, self.backend, **extra)
        trained_hidden = out.last_hidden_state[0][row.token_index]  # [M, H]
        logp, top_logp, entropy = policy_token_logprobs(
            trained_hidden, lm_head_weight(self.model), row.targets, self.temperature,
            top_ids=row.sampler_top_ids, sampling_mask=row.sampling_mask, chunk_size=self.logprob_chunk,
            keep_logits_bytes=self.keep_logits_bytes, fused=self.fused_head)
        aux = self.load_balancing_loss(out.router_logits) if self.aux_coef else None
        return PolicyOutput(logp, top_logp, entropy, aux)

    def load_balancing_loss(self, router_logits) -> torch.Tensor:
        """The model's own (Switch-style) load-balancing loss over every packed token, unscaled."""
        from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

        text = getattr(self.model.config, "text_config", None) or self.model.config
        return load_balancing_loss_func(router_logits, text.num_experts, text.num_experts_per_tok)
