"""Start-up probe: the trainer's tree-packed log-probs and gradients against the model's own forward.

The trainer never calls the model's `forward` for log-probs: it runs the text decoder with its own attention
function (grpo/tree_attention.py) and the LM head through its own chunked head (grpo/kernels/logprobs.py). Anything a
model does outside those two paths (a logit multiplier, a soft cap, attention sinks, remote code) would train on
silently wrong numbers. `check_logprob_path` runs a few dozen tokens (two completions sharing a prompt, so the
trie and the ancestor mask are exercised) both ways right after the model is built, and stops the run when the
log-probs or the gradient of one parameter of each family (embedding, attention, MLP, norm, head) differ beyond
the compute dtype's floor (bf16's where a flash backend runs an fp32 model's attention in bf16; docs/design.md
§7.3, docs/failures.md).

Where it runs: train.py calls it once, after `build_policy` and before the cold weight sync, on the model itself
(not the sharded policy): the reference is transformers' own eager forward, and the packed side is a fresh
`PackedPolicy` over the same modules with the run's backend, temperature and head options, so the code under
test is the code that trains. Compiled regions run eagerly for the probe (`force_eager`: no compile for two
throwaway shapes) and TF32 is off for it, so fp32 models are held to an fp32 floor. Only the probed parameters
keep `requires_grad` while it runs (no full-model gradient buffers). Under FSDP2 the parameters are shards on
every rank and the model's own forward cannot run outside the root's unshard: the probe is skipped with a log
line there; the config reader (grpo/logit_transforms.py) and the attention function's refusals still hold.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass, field

import torch

log = logging.getLogger(__name__)

PROMPT, COMPLETIONS = 16, (12, 10)  # the probe's token counts; the completions share their first 4 tokens
SHARED_COMPLETION = 4
# (max |Δ log p|, max relative gradient gap) the compute dtype's floor allows; the bugs this catches are >= 0.1
TOLERANCE = {torch.float64: (1e-6, 1e-5), torch.float32: (1e-3, 1e-2), torch.bfloat16: (0.25, 0.15),
             torch.float16: (0.1, 0.1)}
FAMILIES = {"embedding": ("embed_tokens", "wte"), "attention": ("self_attn", "attention", "attn"),
            "mlp": ("mlp", "feed_forward"), "norm": ("norm", "ln_")}


class ModelCheckError(RuntimeError):
    """The trainer's packed log-probs or gradients differ from the model's own forward beyond the dtype's floor."""


@dataclass
class ProbeReport:
    model_class: str
    dtype: torch.dtype
    logprob_gap: float  # max |Δ log p| over the probe's trained tokens
    grad_gaps: dict[str, float] = field(default_factory=dict)  # family -> max|Δg| / max|g|
    skipped: list[str] = field(default_factory=list)  # families with no trainable parameter (e.g. a LoRA base)
    attention_dtype: torch.dtype | None = None  # the flash backends' half precision on CUDA, else the weights'

    @property
    def tolerance(self) -> tuple[float, float]:
        return TOLERANCE.get(self.attention_dtype or self.dtype, TOLERANCE[torch.bfloat16])

    @property
    def passed(self) -> bool:
        lp_tol, grad_tol = self.tolerance
        return self.logprob_gap <= lp_tol and all(gap <= grad_tol for gap in self.grad_gaps.values())

    def describe(self) -> str:
        grads = ", ".join(f"{k} {v:.1e}" for k, v in self.grad_gaps.items()) or "none trainable"
        skipped = f" (frozen: {', '.join(self.skipped)})" if self.skipped else ""
        lp_tol, grad_tol = self.tolerance
        dtype = str(self.dtype).removeprefix("torch.")
        if self.attention_dtype not in (None, self.dtype):
            dtype += f", attention in {str(self.attention_dtype).removeprefix('torch.')}"
        return (f"{self.model_class} ({dtype}): max |Δlogp| {self.logprob_gap:.1e} "
                f"(tolerance {lp_tol:.0e}), relative gradient gaps {grads}{skipped} (tolerance {grad_tol:.0e})")


def check_logprob_path(model, policy) -> ProbeReport | None:
    """Run the probe on `model` with `policy`'s backend, temperature and head options; log the gaps when they are
    within the floor, raise ModelCheckError when not. Returns None when skipped (FSDP2-sharded parameters)."""
    from torch.distributed.tensor import DTensor

    if any(isinstance(p, DTensor) for p in model.parameters()):
        log.info("start-up log-prob check skipped: the parameters are FSDP2 shards (run once on one process, "
                 "without --one-process-fsdp, to probe this model)")
        return None
    report = probe(model, policy.backend, policy.temperature, keep_logits_bytes=policy.keep_logits_bytes,
                   fused_head=policy.fused_head)
    if not report.passed:
        raise ModelCheckError(
            f"start-up log-prob check failed: the trainer's tree-packed log-probs differ from "
            f"{report.model_class}'s own forward: {report.describe()}. The model transforms its logits or "
            "attention scores in a way grpo does not reproduce, so training would follow wrong numbers. Do not "
            "train it as is: rerun with attn_backend=sdpa to tell a backend fault from a model one, and teach "
            "grpo/logit_transforms.py (head) or grpo/tree_attention.py (attention) the model's transform "
            "(docs/failures.md)")
    log.info("start-up log-prob check passed: %s", report.describe())
    return report


def probe(model, backend: str = "auto", temperature: float = 1.0, **head_options) -> ProbeReport:
    """Gaps between the packed path and the model's own forward on the probe (see the module docstring)."""
    from grpo.lora import packed_forward_module
    from grpo.policy import PackedPolicy

    from grpo.logit_transforms import attention_softcap
    from grpo.tree_attention import select_backend

    device = next(model.parameters()).device
    backend = select_backend(backend, device, softcap=attention_softcap(model) is not None)
    packed = PackedPolicy(packed_forward_module(model), backend, temperature, **head_options)
    samples = probe_samples(model.config.get_text_config().vocab_size)
    chosen = probe_parameters(model)
    with _probe_mode(model, [p for _, p in chosen.values()]):
        row = _pack(samples).to(device)
        order = torch.cat([torch.nonzero(row.sample_id == i)[:, 0] for i in range(len(samples))])  # sample-major
        policy_logprobs = packed(row).policy_logprobs[order]  # [M]
        weights = torch.linspace(-1.0, 1.0, policy_logprobs.shape[0], device=device)  # fixed, signed
        packed_grads = _grads(policy_logprobs, weights, chosen)
        model_logprobs = torch.cat(_model_logprobs(model, samples, temperature, device))  # [M]
        model_grads = _grads(model_logprobs, weights, chosen)
    gap = (policy_logprobs.detach().float() - model_logprobs.detach().float()).abs().max().item()
    grad_gaps = {family: ((packed_grads[family] - model_grads[family]).abs().max()
                          / model_grads[family].abs().max().clamp_min(1e-12)).item() for family in chosen}
    dtype = chosen_dtype(model)
    skipped = [f for f in (*FAMILIES, "head") if f not in chosen]
    # FlashAttention runs fp32 models' attention in bf16 (grpo/tree_attention.py `_flash_dtype`): its floor rules
    flash = device.type == "cuda" and backend in ("flash_varlen", "flash_split") and dtype == torch.float32
    return ProbeReport(type(model).__name__, dtype, gap, grad_gaps, skipped, torch.bfloat16 if flash else None)


def probe_samples(vocab_size: int, seed: int = 0) -> list:
    """Two completions of one prompt that share their first tokens (a three-segment trie), all completion tokens
    trained."""
    from grpo.samples import TrainingSample

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(min(10, vocab_size - 1), vocab_size, (PROMPT + sum(COMPLETIONS),), generator=g).tolist()
    prompt, first = ids[:PROMPT], ids[PROMPT:PROMPT + COMPLETIONS[0]]
    second = first[:SHARED_COMPLETION] + ids[PROMPT + COMPLETIONS[0]:][:COMPLETIONS[1] - SHARED_COMPLETION]
    return [TrainingSample(prompt + c, [0] * PROMPT + [1] * len(c), [-1.0] * (PROMPT + len(c)), 1.0, -1, 0)
            for c in (first, second)]


def _pack(samples):
    from grpo.trie import pack_samples

    return pack_samples(samples)


def probe_parameters(model) -> dict[str, tuple[str, torch.nn.Parameter]]:
    """family -> (name, parameter): the first trainable parameter of each family, and the LM head weight."""
    chosen = {}
    for name, p in model.named_parameters():
        if not p.requires_grad or "lora_A" in name:  # lora_A's gradient goes through B, zero at initialisation
            continue
        for family, keys in FAMILIES.items():
            if family not in chosen and any(k in name for k in keys) and (family != "attention" or p.dim() == 2):
                chosen[family] = (name, p)
                break
    head = model.get_output_embeddings()
    if head is not None and head.weight.requires_grad:
        chosen["head"] = ("lm_head", head.weight)
    return chosen


def chosen_dtype(model) -> torch.dtype:
    head = model.get_output_embeddings()
    return head.weight.dtype if head is not None else next(model.parameters()).dtype


def _grads(logprobs: torch.Tensor, weights: torch.Tensor, chosen: dict) -> dict[str, torch.Tensor]:
    params = [p for _, p in chosen.values()]
    loss = (logprobs.float() * weights).sum()
    grads = torch.autograd.grad(loss, params, allow_unused=True)
    return {family: (g if g is not None else torch.zeros_like(p)).detach().float()
            for family, g, p in zip(chosen, grads, params)}


def _model_logprobs(model, samples, temperature: float, device) -> list[torch.Tensor]:
    """Per sample, log p of each trained token from the model's own forward (transformers' eager attention), in
    the order the packed row lists them (sample by sample, position by position)."""
    from grpo.tree_attention import text_decoder

    decoder = text_decoder(model)
    saved = decoder.config._attn_implementation
    decoder.set_attn_implementation("eager")
    try:
        out = []
        for s in samples:
            ids = torch.tensor(s.input_ids, device=device)[None]
            logits = model(input_ids=ids, use_cache=False).logits[0].float() / temperature  # [L, V]
            pos = torch.tensor([i for i, m in enumerate(s.completion_mask) if m and i > 0], device=device)
            out.append(torch.log_softmax(logits[pos - 1], dim=-1).gather(1, ids[0, pos][:, None])[:, 0])
        return out
    finally:
        decoder.set_attn_implementation(saved)


@contextlib.contextmanager
def _probe_mode(model, params: list):
    """Eager (compiled regions not recompiled for the probe), no TF32, gradients only for `params`."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    keep = {id(p) for p in params}
    tf32 = torch.backends.cuda.matmul.allow_tf32
    for p in trainable:
        p.requires_grad_(id(p) in keep)
    torch.backends.cuda.matmul.allow_tf32 = False
    stance = torch.compiler.set_stance("force_eager") if hasattr(torch.compiler, "set_stance") else \
        contextlib.nullcontext()
    try:
        with stance:
            yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
        for p in trainable:
            p.requires_grad_(True)
