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

from dataclasses import dataclass

import torch
from torch import Tensor

NEG_INF = float("-inf")


@dataclass(frozen=True)
class HeadTransform:
    """What the model's own head does to h·Wᵀ before sampling, in transformers' order: logits = raw x multiplier,
    then (when `softcap` is set) softcap x tanh(logits / softcap). Read from the model by grpo/logit_transforms.py
    (Granite's 1 / logits_scaling, Cohere's logit_scale, Gemma-2's final_logit_softcapping, ...)."""

    multiplier: float = 1.0
    """Linear factor on the raw logits (1.0: none)."""
    softcap: float | None = None
    """Final-logit soft cap, applied after the multiplier (None: none)."""

    @property
    def is_identity(self) -> bool:
        return self.multiplier == 1.0 and self.softcap is None

    def apply(self, raw: Tensor) -> Tensor:
        """The transform on [*, V] logits, out of place (the reference formula)."""
        logits = raw * self.multiplier if self.multiplier != 1.0 else raw
        return logits if self.softcap is None else torch.tanh(logits / self.softcap) * self.softcap


def policy_token_logprobs(
    hidden: Tensor,  # [M, H]
    lm_head_weight: Tensor,  # [V, H]
    targets: Tensor,  # [M] sampled ids, -1 = padding
    temperature: float,
    top_ids: Tensor | None = None,  # [M, K] sampler top-k ids, -1 = padding
    sampling_mask: Tensor | None = None,  # [M, C] candidate ids, -1 = padding; None = full vocabulary
    chunk_size: int = 4096,
    keep_logits_bytes: int = 0,
    fused: bool = False,
    transform: HeadTransform | None = None,
) -> tuple[Tensor, Tensor | None, Tensor]:
    """Return (policy_logprobs [M], policy_top_logprobs [M, K] or None, entropy [M] detached).

    `transform` is the model's own logit transform (multiplier, final soft cap), applied before the temperature
    as transformers and vLLM apply it; a soft cap runs the unfused passes (the compiled ones have no cap).

    A `sampling_mask` row with no candidate at all (every entry -1) means "no mask reported for this position"
    and falls back to the full vocabulary there (e.g. vLLM dropping the mask under batch-sharded sampling).

    Speed options, same values: `keep_logits_bytes` keeps the forward's logits (in the matmul's dtype,
    bit-identical to a recompute) for the backward, as many whole chunks as fit in that many bytes (all M rows
    when they fit), saving one of the head's four matmuls on the kept rows; `fused` runs the full-vocabulary
    softmax passes of each chunk through torch.compile (one or two kernels over the bf16 logits instead of ~8 fp32
    [chunk, V] passes). With both, no sampling mask and every row's logits kept, the M rows are one block: one
    matmul each for the logits, the hidden-state gradient and the weight gradient (no per-chunk fp32 [V, H]
    partial sums to add up), and the backward turns the kept logits into their gradient in place.
    """
    _check_inputs(hidden, lm_head_weight, targets, temperature, top_ids, sampling_mask, chunk_size)
    index = targets.long().unsqueeze(1)  # [M, 1]
    if top_ids is not None:
        index = torch.cat([index, top_ids.long()], dim=1)  # [M, 1 + K]
    support = None if sampling_mask is None else _unique_ids(sampling_mask.long())
    m = hidden.shape[0]
    kept_rows = _kept_rows(m, lm_head_weight.shape[0] * hidden.element_size(), chunk_size, keep_logits_bytes)
    transform = transform or HeadTransform()
    fused = fused and transform.softcap is None
    block = fused and support is None and kept_rows == m > 0  # every row's logits kept: one block, no chunks
    softcap = None if transform.softcap is None else (transform.multiplier / transform.softcap,
                                                      transform.softcap / temperature)
    scale = transform.multiplier / temperature
    options = _HeadOptions(scale, m if block else chunk_size, kept_rows, fused, block, softcap)
    logprobs, entropy = _ChunkedLogprobs.apply(hidden, lm_head_weight, index, support, options)
    policy_top_logprobs = logprobs[:, 1:] if top_ids is not None else None
    return logprobs[:, 0], policy_top_logprobs, entropy


def naive_token_logprobs(
    hidden: Tensor,  # [M, H]
    lm_head_weight: Tensor,  # [V, H]
    targets: Tensor,  # [M]
    temperature: float,
    top_ids: Tensor | None = None,  # [M, K]
    sampling_mask: Tensor | None = None,  # [M, C]
    transform: HeadTransform | None = None,
) -> tuple[Tensor, Tensor | None, Tensor]:
    """The same quantities through plain autograd on the full [M, V] logits: the reference for tests and benches."""
    logits = (transform or HeadTransform()).apply(hidden @ lm_head_weight.T)  # [M, V]
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


def _kept_rows(m: int, row_bytes: int, chunk_size: int, keep_logits_bytes: int) -> int:
    """Rows whose forward logits the backward reads instead of recomputing: all M when they fit in
    `keep_logits_bytes`, else the most whole chunks that do."""
    if m * row_bytes <= keep_logits_bytes:
        return m
    return min(m, keep_logits_bytes // (row_bytes * chunk_size) * chunk_size)


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


def _tempered(raw: Tensor, options: _HeadOptions) -> Tensor:
    """Transformed, tempered float32 logits of one chunk from the matmul's output (a copy: kept logits stay
    untouched): raw x multiplier / T, or cap / T tanh(raw x multiplier / cap) under a soft cap."""
    z = raw.to(torch.promote_types(raw.dtype, torch.float32), copy=True)
    if options.softcap is None:
        return z.mul_(options.logit_scale)
    return z.mul_(options.softcap[0]).tanh_().mul_(options.softcap[1])


def _grad_raw(logits: Tensor, index: Tensor, support: Tensor | None, lse: Tensor, grad: Tensor,
              options: _HeadOptions) -> Tensor:
    """d loss / d raw logits of one chunk from its transformed logits: the softmax gradient times dz/draw, which
    is multiplier / T, times 1 - tanh^2 under a soft cap."""
    if options.softcap is None:
        return _chunk_grad_logits(logits, index, support, lse, grad, options.logit_scale)
    slope = (logits * (1.0 / options.softcap[1])).square_().neg_().add_(1.0)  # 1 - tanh^2, [c, V]
    grad_z = _chunk_grad_logits(logits, index, support, lse, grad, 1.0)
    return grad_z.mul_(slope).mul_(options.softcap[0] * options.softcap[1])


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


@dataclass(frozen=True)
class _HeadOptions:
    logit_scale: float  # the head's multiplier / T: the whole transform when there is no cap
    chunk_size: int
    kept_rows: int  # the first rows (whole chunks) whose logits the forward keeps for the backward
    fused: bool
    block: bool = False  # one chunk of all M rows, kept, fused, no mask: the backward of `_block_backward`
    softcap: tuple[float, float] | None = None  # (multiplier / cap, cap / T): z = cap/T tanh(raw multiplier / cap)


class _ChunkedLogprobs(torch.autograd.Function):
    """Chunked log_softmax-and-gather through the LM head, recomputing each chunk's logits in the backward
    (or reading the kept forward logits)."""

    @staticmethod
    def forward(ctx, hidden, weight, index, support, options: _HeadOptions):
        compute_weight = weight.to(hidden.dtype)
        out_dtype = torch.promote_types(hidden.dtype, torch.float32)
        logprobs = torch.empty(index.shape, dtype=out_dtype, device=hidden.device)  # [M, J]
        entropy = torch.empty(index.shape[0], dtype=out_dtype, device=hidden.device)  # [M]
        lse_used = torch.empty_like(entropy)
        kept = []  # [c, V] logits of the first chunks, one tensor each (see `_chunk_of`)
        with torch.no_grad(), torch.autocast(hidden.device.type, enabled=False):
            for rows in _chunks(hidden.shape[0], options.chunk_size):
                raw = torch.mm(hidden[rows], compute_weight.T)  # [c, V]
                if rows.start < options.kept_rows:
                    kept.append(raw)
                chunk_support = None if support is None else support[rows]
                if options.fused and chunk_support is None:
                    logprobs[rows], entropy[rows], lse_used[rows] = _fused_forward()(raw, _chunk_of(index, rows),
                                                                                      options.logit_scale)
                else:
                    logprobs[rows], entropy[rows], lse_used[rows], _ = _chunk_forward(
                        _tempered(raw, options), index[rows], chunk_support)
        ctx.save_for_backward(hidden, weight, index, support, lse_used, logprobs)
        ctx.options, ctx.kept = options, kept  # created here, not inputs or outputs: kept as plain references
        ctx.mark_non_differentiable(entropy)
        return logprobs, entropy

    @staticmethod
    def backward(ctx, grad_logprobs, _grad_entropy):
        hidden, weight, index, support, lse_used, logprobs = ctx.saved_tensors
        options, kept = ctx.options, ctx.kept
        need_hidden, need_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        # -inf outputs (padding, ids outside S_t) are constants: their incoming gradient is dropped.
        grad_logprobs = torch.where(torch.isfinite(logprobs), grad_logprobs.to(logprobs.dtype), 0.0)  # [M, J]
        if options.block:
            return (*_block_backward(kept, hidden, weight, index, lse_used, grad_logprobs, options.logit_scale,
                                     need_hidden, need_weight), None, None, None)
        compute_weight = weight.to(hidden.dtype)
        grad_hidden = torch.zeros_like(hidden) if need_hidden else None
        grad_dtype = torch.promote_types(weight.dtype, torch.float32)
        grad_weight = torch.zeros(weight.shape, dtype=grad_dtype, device=weight.device) if need_weight else None
        with torch.no_grad(), torch.autocast(hidden.device.type, enabled=False):
            for i, rows in enumerate(_chunks(hidden.shape[0], options.chunk_size)):
                raw = kept[i] if i < len(kept) else hidden[rows] @ compute_weight.T  # [c, V]
                chunk_support = None if support is None else support[rows]
                if options.fused and chunk_support is None:
                    grad_logits = _fused_grad()(raw, _chunk_of(index, rows), _chunk_of(lse_used, rows),
                                                _chunk_of(grad_logprobs, rows), options.logit_scale)
                else:
                    grad_logits = _grad_raw(_tempered(raw, options), index[rows], chunk_support, lse_used[rows],
                                            grad_logprobs[rows], options).to(hidden.dtype)
                if need_hidden:
                    torch.mm(grad_logits, compute_weight, out=grad_hidden[rows])
                if need_weight:
                    _accumulate_weight_grad(grad_weight, grad_logits.T, hidden[rows])
        grad_weight = grad_weight.to(weight.dtype) if need_weight else None
        return grad_hidden, grad_weight, None, None, None


def _chunk_of(t: Tensor, rows: slice) -> Tensor:
    """A chunk's rows of a small per-position tensor as a tensor of its own (no view, storage offset 0) for the
    compiled passes: torch.compile guards on a view's base and specialises a storage offset of 0 against one >= 2,
    so the views of different chunks compiled again and again, and with the kept logits' views as well the variants
    passed its recompile limit (8) on an H200 (2026-12-04), beyond which it runs the passes eagerly. Each kept
    chunk's logits are a tensor of their own for the same reason."""
    return t[rows].clone()


def _chunks(total: int, size: int):
    for start in range(0, total, size):
        yield slice(start, start + size)


def _accumulate_weight_grad(acc: Tensor, grad_logits_t: Tensor, hidden: Tensor) -> None:
    """acc [V, H] (fp32) += grad_logits_t [V, c] @ hidden [c, H], the product taken in the hidden states' dtype."""
    if grad_logits_t.dtype == acc.dtype:
        acc.addmm_(grad_logits_t, hidden)
    else:
        acc.add_(_weight_product(grad_logits_t, hidden, acc.dtype))


def _weight_product(grad_logits_t: Tensor, hidden: Tensor, dtype: torch.dtype) -> Tensor:
    """grad_logits_t [V, c] @ hidden [c, H] in `dtype`, the operands in the hidden states' dtype.

    bf16 operands run on the tensor cores; CUDA's `mm(out_dtype=float32)` keeps the product's fp32 accumulator
    (no bf16 rounding of a chunk's sum), elsewhere the product is rounded to bf16 once, as any bf16 linear's weight
    gradient is. fp32 hidden states (CPU tests) keep the exact fp32 path."""
    if grad_logits_t.dtype == dtype:
        return torch.mm(grad_logits_t, hidden)
    if grad_logits_t.is_cuda and _MM_OUT_DTYPE[0]:
        try:
            return torch.mm(grad_logits_t, hidden, out_dtype=dtype)
        except (TypeError, RuntimeError, NotImplementedError):  # torch without mm(out_dtype=) on this device
            _MM_OUT_DTYPE[0] = False
    return (grad_logits_t @ hidden).to(dtype)


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


def _block_backward(kept: list, hidden: Tensor, weight: Tensor, index: Tensor, lse: Tensor, grad: Tensor,
                    inv_temperature: float, need_hidden: bool, need_weight: bool) -> tuple[Tensor | None, ...]:
    """(grad_hidden, grad_weight) of a one-block head: the kept [M, V] logits become d loss / d logits in place
    (they are taken from `kept`, so a second backward recomputes them), then one matmul for each gradient."""
    compute_weight = weight.to(hidden.dtype)
    with torch.no_grad(), torch.autocast(hidden.device.type, enabled=False):
        raw = kept.pop() if kept else hidden @ compute_weight.T  # [M, V]
        grad_logits = _block_grad_logits(raw, index, lse, grad, inv_temperature)
        grad_hidden = torch.mm(grad_logits, compute_weight) if need_hidden else None
        grad_weight = None
        if need_weight:
            dtype = hidden.dtype if weight.dtype == hidden.dtype else torch.promote_types(weight.dtype, torch.float32)
            grad_weight = _weight_product(grad_logits.T, hidden, dtype).to(weight.dtype)
    return grad_hidden, grad_weight


def _block_grad_logits(raw: Tensor, index: Tensor, lse: Tensor, grad: Tensor, inv_temperature: float) -> Tensor:
    """`fused_grad_reference`'s value written over `raw` itself: the -sum(grad) p / T part by one in-place pass,
    then the J gradient-carrying ids of each row set from values taken before it. Padding ids (-1) read and write
    id 0 with the same value as every other entry of id 0 (repeats are summed first), so the order of the writes
    does not matter."""
    ids = index.clamp_min(0)  # [M, J]
    z_ids = raw.gather(1, ids)  # before the pass overwrites them
    neg_row_grad = -grad.sum(dim=1, keepdim=True)  # [M, 1]
    _fused_probs_into()(raw, lse, neg_row_grad, inv_temperature)
    repeats = (ids[:, :, None] == ids[:, None, :]).to(grad.dtype)  # [M, J, J]
    z = z_ids.to(torch.promote_types(raw.dtype, torch.float32)) * inv_temperature
    at_ids = torch.exp(z - lse[:, None]) * neg_row_grad + (repeats * grad[:, None, :]).sum(-1)
    return raw.scatter_(1, ids, (at_ids * inv_temperature).to(raw.dtype))


# ------------------------------------------------------------------ fused full-vocabulary passes (torch.compile)
# The same quantities as _chunk_forward / _chunk_grad_logits without a sampling mask, written as pure functions
# so inductor can fuse the upcast, temperature, logsumexp, exp, entropy and gradient into a few kernels that
# read the bf16 logits instead of writing fp32 [chunk, V] intermediates. Compiled lazily (no compile at import).

def fused_forward_reference(raw: Tensor, index: Tensor, inv_temperature: float) -> tuple[Tensor, Tensor, Tensor]:
    """(logprobs at `index` [c, J], entropy [c], log-normaliser [c]) over the full vocabulary."""
    z = raw.to(torch.promote_types(raw.dtype, torch.float32)) * inv_temperature
    lse = torch.logsumexp(z, dim=1)
    entropy = lse - (torch.exp(z - lse[:, None]) * z).sum(dim=1)
    logprobs = z.gather(1, index.clamp_min(0)) - lse[:, None]
    return logprobs.masked_fill(index < 0, NEG_INF), entropy, lse


def fused_grad_reference(raw: Tensor, index: Tensor, lse: Tensor, grad: Tensor, inv_temperature: float) -> Tensor:
    """d loss / d (untempered logits) [c, V] in the logits' dtype: (scatter(grad) - sum(grad) p) / T."""
    z = raw.to(torch.promote_types(raw.dtype, torch.float32)) * inv_temperature
    g = torch.exp(z - lse[:, None]) * (-grad.sum(dim=1, keepdim=True))
    g = g.scatter_add(1, index.clamp_min(0), grad)
    return (g * inv_temperature).to(raw.dtype)


def fused_probs_into_reference(raw: Tensor, lse: Tensor, neg_row_grad: Tensor, inv_temperature: float) -> None:
    """raw [c, V] <- -sum(grad) p / T in raw's dtype, in place (the gradient without its scatter at the ids)."""
    z = raw.to(torch.promote_types(raw.dtype, torch.float32)) * inv_temperature
    raw.copy_((torch.exp(z - lse[:, None]) * neg_row_grad * inv_temperature).to(raw.dtype))


_COMPILED: dict = {}


def _fused_forward():
    if "forward" not in _COMPILED:
        _COMPILED["forward"] = torch.compile(fused_forward_reference, dynamic=True)
    return _COMPILED["forward"]


def _fused_grad():
    if "grad" not in _COMPILED:
        _COMPILED["grad"] = torch.compile(fused_grad_reference, dynamic=True)
    return _COMPILED["grad"]


def _fused_probs_into():
    if "probs_into" not in _COMPILED:
        _COMPILED["probs_into"] = torch.compile(fused_probs_into_reference, dynamic=True)
    return _COMPILED["probs_into"]
