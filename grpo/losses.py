"""The loss interface: `loss(inputs: LossInputs, options) -> LossOutput`, the registry, and the normaliser.

A loss is one pure function over a `LossInputs` record (per-token tensors of one packed row plus the row's
sequence/group structure and the micro-batch's global counts) and its own frozen options dataclass. It returns
per-token or per-sequence terms, the normaliser it wants and its metrics (`LossOutput`). It never calls the model
or torch.distributed: `normalized_loss` (called by the trainer) divides by the normaliser's global count, so the
FSDP gradient mean over W ranks and the sum over GA accumulation steps give the step's loss (docs/losses.md).

Adding a variant (docs/losses.md): a frozen options dataclass (flat, not a subclass of another options class) and
a function decorated with `@register_loss("name", Options())`, in any module of `grpo/` listed in
`grpo.plugins.BUILTIN_MODULES` or in a module named by the `GRPO_PLUGIN_MODULES` environment variable (comma
separated; `GRPO_LOSS_MODULES` is its earlier name). It then appears on the CLI
as `loss:name` with its options, and tests/test_losses.py runs the invariants on it. Options may define
`sampler_needs() -> SamplerNeeds` to ask the rollout worker for what the loss reads (e.g. top-k logprobs).

The built-in families live in `grpo/clipped_losses.py`, `grpo/importance_sampling.py` and
`grpo/score_centering.py`. How they depart from their papers: the "old policy" is the sampler itself (vLLM's
processed logprobs), so one ratio covers staleness and the train/inference mismatch; there is no reference model
and no KL term. docs/losses.md lists every deliberate departure, per family, with the reason.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from torch import Tensor


SAMPLER_NEG_INF = -9999.0
"""vLLM reports -inf logprobs as -9999.0; anything at or below it is treated as -inf."""
LOSS_MODULES_ENV = "GRPO_PLUGIN_MODULES"
"""Environment variable naming extra modules (comma separated) whose losses join the registry, CLI and tests
(grpo/plugins.py; the earlier name GRPO_LOSS_MODULES is still read)."""

Normalizer = Literal["token", "sequence", "constant"]
"""What `normalized_loss` divides the summed terms by (global over ranks, per micro-batch):
`token`: the trained tokens (terms [M]); `sequence`: the sequences (terms [S], one per sequence, usually a
within-sequence mean); `constant`: sequences x max_completion_length (terms [M], Dr. GRPO)."""


StatisticScope = Literal["sequence", "row"]
"""What a loss's per-token terms depend on beyond their own token, declared by the options class attribute
`statistic_scope` (default `sequence`). `sequence`: their own sequence only, so splitting a micro-batch over ranks
and accumulation steps leaves the step's gradient unchanged (tests/loss_checks.py, the normaliser invariants).
`row`: a statistic over the whole packed row the loss is given (Clip-Cov / KL-Cov's covariance selection, a
row-level percentile): the host hands the loss one rank's part of the micro-batch, so the statistic is that part's
and the gradient depends on the split. The kit then checks the documented behaviour instead: the split gradient
equals the one-row gradient when the row's statistic is the micro-batch's (one rank holding the micro-batch, the
others padding; ranks holding copies of one another)."""


def statistic_scope(options: Any) -> StatisticScope:
    """The options' declared statistic scope (`sequence` unless the class says `row`)."""
    scope = getattr(options, "statistic_scope", "sequence")
    if scope not in ("sequence", "row"):
        raise ValueError(f"{type(options).__name__}.statistic_scope = {scope!r}: declare 'sequence' or 'row'")
    return scope


@dataclass(frozen=True)
class SamplerNeeds:
    """What a loss needs from the sampler beyond the sampled tokens' logprobs."""

    top_logprobs: int = 0
    """Top-k logprobs per generated token (vLLM `logprobs=k`); 0 = none."""


@dataclass
class LossInputs:
    """One packed row's trained tokens and their structure; each tensor named by the model that produced it.

    M trained tokens, S sequences (training samples) in the row, K top-k ids per token.
    """

    policy_logprobs: Tensor  # [M] trainer log p(y_t), with grad
    sampler_logprobs: Tensor  # [M] vLLM's processed log q(y_t) at sampling time
    advantages: Tensor  # [M] the sequence's advantage, repeated on each of its tokens
    sequence_index: Tensor  # [M] long in [0, S): which sequence of the row each token belongs to
    group_index: Tensor | None = None  # [M] long, the prompt group (rollout group id) of each token's sequence
    sequence_lengths: Tensor | None = None  # [S] long, trained tokens per sequence (0 for padding sequences)
    num_tokens_global: int = 0  # trained tokens of this micro-batch over all ranks (0 = this row's M)
    num_sequences_global: int = 0  # sequences with a trained token in this micro-batch, all ranks (0 = this row's)
    max_completion_length: int = 1  # the run's max_completion_length (the `constant` normaliser)
    policy_top_logprobs: Tensor | None = None  # [M, K] trainer log p at the sampler's top-k ids, -inf = padding
    sampler_top_logprobs: Tensor | None = None  # [M, K] vLLM's log q at those ids, <= -9999 = -inf

    def __post_init__(self) -> None:
        import torch

        m = self.policy_logprobs.shape
        for name in ("sampler_logprobs", "advantages", "sequence_index", "group_index"):
            value = getattr(self, name)
            if value is not None and value.shape != m:
                raise ValueError(f"LossInputs.{name} must have shape {tuple(m)}, got {tuple(value.shape)}")
        if self.sequence_lengths is None:
            self.sequence_lengths = torch.bincount(self.sequence_index, minlength=int(self.sequence_index.max()) + 1
                                                   if self.sequence_index.numel() else 0)
        if self.group_index is None:
            self.group_index = self.sequence_index.clone()
        self.num_tokens_global = self.num_tokens_global or m[0]
        self.num_sequences_global = self.num_sequences_global or int((self.sequence_lengths > 0).sum())
        if (self.policy_top_logprobs is None) != (self.sampler_top_logprobs is None):
            raise ValueError("pass both policy_top_logprobs and sampler_top_logprobs, or neither")
        if self.policy_top_logprobs is not None:
            policy_shape, sampler_shape = self.policy_top_logprobs.shape, self.sampler_top_logprobs.shape
            if policy_shape != sampler_shape or policy_shape[:1] != m:
                raise ValueError(f"top logprobs must both be [M, K] with M = {m[0]}, got {tuple(policy_shape)} "
                                 f"and {tuple(sampler_shape)}")

    @property
    def num_sequences(self) -> int:
        """S: sequences in this row (padding sequences without trained tokens included)."""
        return int(self.sequence_lengths.numel())


@dataclass
class LossOutput:
    """What a loss returns: terms to sum, how to normalise them, which tokens it kept, and its metrics."""

    terms: Tensor  # [M] per token (`token`, `constant`) or [S] per sequence (`sequence`)
    normalizer: Normalizer
    kept: Tensor  # [M] bool, False where the loss removed the token (no gradient through its sampled logprob)
    metrics: dict[str, Tensor]  # detached scalars


LossFn = Callable[[LossInputs, Any], LossOutput]
LOSSES: dict[str, Any] = {}
"""Registered losses: name -> default options instance (several names may share one options class)."""
LOSS_DESCRIPTIONS: dict[str, str] = {}
_FUNCTIONS: dict[type, LossFn] = {}


def register_loss(name: str, options: Any, description: str | None = None) -> Callable[[LossFn], LossFn]:
    """Decorator: `fn` computes the loss for `type(options)`; `name` selects it with these default options."""

    def add(fn: LossFn) -> LossFn:
        if name in LOSSES:
            raise ValueError(f"loss {name!r} is already registered (options {type(LOSSES[name]).__name__})")
        cls = type(options)
        if _FUNCTIONS.get(cls, fn) is not fn:
            raise ValueError(f"options class {cls.__name__} already belongs to {_FUNCTIONS[cls].__name__}; give "
                             f"{fn.__name__} its own options dataclass")
        _FUNCTIONS[cls] = fn
        LOSSES[name] = options
        LOSS_DESCRIPTIONS[name] = description or (fn.__doc__ or name).strip().splitlines()[0]
        return fn

    return add


def registered_losses() -> dict[str, Any]:
    """Every registered loss: the built-in modules plus those named by $GRPO_PLUGIN_MODULES (imported here)."""
    from grpo.plugins import import_plugins

    import_plugins()
    return LOSSES


def loss_function(options: Any) -> LossFn:
    """The function registered for this options instance's class."""
    registered_losses()
    fn = _FUNCTIONS.get(type(options))
    if fn is None:
        raise ValueError(f"no loss is registered for options {type(options).__name__}; decorate its function with "
                         f"@register_loss(name, {type(options).__name__}()) and import its module "
                         f"(${LOSS_MODULES_ENV}=pkg.module)")
    return fn


def get_loss(name: str) -> tuple[LossFn, Any]:
    """(function, default options) of a registered loss, or of `pkg.module:Options` (an options class)."""
    losses = registered_losses()
    if name in losses:
        return loss_function(losses[name]), losses[name]
    if ":" not in name:
        raise ValueError(f"unknown loss {name!r}: use one of {sorted(losses)} or an import path "
                         f"'pkg.module:OptionsClass'")
    from grpo.imports import resolve_import

    options = resolve_import(name, "loss")()
    return loss_function(options), options


def loss_cli_union() -> Any:
    """The tyro type of the `loss` field: one `loss:<name>` subcommand per registered loss, with its defaults."""
    from typing import Annotated, Union

    import tyro

    members = tuple(Annotated[type(options), tyro.conf.subcommand(name, default=options,
                                                                  description=LOSS_DESCRIPTIONS[name])]
                    for name, options in registered_losses().items())
    return Union[members]  # noqa: UP007 (a runtime-built union)


def sampler_needs(options: Any) -> SamplerNeeds:
    """What the options' loss declared it needs from the sampler (nothing by default)."""
    declare = getattr(options, "sampler_needs", None)
    return declare() if declare is not None else SamplerNeeds()


def normalized_loss(out: LossOutput, inputs: LossInputs, world_size: int, grad_accum: int) -> Tensor:
    """This rank's micro-batch loss: sum(terms) / (D / W) / GA, D = the normaliser's global count.

    FSDP averages gradients over the W ranks and the GA micro-batches of a step are summed, so the step's gradient
    is the mean over micro-batches of sum-over-all-ranks(terms) / D. D counts every trained token (masked and
    zero-advantage ones included) or every sequence with a trained token, over all ranks of the micro-batch.
    D / W is not floored at 1: when D < W (ranks holding padding rows, e.g. at the end-of-data flush) a floor would
    make the divisor W instead of D. D = 0 (nothing trained anywhere) gives 0 with a zero gradient.
    """
    expected = inputs.num_sequences if out.normalizer == "sequence" else inputs.policy_logprobs.shape[0]
    if out.terms.shape != (expected,):
        raise ValueError(f"a {out.normalizer!r}-normalised loss returns terms of shape ({expected},), got "
                         f"{tuple(out.terms.shape)}; use sequence_mean() for per-sequence terms")
    if out.normalizer == "token":
        count = inputs.num_tokens_global
    elif out.normalizer == "sequence":
        count = inputs.num_sequences_global
    elif out.normalizer == "constant":
        count = inputs.num_sequences_global * inputs.max_completion_length
    else:
        raise ValueError(f"unknown normaliser {out.normalizer!r}: use 'token', 'sequence' or 'constant'")
    if count <= 0:
        return out.terms.sum() * 0.0
    return out.terms.sum() / (float(count) / world_size) / grad_accum


# ---- shared pieces: ratio, masking band, per-sequence reductions, metrics -------------------------------------------

def in_band(ratio: Tensor, low: float, high: float) -> Tensor:
    """Masked importance sampling: True where low <= ratio <= high (False for NaN)."""
    return (ratio >= low) & (ratio <= high)


def sampled_token_ratio(inputs: LossInputs, low: float, high: float) -> tuple[Tensor, Tensor, Tensor]:
    """(ratio r_t = p/q with grad [M], in-band mask m_t [M], raw detached ratio [M] for metrics).

    Out-of-band ratios are replaced by a constant 1 before the exp: a masked ratio can be inf (q reported as
    -9999), and exp's backward would turn its zero gradient into 0 * inf = NaN.
    """
    import torch

    log_ratio = inputs.policy_logprobs - inputs.sampler_logprobs  # [M]
    raw_ratio = log_ratio.detach().exp()
    mask = in_band(raw_ratio, low, high)
    ratio = torch.where(mask, log_ratio, torch.zeros_like(log_ratio)).exp()
    return ratio, mask, raw_ratio


def sequence_sum(values: Tensor, inputs: LossInputs) -> Tensor:
    """[M] -> [S]: sum of each sequence's token values."""
    import torch

    out = torch.zeros(inputs.num_sequences, dtype=values.dtype, device=values.device)
    return out.index_add(0, inputs.sequence_index, values)


def sequence_mean(values: Tensor, inputs: LossInputs) -> Tensor:
    """[M] -> [S]: mean over each sequence's trained tokens (0 for a sequence without any)."""
    lengths = inputs.sequence_lengths.to(values.device).clamp_min(1).to(values.dtype)
    return sequence_sum(values, inputs) / lengths


def per_token(values: Tensor, inputs: LossInputs) -> Tensor:
    """[S] -> [M]: each token gets its sequence's value."""
    return values[inputs.sequence_index]


def sampling_metrics(inputs: LossInputs, raw_ratio: Tensor, mask: Tensor) -> dict[str, Tensor]:
    """`sampling/*` over all trained tokens, before masking (NaN for an empty row); `masked_mean` is the fraction
    of tokens `mask` removes (for any reason: IS band, sequence masking)."""
    import torch

    logp_diff = (inputs.policy_logprobs.detach() - inputs.sampler_logprobs).abs()  # [M]
    return {
        "sampling/importance_sampling_ratio/min": reduce(raw_ratio, torch.min),
        "sampling/importance_sampling_ratio/mean": reduce(raw_ratio, torch.mean),
        "sampling/importance_sampling_ratio/max": reduce(raw_ratio, torch.max),
        "sampling/masked_mean": reduce((~mask).float(), torch.mean),
        "sampling/sampling_logp_difference/mean": reduce(logp_diff, torch.mean),
        "sampling/sampling_logp_difference/max": reduce(logp_diff, torch.max),
    }


def clip_metrics(ratio: Tensor, inputs: LossInputs, kept: Tensor, low: float, high: float) -> dict[str, Tensor]:
    """`clip_ratio/*` over kept tokens: tokens whose (token or sequence) ratio leaves the trust region [low, high]
    in the direction the objective clips (below with A < 0, above with A > 0); min/max over sequences."""
    import torch

    advantages = inputs.advantages
    low_hit = (ratio < low) & (advantages < 0) & kept  # [M]
    high_hit = (ratio > high) & (advantages > 0) & kept
    kept_per_seq = sequence_sum(kept.float(), inputs)  # [S]
    has_tokens = kept_per_seq > 0  # sequences without kept tokens are left out: by the neutral element, not by a
    per_seq = kept_per_seq.clamp_min(1.0)  # boolean index (its nonzero() would make the host wait for the GPU)
    low_frac = torch.where(has_tokens, sequence_sum(low_hit.float(), inputs) / per_seq, math.inf)
    high_frac = torch.where(has_tokens, sequence_sum(high_hit.float(), inputs) / per_seq, -math.inf)
    none = ~has_tokens.any()
    num_kept = kept.float().sum()
    return {
        "clip_ratio/low_mean": low_hit.float().sum() / num_kept,
        "clip_ratio/high_mean": high_hit.float().sum() / num_kept,
        "clip_ratio/region_mean": (low_hit | high_hit).float().sum() / num_kept,
        "clip_ratio/low_min": torch.where(none, math.nan, reduce(low_frac, torch.min)),
        "clip_ratio/high_max": torch.where(none, math.nan, reduce(high_frac, torch.max)),
    }


def standard_metrics(inputs: LossInputs, raw_ratio: Tensor, band_mask: Tensor, clip_ratio: Tensor, kept: Tensor,
                     low: float, high: float) -> dict[str, Tensor]:
    """The metrics every loss reports: `sampling/*` (band mask) and `clip_ratio/*` (trust region [low, high])."""
    metrics = sampling_metrics(inputs, raw_ratio, band_mask)
    metrics.update(clip_metrics(clip_ratio, inputs, kept, low, high))
    return {name: value.detach() for name, value in metrics.items()}


def entropy_metric(entropy: Tensor) -> dict[str, Tensor]:
    """`entropy`: mean token entropy over trained tokens (entropy [M] from grpo.kernels.logprobs)."""
    import torch

    return {"entropy": reduce(entropy.detach().float(), torch.mean)}


def reduce(values: Tensor, op: Callable[[Tensor], Tensor]) -> Tensor:
    """A detached float scalar; NaN when there is nothing to reduce (the metric logger drops NaNs)."""
    import torch

    if values.numel() == 0:
        return torch.tensor(float("nan"), device=values.device)
    return op(values.detach().float())
