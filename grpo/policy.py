"""The trainable policy as one module: packed row in, per-loss-term log-probs out; and how a run builds it
(`build_policy`: load, PEFT, sharding, precision, gradient checkpointing, the optimizer and its schedule).

Wrapping the Hugging Face model this way keeps FSDP2 correct without special cases: the decoder layers are
sharded one by one and this wrapper is the FSDP root, so the root group's parameters (embeddings, final norm,
LM head) are unsharded exactly while `forward` runs, which is where the chunked log-prob head reads the LM head
weight directly (it never builds the full [tokens x vocab] logits, so it cannot go through `lm_head.forward`).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch

from grpo.config import AsyncGRPOConfig
from grpo.kernels import policy_token_logprobs
from grpo.logit_transforms import attention_softcap, head_transform
from grpo.tree_attention import forward_decoder, lm_head_weight

log = logging.getLogger("train")


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
        self.keep_logits_bytes, self.fused_head = keep_logits_bytes, fused_head  # speed only (grpo/kernels/logprobs.py)
        self.aux_coef = aux_coef
        self.model = model
        self.backend = backend
        self.temperature = temperature
        self.logprob_chunk = logprob_chunk
        self.head_transform = head_transform(model)  # the model's own logit transform (grpo/logit_transforms.py)

    def forward(self, row) -> PolicyOutput:
        extra = {"output_router_logits": True} if self.aux_coef else {}
        out = forward_decoder(self.model, row, self.backend, **extra)
        trained_hidden = out.last_hidden_state.squeeze(0).index_select(0, row.token_index)  # [M, H]
        logp, top_logp, entropy = policy_token_logprobs(
            trained_hidden, lm_head_weight(self.model), row.targets, self.temperature,
            top_ids=row.sampler_top_ids, sampling_mask=row.sampling_mask, chunk_size=self.logprob_chunk,
            keep_logits_bytes=self.keep_logits_bytes, fused=self.fused_head, transform=self.head_transform)
        aux = self.load_balancing_loss(out.router_logits) if self.aux_coef else None
        return PolicyOutput(logp, top_logp, entropy, aux)

    def load_balancing_loss(self, router_logits) -> torch.Tensor:
        """The model's own (Switch-style) load-balancing loss over every packed token, unscaled."""
        from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

        text = getattr(self.model.config, "text_config", None) or self.model.config
        return load_balancing_loss_func(router_logits, text.num_experts, text.num_experts_per_tok)


def build_policy(config: AsyncGRPOConfig, info, token_budget: int, peft_config=None):
    """(model, policy, optimizer, scheduler, autocast): the training side of the run, built the same way for
    train.py and the benches. `model` is the PEFT model when `peft_config` (or `--lora-r`) is given.

    Precision: fp32 master weights (`--dtype float32`) with bf16 compute on CUDA go through FSDP2's mixed
    precision also on one GPU (grpo/distributed.py says why), so no autocast is needed; autocast remains only
    for a bf16 request the sharding cannot serve (bf16 on fp16 weights)."""
    import contextlib

    from grpo import master_weights
    from grpo.distributed import hsdp_replicas, shard_model
    from grpo.kernels.gdn import patch_gdn_layers
    from grpo.lora import packed_forward_module, peft_config_from_run, wrap_policy
    from grpo.memory import checkpointing_fraction, kept_logits_bytes, probe_samples
    from grpo.model import (aux_loss_coef, compile_layer_regions, load_policy, set_gradient_checkpointing,
                            trainable_parameters)
    from grpo.tree_attention import select_backend
    from grpo.trie import pack_samples

    model = load_policy(config.model, config.dtype, config.trust_remote_code, False,
                        config.router_aux_loss_coef).to(info.device)
    if (peft_config := peft_config or peft_config_from_run(config)) is not None:
        model = wrap_policy(model, peft_config)
    patch_gdn_layers(model, config.gdn_kernel)
    bf16 = config.bf16 if config.bf16 is not None else info.device.type == "cuda"
    mixed_precision = bf16 and config.dtype == "float32"
    compile_layers = config.compile_layers if config.compile_layers is not None else info.device.type == "cuda"
    if compile_layers:
        log.info("torch.compile (%s): %d decoder modules (whole layers or norms, MLPs, rotary, GDN conv) and the "
                 "log-prob head's softmax passes", config.compile_scope,
                 compile_layer_regions(model, config.compile_scope))
    backend = select_backend(config.attn_backend, info.device, softcap=attention_softcap(model) is not None)
    policy = PackedPolicy(packed_forward_module(model), backend,
                          config.temperature, aux_coef=aux_loss_coef(model, config.router_aux_loss_coef),
                          keep_logits_bytes=kept_logits_bytes(info.device), fused_head=compile_layers)
    policy = shard_model(policy, info, mixed_precision=mixed_precision,
                         replicas=hsdp_replicas(config.hsdp_replicas, info), one_process_fsdp=config.one_process_fsdp)
    autocast = ((lambda: torch.autocast(info.device.type, dtype=torch.bfloat16))
                if bf16 and not mixed_precision and config.dtype != "bfloat16" else contextlib.nullcontext)

    def run_probe():  # one worst-case micro-batch through the real policy; its gradients are dropped
        row = pack_samples(probe_samples(token_budget, model.config.get_text_config().vocab_size)).to(info.device)
        with autocast():
            out = policy(row)
        out.policy_logprobs.float().sum().backward()
        if (weights := master_weights.of(policy)) is not None:
            weights.accumulate()  # the fp32 gradient buffers count towards the peak, as in a step
            weights.reset()  # drops every gradient too
        else:
            for p in policy.parameters():
                p.grad = None

    fraction = checkpointing_fraction(config.gradient_checkpointing, policy, model, info, token_budget, run_probe)
    set_gradient_checkpointing(packed_forward_module(model), fraction)
    optimizer, scheduler = build_optimizer(trainable_parameters(policy), config)
    return model, policy, optimizer, scheduler, autocast


def build_optimizer(params, config: AsyncGRPOConfig):
    """AdamW (fused: one kernel over every tensor, and a non-finite step skipped on the device, grpo/step.py
    `optimizer_step`) and its LambdaLR schedule: warmup, then constant, linear or cosine over max_steps."""
    optimizer = torch.optim.AdamW(params, lr=config.learning_rate, betas=(config.adam_beta1, config.adam_beta2),
                                  eps=config.adam_epsilon, weight_decay=config.weight_decay, fused=True)
    if config.lr_scheduler_type != "constant" and config.max_steps <= 0:
        raise ValueError(f"lr_scheduler_type={config.lr_scheduler_type!r} decays over max_steps, which is unknown "
                         "when training by epochs: set --max-steps too")

    def factor(step: int) -> float:
        if config.warmup_steps and step < config.warmup_steps:
            return (step + 1) / config.warmup_steps
        if config.lr_scheduler_type == "constant":
            return 1.0
        progress = min(1.0, (step - config.warmup_steps) / max(1, config.max_steps - config.warmup_steps))
        return 1.0 - progress if config.lr_scheduler_type == "linear" else 0.5 * (1 + math.cos(math.pi * progress))

    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
