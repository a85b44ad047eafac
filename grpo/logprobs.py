"""Token log-probabilities of the policy at trained positions, without materialising [tokens x vocab] logits.

`policy_token_logprobs` maps final hidden states through the LM head and returns, per trained position, the log
probability of the sampled token, of the sampler's top-k ids (score centering) and the entropy, all at the sampling
temperature T and over the same support the sampler drew from (docs/design.md §5):

    log p(a) = z_a / T - logsumexp_{b in S_t}(z_b / T)       S_t = full vocabulary, or the sampling mask's ids

Ids outside S_t (and -1 padding) get log p = -inf and no gradient. Positions are processed `chunk_size` at a time
inside one custom autograd.Function whose backward recomputes each chunk's logits, so neither pass keeps more than
one chunk of [chunk, V] logits alive (the naive path keeps several [M, V] tensors for the backward).

Numerics: the logit matmul runs in the hidden states' dtype (what the model's own lm_head would do, and what vLLM
does), logits are upcast to float32 before the softmax, and the LM-head gradient's matmuls run in the hidden
states' dtype too (bf16 tensor cores under mixed precision) while their sum over chunks is kept in float32 and
cast back once.
"""

from __future__ import annotations

import torch
from torch import Tensor

NEG_INF = float("-inf")


def policy_token_logprobs(
    hidden: Tensor,  # [M, H]
    lm_head_weight: Tensor,  # [V, H]
    targets: Tensor,  # [M] sampled ids, -1 = padding
    temperature: float,
    top_ids: Tensor | None = None,  # [M, K] sampler top-k ids, -1 = padding
    sampling_mask: Tensor | None = None,  # [M, C] candidate ids, -1 = padding; None = full vocabulary
    chunk_size: int = 4096,
) -> tuple[Tensor, Tensor | None, Tensor]:
    """Return (policy_logprobs [M], policy_top_logprobs [M, K] or None, entropy [M] detached).

    A `sampling_mask` row with no candidate at all (every entry -1) means "no mask reported for this position"
    and falls back to the full vocabulary there (e.g. vLLM dropping the mask under batch-sharded sampling).
    """
    _check_inputs(hidden, lm_head_weight, targets, temperature, top_ids, sampling_mask, chunk_size)
    index = targets.long().unsqueeze(1)  # [M, 1]
    if top_ids is not None:
        index = torch.cat([index, top_ids.long()], dim=1)  # [M, 1 + K]
    support = None if sampling_mask is None else _unique_ids(sampling_mask.long())
    logprobs, entropy = _ChunkedLogprobs.apply(hidden, lm_head_weight, index, support, 1.0 / temperature, chunk_size)
    policy_top_logprobs = logprobs[:, 1:] if top_ids is not None else None
    return logprobs[:, 0], policy_top_logprobs, entropy


def naive_token_logprobs(
    hidden: Tensor,  # [M, H]
    lm_head_weight: Tensor,  # [V, H]
    targets: Tensor,  # [M]
    temperature: float,
    top_ids: Tensor | None = None,  # [M, K]
    sampling_mask: Tensor | None = None,  # [M, C]
) -> tuple[Tensor, Tensor | None, Tensor]:
    """The same quantities through plain autograd on the full [M, V] logits: the reference for tests and benches."""
    logits = hidden @ lm_head_weight.T  # [M, V]
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32)) / temperature
    if sampling_mask is not None:
        has_set = (sampling_mask >= 0).any(dim=1, keepdim=True)  # [M, 1]
        hits = torch.zeros_like(logits).scatter_add_(1, sampling_mask.long().clamp_min(0),
                                                     (sampling_mask >= 0).to(logits.dtype))
        in_set = hits > 0  # [M, V]; a scatter of booleans would let padding (clamped to id 0) overwrite id 0
        logits = logits.masked_fill(has_set & ~in_set, NEG_INF)
    logp = torch.log_softmax(logits, dim=-1)  # [M, V]
    entropy = -(logp.exp() * logp.nan_to_num(neginf=0.0)).sum(-1).detach()  # [M]

    def gather(ids: Tensor) -> Tensor:
        values = logp.gather(1, ids.long().clamp_min(0))
        return values.masked_fill(ids < 0, NEG_INF)

    top = gather(top_ids) if top_ids is not None else None
    return gather(targets.unsqueeze(1)).squeeze(1), top, entropy


def _check_inputs(hidden, weight, targets, temperature, top_ids, sampling_mask, chunk_size) -> None:
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"expected hidden [M, H] and lm_head_weight [V, H], got {tuple(hidden.shape)} and "
                         f"{tuple(weight.shape)}")
    if targets.shape != hidden.shape[:1]:
        raise ValueError(f"targets must be [M] = [{hidden.shape[0]}], got {tuple(targets.shape)}")
    for name, ids in (("top_ids", top_ids), ("sampling_mask", sampling_mask)):
        if ids is not None and (ids.dim() != 2 or ids.shape[0] != hidden.shape[0]):
            raise ValueError(f"{name} must be [M, *] with M = {hidden.shape[0]}, got {tuple(ids.shape)}")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0 (the sampler's temperature), got {temperature}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")


def _unique_ids(ids: Tensor) -> Tensor:
    """Each row's ids sorted with repeats turned into -1 padding, so a repeated candidate is counted once."""
    ids = ids.sort(dim=1).values  # [M, C]
    repeat = torch.zeros_like(ids, dtype=torch.bool)
    repeat[:, 1:] = ids[:, 1:] == ids[:, :-1]
    return ids.masked_fill(repeat, -1)


def _chunk_logits(hidden: Tensor, weight: Tensor, inv_temperature: float) -> Tensor:
    """Tempered float32 logits of one chunk."""
    logits = hidden @ weight.T  # [c, V]
    return logits.to(torch.promote_types(logits.dtype, torch.float32)).mul_(inv_temperature)


def _support_logits(logits: Tensor, support: Tensor) -> Tensor:
    """Logits at the candidate ids, -inf at padding."""
    return logits.gather(1, support.clamp_min(0)).masked_fill_(support < 0, NEG_INF)  # [c, C]


def _chunk_forward(logits: Tensor, index: Tensor, support: Tensor | None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(logprobs at `index` [c, J], entropy [c], log-normaliser [c], has_set [c]) for one chunk."""
    lse_full = torch.logsumexp(logits, dim=1)  # [c]
    probs = (logits - lse_full[:, None]).exp_()  # [c, V]
    entropy = lse_full - torch.einsum("cv,cv->c", probs, logits)
    del probs
    lse, has_set = lse_full, torch.zeros_like(lse_full, dtype=torch.bool)
    allowed = index >= 0  # [c, J]
    if support is not None:
        support_logits = _support_logits(logits, support)  # [c, C]
        has_set = (support >= 0).any(dim=1)
        lse_set = torch.logsumexp(support_logits, dim=1)
        set_probs = (support_logits - lse_set[:, None]).exp()
        set_entropy = lse_set - (set_probs * support_logits.nan_to_num(neginf=0.0)).sum(1)
        lse = torch.where(has_set, lse_set, lse_full)
        entropy = torch.where(has_set, set_entropy, entropy)
        in_set = (index[:, :, None] == support[:, None, :]).any(-1)  # [c, J]
        allowed &= in_set | ~has_set[:, None]
    logprobs = logits.gather(1, index.clamp_min(0)) - lse[:, None]
    return logprobs.masked_fill_(~allowed, NEG_INF), entropy, lse, has_set


class _ChunkedLogprobs(torch.autograd.Function):
    """Chunked log_softmax-and-gather through the LM head, recomputing each chunk's logits in the backward."""

    @staticmethod
    def forward(ctx, hidden, weight, index, support, inv_temperature, chunk_size):
        compute_weight = weight.to(hidden.dtype)
        out_dtype = torch.promote_types(hidden.dtype, torch.float32)
        logprobs = torch.empty(index.shape, dtype=out_dtype, device=hidden.device)  # [M, J]
        entropy = torch.empty(index.shape[0], dtype=out_dtype, device=hidden.device)  # [M]
        lse_used = torch.empty_like(entropy)
        with torch.no_grad(), torch.autocast(hidden.device.type, enabled=False):
            for start in range(0, hidden.shape[0], chunk_size):
                rows = slice(start, start + chunk_size)
                logits = _chunk_logits(hidden[rows], compute_weight, inv_temperature)
                chunk_support = None if support is None else support[rows]
                logprobs[rows], entropy[rows], lse_used[rows], _ = _chunk_forward(logits, index[rows], chunk_support)
        ctx.save_for_backward(hidden, weight, index, support, lse_used, logprobs)
        ctx.inv_temperature, ctx.chunk_size = inv_temperature, chunk_size
        ctx.mark_non_differentiable(entropy)
        return logprobs, entropy

    @staticmethod
    def backward(ctx, grad_logprobs, _grad_entropy):
        hidden, weight, index, support, lse_used, logprobs = ctx.saved_tensors
        need_hidden, need_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        # -inf outputs (padding, ids outside S_t) are constants: their incoming gradient is dropped.
        grad_logprobs = torch.where(torch.isfinite(logprobs), grad_logprobs.to(logprobs.dtype), 0.0)  # [M, J]
        compute_weight = weight.to(hidden.dtype)
        grad_hidden = torch.zeros_like(hidden) if need_hidden else None
        grad_dtype = torch.promote_types(weight.dtype, torch.float32)
        grad_weight = torch.zeros(weight.shape, dtype=grad_dtype, device=weight.device) if need_weight else None
        with torch.no_grad(), torch.autocast(hidden.device.type, enabled=False):
            for start in range(0, hidden.shape[0], ctx.chunk_size):
                rows = slice(start, start + ctx.chunk_size)
                logits = _chunk_logits(hidden[rows], compute_weight, ctx.inv_temperature)
                chunk_support = None if support is None else support[rows]
                grad_logits = _chunk_grad_logits(logits, index[rows], chunk_support, lse_used[rows],
                                                 grad_logprobs[rows], ctx.inv_temperature)
                if need_hidden:
                    grad_hidden[rows] = grad_logits.to(hidden.dtype) @ compute_weight
                if need_weight:
                    _accumulate_weight_grad(grad_weight, grad_logits.T.to(hidden.dtype), hidden[rows])
        grad_weight = grad_weight.to(weight.dtype) if need_weight else None
        return grad_hidden, grad_weight, None, None, None, None


def _accumulate_weight_grad(acc: Tensor, grad_logits_t: Tensor, hidden: Tensor) -> None:
    """acc [V, H] (fp32) += grad_logits_t [V, c] @ hidden [c, H], the product taken in the hidden states' dtype.

    bf16 operands run on the tensor cores; CUDA's `mm(out_dtype=float32)` keeps the product's fp32 accumulator
    (no bf16 rounding of a chunk's sum), elsewhere the product is rounded to bf16 once per chunk, as any bf16
    linear's weight gradient is. fp32 hidden states (CPU tests) keep the exact fp32 path."""
    if grad_logits_t.dtype == acc.dtype:
        acc.addmm_(grad_logits_t, hidden)
    elif acc.is_cuda and _MM_OUT_DTYPE[0]:
        try:
            acc.add_(torch.mm(grad_logits_t, hidden, out_dtype=acc.dtype))
        except (TypeError, RuntimeError, NotImplementedError):  # torch without mm(out_dtype=) on this device
            _MM_OUT_DTYPE[0] = False
            acc.add_(grad_logits_t @ hidden)
    else:
        acc.add_(grad_logits_t @ hidden)


_MM_OUT_DTYPE = [True]


def _chunk_grad_logits(logits: Tensor, index: Tensor, support: Tensor | None, lse: Tensor, grad: Tensor,
                       inv_temperature: float) -> Tensor:
    """d loss / d (untempered logits) for one chunk; reuses the logits buffer.

    d log p(a) / d z_b = (1[a = b] - p_b) / T with p normalised over S_t, so the gradient is the scatter of the
    incoming gradients at their ids minus their row sum times p.
    """
    row_grad = grad.sum(dim=1, keepdim=True)  # [c, 1]
    if support is None:
        probs = logits.sub_(lse[:, None]).exp_()  # [c, V]
    else:
        has_set = (support >= 0).any(dim=1, keepdim=True)  # [c, 1]
        set_probs = (_support_logits(logits, support) - lse[:, None]).exp_()  # [c, C], 0 at padding
        # rows with a set are filled before exp: logits outside S_t may exceed lse_set and overflow.
        probs = logits.sub_(lse[:, None]).masked_fill_(has_set, NEG_INF).exp_()
        probs.scatter_add_(1, support.clamp_min(0), set_probs * has_set)
    grad_logits = probs.mul_(-row_grad)
    grad_logits.scatter_add_(1, index.clamp_min(0), grad)
    return grad_logits.mul_(inv_temperature)
