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
from grpo.tree_attention import forward_hidden, lm_head_weight


@dataclass
class PolicyOutput:
    policy_logprobs: torch.Tensor  # [M] with grad
    policy_top_logprobs: torch.Tensor | None  # [M, K] with grad
    entropy: torch.Tensor  # [M] detached
    aux_loss: torch.Tensor | None  # MoE load-balancing loss (unscaled), None for dense models


class PackedPolicy(torch.nn.Module):
    def __init__(self, model: torch.nn.Module, backend: str, temperature: float, logprob_chunk: int = 4096,
                 aux_coef: float = 0.0):
        super().__init__()
        self.aux_coef = aux_coef
        self.model = model
        self.backend = backend
        self.temperature = temperature
        self.logprob_chunk = logprob_chunk

    def forward(self, row) -> PolicyOutput:
        hidden = forward_hidden(self.model, row, self.backend)  # [N, H]
        trained_hidden = hidden[row.token_index]  # [M, H]
        logp, top_logp, entropy = policy_token_logprobs(
            trained_hidden, lm_head_weight(self.model), row.targets, self.temperature,
            top_ids=row.sampler_top_ids, sampling_mask=row.sampling_mask, chunk_size=self.logprob_chunk)
        return PolicyOutput(logp, top_logp, entropy, _pop_aux_loss(self.model))


def _pop_aux_loss(model) -> torch.Tensor | None:
    """MoE routers' load-balancing loss collected during the forward (see tree_attention.forward_hidden)."""
    return getattr(model, "_grpo_aux_loss", None)
