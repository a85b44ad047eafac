"""Invariants every registered loss must satisfy, as plain functions of the loss name.

tests/test_losses.py runs them on every registered loss. To run them on your own loss loaded by import path:

    GRPO_PLUGIN_MODULES=my_pkg.my_losses pytest tests/test_losses.py

(the module's `@register_loss` functions join the registry, the CLI and these checks).

Fixtures respect the loss's structure: one advantage per sequence, sequences of several tokens, distributions over a
tiny vocabulary (V = 6) so the sampler-side expectations used elsewhere are exact sums.
"""

from __future__ import annotations

import math

import torch

from grpo.losses import LossInputs, LossOutput, get_loss, normalized_loss, statistic_scope

V = 6
REQUIRED_METRICS = {"sampling/importance_sampling_ratio/min", "sampling/importance_sampling_ratio/mean",
                    "sampling/importance_sampling_ratio/max", "sampling/masked_mean",
                    "sampling/sampling_logp_difference/mean", "sampling/sampling_logp_difference/max"}
CLIP_METRICS = {"clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean", "clip_ratio/low_min",
                "clip_ratio/high_max"}
"""Optional (a loss without a trust region has none), but all of them or none (grpo.losses.clip_metrics)."""


def structured_case(lengths=(3, 2, 4), k: int = 3, seed: int = 0, on_policy: bool = False, noise: float = 0.3):
    """Full distributions for sequences of the given lengths: (policy logits leaf [M, V], sampler logits [M, V],
    targets [M], per-sequence advantages [S], top ids [M, K], sequence index [M])."""
    gen = torch.Generator().manual_seed(seed)
    m = sum(lengths)
    sampler_logits = torch.randn(m, V, generator=gen, dtype=torch.float64)
    shift = 0.0 if on_policy else noise * torch.randn(m, V, generator=gen, dtype=torch.float64)
    policy_logits = (sampler_logits + shift).requires_grad_()
    targets = (torch.multinomial(torch.softmax(sampler_logits, -1), 1, generator=gen).squeeze(1) if m
               else torch.zeros(0, dtype=torch.long))
    advantages = torch.randn(len(lengths), generator=gen, dtype=torch.float64)
    top_ids = torch.topk(sampler_logits, k, dim=-1).indices
    sequence_index = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths, dtype=torch.long))
    return policy_logits, sampler_logits, targets, advantages, top_ids, sequence_index


def make_inputs(policy_logits, sampler_logits, targets, advantages, top_ids, sequence_index, **counts) -> LossInputs:
    """LossInputs from full distributions (advantages per sequence are repeated on their tokens)."""
    policy_logp = torch.log_softmax(policy_logits, dim=-1)
    sampler_logp = torch.log_softmax(sampler_logits, dim=-1)
    return LossInputs(
        policy_logprobs=policy_logp.gather(1, targets[:, None]).squeeze(1),
        sampler_logprobs=sampler_logp.gather(1, targets[:, None]).squeeze(1),
        advantages=advantages[sequence_index], sequence_index=sequence_index,
        policy_top_logprobs=policy_logp.gather(1, top_ids), sampler_top_logprobs=sampler_logp.gather(1, top_ids),
        max_completion_length=counts.pop("max_completion_length", 8), **counts)


def reinforce_loss(inputs: LossInputs, normalizer: str) -> torch.Tensor:
    """Plain REINFORCE -A log p(y) under the same normaliser: what every loss must reduce to on-policy."""
    terms = -inputs.advantages * inputs.policy_logprobs
    if normalizer == "sequence":
        from grpo.losses import sequence_mean

        terms = sequence_mean(terms, inputs)
    return normalized_loss(LossOutput(terms, normalizer, torch.ones_like(terms, dtype=torch.bool), {}), inputs, 1, 1)


def check_on_policy_is_reinforce(name: str) -> None:
    fn, options = get_loss(name)
    case = structured_case(on_policy=True)
    inputs = make_inputs(*case)
    out = fn(inputs, options)
    (grad,) = torch.autograd.grad(normalized_loss(out, inputs, 1, 1), (case[0],))
    reference = make_inputs(*case)
    (want,) = torch.autograd.grad(reinforce_loss(reference, out.normalizer), (case[0],))
    torch.testing.assert_close(grad, want)
    assert bool(out.kept.all()), "on-policy no token may be removed"
    for stat in ("min", "mean", "max"):
        assert abs(out.metrics[f"sampling/importance_sampling_ratio/{stat}"].item() - 1.0) < 1e-12
    assert out.metrics["sampling/masked_mean"].item() == 0.0


def check_removed_tokens_have_no_gradient(name: str) -> None:
    """Tokens the loss reports as removed (kept = False) get no gradient through their sampled logprob; the
    masked-fraction metric is the removed fraction. Ratios far outside any band make some losses remove tokens."""
    fn, options = get_loss(name)
    case = structured_case(seed=1)
    inputs = make_inputs(*case)
    policy_logprobs = inputs.policy_logprobs.detach().clone()
    with torch.no_grad():
        policy_logprobs[2] = inputs.sampler_logprobs[2] + math.log(8.0)
        policy_logprobs[5] = inputs.sampler_logprobs[5] + math.log(0.3)
    inputs.policy_logprobs = policy_logprobs.requires_grad_()
    out = fn(inputs, options)
    (grad,) = torch.autograd.grad(normalized_loss(out, inputs, 1, 1), (inputs.policy_logprobs,), allow_unused=True)
    grad = torch.zeros_like(policy_logprobs) if grad is None else grad
    assert (grad[~out.kept] == 0).all(), f"removed tokens {(~out.kept).nonzero().flatten().tolist()} have gradient"
    assert abs(out.metrics["sampling/masked_mean"].item() - (~out.kept).double().mean().item()) < 1e-6


def check_sampler_minus_inf_is_removed_and_never_nan(name: str) -> None:
    fn, options = get_loss(name)
    case = structured_case(seed=2)
    inputs = make_inputs(*case)
    inputs.sampler_logprobs = inputs.sampler_logprobs.clone()
    inputs.sampler_logprobs[0] = -9999.0  # vLLM's -inf: the ratio overflows; the token must leave the loss
    top = inputs.sampler_top_logprobs.clone()
    top[:, -1] = -9999.0
    inputs.sampler_top_logprobs = top
    out = fn(inputs, options)
    (grad,) = torch.autograd.grad(normalized_loss(out, inputs, 1, 1), (case[0],))
    assert torch.isfinite(out.terms).all() and torch.isfinite(grad).all()
    assert not out.kept[0]


def check_metrics_and_empty_rows(name: str) -> None:
    fn, options = get_loss(name)
    case = structured_case(seed=3)
    out = fn(make_inputs(*case), options)
    assert REQUIRED_METRICS <= out.metrics.keys(), REQUIRED_METRICS - out.metrics.keys()
    clip = CLIP_METRICS & out.metrics.keys()
    assert not clip or clip == CLIP_METRICS, f"clip_ratio/* is all or nothing; missing {CLIP_METRICS - clip}"
    for key, value in out.metrics.items():
        assert value.dim() == 0 and not value.requires_grad, key
    assert out.normalizer in ("token", "sequence", "constant")
    empty = structured_case(lengths=())
    inputs = make_inputs(*empty, num_tokens_global=10, num_sequences_global=2)
    out = fn(inputs, options)  # a row without trained tokens must still backprop
    normalized_loss(out, inputs, 1, 1).backward()
    assert math.isnan(out.metrics["sampling/importance_sampling_ratio/mean"].item())


def check_normaliser_over_ranks_and_accumulation(name: str) -> None:
    """2 ranks x 2 accumulation steps (FSDP mean over ranks, sum over steps) give the gradient of the loss computed
    on each micro-batch's sequences as one row, averaged over the 2 micro-batches."""
    fn, options = get_loss(name)
    lengths = (3, 2, 4, 1, 2, 3, 5, 2)  # 8 sequences: micro-batch j, rank r gets sequences 4j + 2r, 4j + 2r + 1
    row_scope = statistic_scope(options) == "row"  # a row statistic: each rank holds a copy of (4j, 4j + 1), so
    # its row's statistic is the micro-batch's (grpo/losses.py, StatisticScope)
    policy_logits, sampler_logits, targets, advantages, top_ids, sequence_index = structured_case(lengths, seed=4)
    starts = [0, *torch.tensor(lengths).cumsum(0).tolist()]

    def rows(seqs):
        tokens = torch.cat([torch.arange(starts[s], starts[s + 1]) for s in seqs])
        local = torch.repeat_interleave(torch.arange(len(seqs)), torch.tensor([lengths[s] for s in seqs]))
        return tokens, local, advantages[list(seqs)]

    def row_loss(seqs, world, grad_accum, **counts):
        tokens, local, adv = rows(seqs)
        inputs = make_inputs(policy_logits[tokens], sampler_logits[tokens], targets[tokens], adv, top_ids[tokens],
                             local, **counts)
        return normalized_loss(fn(inputs, options), inputs, world, grad_accum)

    distributed = torch.zeros_like(policy_logits)
    reference = torch.zeros_like(policy_logits)
    for j in range(2):
        batch = [4 * j, 4 * j + 1] * 2 if row_scope else list(range(4 * j, 4 * j + 4))
        counts = dict(num_tokens_global=sum(lengths[s] for s in batch), num_sequences_global=len(batch))
        for r in range(2):
            (g,) = torch.autograd.grad(row_loss(batch[2 * r: 2 * r + 2], 2, 2, **counts), (policy_logits,))
            distributed += g / 2  # FSDP averages the ranks' gradients
        (g,) = torch.autograd.grad(row_loss(batch, 1, 1), (policy_logits,))
        reference += g / 2  # the step averages its micro-batches
    torch.testing.assert_close(distributed, reference)
    assert reference.abs().sum() > 0


def check_normaliser_with_fewer_units_than_ranks(name: str) -> None:
    """D < W: fewer trained units in the micro-batch than ranks, the other ranks holding zero-weight padding rows
    (end-of-data flush, staleness re-check). The step's gradient must still be the one-row loss over the D units:
    each rank divides by D / W (not max(D / W, 1)) and FSDP's mean over W ranks restores 1 / D.

    Cases: W = 4 with 2 sequences on ranks 0 and 1 (D = 2 sequences < 4 for `sequence`); W = 2 with one 1-token
    sequence on rank 0 (D = 1 token and 1 sequence < 2). Nearly on-policy (noise 1e-5), so that no loss clips or
    masks these few tokens away and the gradient compared is not zero (masking is checked elsewhere)."""
    fn, options = get_loss(name)
    first = ([0, 1], [], [], []) if statistic_scope(options) == "row" else ([0], [1], [], [])  # a row statistic:
    for lengths, world, placement in (((3, 2), 4, first), ((1,), 2, ([0], []))):  # the whole batch on one rank
        policy_logits, sampler_logits, targets, advantages, top_ids, _ = structured_case(lengths, seed=8, noise=1e-5)
        starts = [0, *torch.tensor(lengths).cumsum(0).tolist()]
        counts = dict(num_tokens_global=sum(lengths), num_sequences_global=len(lengths))

        def row_loss(seqs, world_size, **counts):
            tokens = torch.cat([torch.arange(starts[s], starts[s + 1]) for s in seqs])
            local = torch.repeat_interleave(torch.arange(len(seqs)), torch.tensor([lengths[s] for s in seqs]))
            inputs = make_inputs(policy_logits[tokens], sampler_logits[tokens], targets[tokens],
                                 advantages[list(seqs)], top_ids[tokens], local, **counts)
            return normalized_loss(fn(inputs, options), inputs, world_size, 1)

        distributed = torch.zeros_like(policy_logits)
        for seqs in placement:
            if seqs:  # a padding row is forwarded with loss * 0 (train.py): zero gradient, but it counts in W
                (g,) = torch.autograd.grad(row_loss(seqs, world, **counts), (policy_logits,))
                distributed += g / world  # FSDP averages the ranks' gradients
        (reference,) = torch.autograd.grad(row_loss(list(range(len(lengths))), 1), (policy_logits,))
        torch.testing.assert_close(distributed, reference, msg=lambda m: f"W = {world}, lengths {lengths}: {m}")
        assert reference.abs().sum() > 0


def check_no_wait_for_the_gpu(name: str) -> None:
    """The loss, its metrics and its backward run on meta tensors (shapes without data): nothing in them reads a
    value on the host. On a GPU such a read (`.item()`, a boolean index's `nonzero`, a shape taken from data)
    makes the host wait for the forward to finish, and the GPU then idles while the host launches the rest."""
    import dataclasses

    fn, options = get_loss(name)
    inputs = make_inputs(*structured_case(seed=4))

    def meta(value):
        if not isinstance(value, torch.Tensor):
            return value
        return value.detach().to("meta").requires_grad_(value.requires_grad or value.grad_fn is not None)

    on_meta = dataclasses.replace(inputs, **{f.name: meta(getattr(inputs, f.name)) for f in dataclasses.fields(inputs)})
    try:
        out = fn(on_meta, options)
        normalized_loss(out, on_meta, 1, 1).backward()
    except (NotImplementedError, RuntimeError) as exc:
        raise AssertionError(f"loss {name!r} reads a value on the host (the GPU step would wait for the GPU there: "
                             f"use torch.where or masked reductions instead of boolean indexing or .item()): {exc}"
                             ) from exc
    assert all(value.device.type == "meta" for value in out.metrics.values())


CHECKS = (check_on_policy_is_reinforce, check_removed_tokens_have_no_gradient,
          check_sampler_minus_inf_is_removed_and_never_nan, check_metrics_and_empty_rows,
          check_normaliser_over_ranks_and_accumulation, check_normaliser_with_fewer_units_than_ranks,
          check_no_wait_for_the_gpu)


def check_loss(name: str) -> None:
    """Every invariant on one loss (registered name or `pkg.module:OptionsClass`)."""
    for check in CHECKS:
        check(name)
