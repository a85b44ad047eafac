"""grpo/kernels/logprobs.py against plain autograd references: values, gradients, sampling-mask renormalisation, padding."""

from __future__ import annotations

import pytest
import torch

from grpo.kernels.logprobs import naive_token_logprobs, policy_token_logprobs

M, H, V, K, C = 29, 12, 40, 5, 7


def _eager_passes():
    import grpo.kernels.logprobs as lp

    return {"forward": lp.fused_forward_reference, "grad": lp.fused_grad_reference,
            "probs_into": lp.fused_probs_into_reference}


_EAGER_PASSES = _eager_passes()


def _case(seed: int = 0, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(M, H, generator=gen, dtype=dtype).requires_grad_()
    weight = torch.randn(V, H, generator=gen, dtype=dtype).requires_grad_()
    mask = torch.stack([torch.randperm(V, generator=gen)[:C] for _ in range(M)])  # [M, C]
    mask[4, 3:] = -1  # a short candidate set
    targets = mask[torch.arange(M), torch.randint(0, 3, (M,), generator=gen)]  # sampled ids lie in their set
    top_ids = torch.randint(0, V, (M, K), generator=gen)
    top_ids[:, 0] = mask[:, 1]  # at least one top id inside the set
    top_ids[2, 3:] = -1  # padding
    return hidden, weight, targets, top_ids, mask


def _restricted_reference(hidden, weight, targets, top_ids, mask, temperature):
    """Per-row log_softmax over the candidate logits only (Python loop, no shared code with the module)."""
    logits = hidden @ weight.T / temperature
    target_lp, top_lp, entropy = [], [], []
    for i in range(M):
        ids = mask[i][mask[i] >= 0]
        set_lp = torch.log_softmax(logits[i, ids], dim=0)
        lookup = {int(a): set_lp[j] for j, a in enumerate(ids)}
        minus_inf = logits.new_tensor(float("-inf"))
        target_lp.append(lookup.get(int(targets[i]), minus_inf))
        top_lp.append(torch.stack([lookup.get(int(a), minus_inf) for a in top_ids[i]]))
        entropy.append(-(set_lp.exp() * set_lp).sum())
    return torch.stack(target_lp), torch.stack(top_lp), torch.stack(entropy).detach()


def _finite_weighted_sum(outputs, gen_seed: int = 1):
    """A scalar using every finite output with a random weight (padding / -inf entries excluded)."""
    gen = torch.Generator().manual_seed(gen_seed)
    total = 0.0
    for out in outputs:
        weights = torch.randn(out.shape, generator=gen, dtype=out.dtype)
        total = total + torch.where(torch.isfinite(out), out * weights, torch.zeros_like(out)).sum()
    return total


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("use_mask", [False, True])
@pytest.mark.parametrize("chunk_size", [1, 8, 4096])
def test_chunked_matches_naive_values_and_gradients(temperature, use_mask, chunk_size):
    hidden, weight, targets, top_ids, mask = _case()
    mask = mask if use_mask else None
    chunked = policy_token_logprobs(hidden, weight, targets, temperature, top_ids, mask, chunk_size=chunk_size)
    naive = naive_token_logprobs(hidden, weight, targets, temperature, top_ids, mask)
    for got, want in zip(chunked, naive):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    grads = torch.autograd.grad(_finite_weighted_sum(chunked[:2]), (hidden, weight))
    want_grads = torch.autograd.grad(_finite_weighted_sum(naive[:2]), (hidden, weight))
    for got, want in zip(grads, want_grads):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


def test_full_vocab_equals_log_softmax_over_tempered_logits():
    hidden, weight, targets, top_ids, _ = _case()
    logp = torch.log_softmax(hidden @ weight.T / 0.6, dim=-1)
    got, got_top, entropy = policy_token_logprobs(hidden, weight, targets, 0.6, top_ids, chunk_size=5)
    torch.testing.assert_close(got, logp.gather(1, targets[:, None]).squeeze(1))
    valid = top_ids >= 0
    torch.testing.assert_close(got_top[valid], logp.gather(1, top_ids.clamp_min(0))[valid])
    torch.testing.assert_close(entropy, -(logp.exp() * logp).sum(-1).detach())


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sampling_mask_renormalises_over_the_candidate_set(temperature):
    hidden, weight, targets, top_ids, mask = _case(seed=3)
    got = policy_token_logprobs(hidden, weight, targets, temperature, top_ids, mask, chunk_size=6)
    want = _restricted_reference(hidden, weight, targets, top_ids, mask, temperature)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)
    assert torch.isneginf(got[1][top_ids >= 0]).any(), "the case must include top ids outside the candidate set"
    # Gradient of the renormalised log p(y) against the reference loop.
    grad = torch.autograd.grad(_finite_weighted_sum(got[:2]), (hidden, weight))
    want_grad = torch.autograd.grad(_finite_weighted_sum(want[:2]), (hidden, weight))
    for a, b in zip(grad, want_grad):
        torch.testing.assert_close(a, b)


def test_gradcheck_with_mask_and_padding():
    gen = torch.Generator().manual_seed(5)
    hidden = torch.randn(6, 4, generator=gen, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(9, 4, generator=gen, dtype=torch.float64, requires_grad=True)
    targets = torch.tensor([0, 3, 8, 2, 5, 1])
    top_ids = torch.tensor([[1, 2], [3, -1], [8, 7], [0, 4], [5, 6], [-1, -1]])
    mask = torch.tensor([[0, 1, 2, 3], [3, 4, -1, -1], [8, 7, 6, -1], [2, 0, 4, 5], [5, 6, 1, 0], [1, 2, 3, 4]])

    def finite_outputs(h, w):
        lp, top, _ = policy_token_logprobs(h, w, targets, 0.8, top_ids, mask, chunk_size=4)
        return lp, top[torch.isfinite(top)]

    assert torch.autograd.gradcheck(finite_outputs, (hidden, weight))


def test_padding_ids_give_minus_inf_and_no_gradient():
    hidden, weight, targets, top_ids, mask = _case(seed=7)
    targets = targets.clone()
    targets[[0, 5]] = -1
    for sampling_mask in (None, mask):
        lp, top, entropy = policy_token_logprobs(hidden, weight, targets, 1.0, top_ids, sampling_mask, chunk_size=4)
        assert torch.isneginf(lp[[0, 5]]).all() and torch.isfinite(lp[targets >= 0]).all()
        assert torch.isneginf(top[top_ids < 0]).all()
        assert torch.isfinite(entropy).all()
        # An upstream gradient on padded outputs must be ignored, not turned into NaN.
        (grad_hidden,) = torch.autograd.grad((torch.where(torch.isfinite(lp), lp, 0.0)).sum()
                                             + torch.where(torch.isfinite(top), top, 0.0).sum(), (hidden,))
        assert torch.isfinite(grad_hidden).all()
        assert grad_hidden[0].abs().sum() > 0  # row 0 still has valid top ids
        lp, top, _ = policy_token_logprobs(hidden, weight, targets, 1.0, None, sampling_mask, chunk_size=4)
        (grad_hidden,) = torch.autograd.grad(lp.nan_to_num(neginf=0.0).sum(), (hidden,))
        assert (grad_hidden[[0, 5]] == 0).all()


def test_all_padding_mask_row_means_full_vocabulary():
    hidden, weight, targets, top_ids, mask = _case(seed=2)
    mask = mask.clone()
    mask[[1, 6]] = -1
    got = policy_token_logprobs(hidden, weight, targets, 0.9, top_ids, mask, chunk_size=4)
    full = policy_token_logprobs(hidden, weight, targets, 0.9, top_ids, None, chunk_size=4)
    for a, b in zip(got, full):
        torch.testing.assert_close(a[[1, 6]], b[[1, 6]])
    assert not torch.allclose(got[0][[0, 2]], full[0][[0, 2]])


def test_repeated_candidate_counts_once():
    hidden, weight, targets, top_ids, mask = _case(seed=4)
    repeated = torch.cat([mask, mask[:, :2]], dim=1)  # every row lists two candidates twice
    for a, b in zip(policy_token_logprobs(hidden, weight, targets, 1.0, top_ids, repeated),
                    policy_token_logprobs(hidden, weight, targets, 1.0, top_ids, mask)):
        torch.testing.assert_close(a, b)


def test_frozen_lm_head_and_float32():
    hidden, weight, targets, top_ids, mask = _case(seed=6, dtype=torch.float32)
    weight = weight.detach()
    lp, top, _ = policy_token_logprobs(hidden, weight, targets, 1.0, top_ids, mask, chunk_size=7)
    want_lp, want_top, _ = naive_token_logprobs(hidden, weight, targets, 1.0, top_ids, mask)
    assert lp.dtype == torch.float32
    torch.testing.assert_close(lp, want_lp)
    (grad,) = torch.autograd.grad(lp.sum(), (hidden,))
    (want,) = torch.autograd.grad(want_lp.sum(), (hidden,))
    torch.testing.assert_close(grad, want)


def test_rejects_bad_inputs():
    hidden, weight, targets, top_ids, _ = _case()
    with pytest.raises(ValueError, match="temperature"):
        policy_token_logprobs(hidden, weight, targets, 0.0)
    with pytest.raises(ValueError, match="targets"):
        policy_token_logprobs(hidden, weight, targets[:-1], 1.0)
    with pytest.raises(ValueError, match="top_ids"):
        policy_token_logprobs(hidden, weight, targets, 1.0, top_ids[:-1])


@pytest.mark.parametrize("use_mask", [False, True])
@pytest.mark.parametrize("keep_logits_bytes", [0, 2 * 8 * V * 8 + 100, 1 << 30])  # none, 2 of 4 chunks, all
@pytest.mark.parametrize("fused", [False, True])
def test_speed_options_give_the_same_values_and_gradients(use_mask, keep_logits_bytes, fused, monkeypatch):
    """Kept forward logits (all rows, or the whole chunks that fit) and the fused full-vocabulary passes change no
    value and no gradient (fused runs its pure-function form eagerly here; the compiled form is the same function
    under torch.compile)."""
    import grpo.kernels.logprobs as lp

    monkeypatch.setattr(lp, "_COMPILED", _EAGER_PASSES)
    hidden, weight, targets, top_ids, mask = _case()
    mask = mask if use_mask else None
    results = []
    for options in ({}, {"keep_logits_bytes": keep_logits_bytes, "fused": fused}):
        h, w = hidden.detach().clone().requires_grad_(), weight.detach().clone().requires_grad_()
        out = policy_token_logprobs(h, w, targets, 0.7, top_ids, mask, chunk_size=8, **options)
        _finite_weighted_sum([out[0], out[1]]).backward()
        results.append((*out, h.grad, w.grad))
    for got, want in zip(*results):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_one_block_head_survives_a_second_backward(monkeypatch):
    """All rows kept + fused = one block whose backward turns the kept logits into their gradient in place: a
    second backward through the same graph (retain_graph) recomputes them and gets the same gradients, and both
    equal the chunked path's."""
    import grpo.kernels.logprobs as lp

    monkeypatch.setattr(lp, "_COMPILED", _EAGER_PASSES)
    hidden, weight, targets, top_ids, _ = _case()
    h, w = hidden.detach().clone().requires_grad_(), weight.detach().clone().requires_grad_()
    out = lp.policy_token_logprobs(h, w, targets, 0.7, top_ids, chunk_size=8, keep_logits_bytes=1 << 30, fused=True)
    loss = _finite_weighted_sum([out[0], out[1]])
    first = torch.autograd.grad(loss, (h, w), retain_graph=True)
    second = torch.autograd.grad(loss, (h, w))
    h2, w2 = hidden.detach().clone().requires_grad_(), weight.detach().clone().requires_grad_()
    ref = lp.policy_token_logprobs(h2, w2, targets, 0.7, top_ids, chunk_size=8)
    want = torch.autograd.grad(_finite_weighted_sum([ref[0], ref[1]]), (h2, w2))
    for a, b, c in zip(first, second, want):
        torch.testing.assert_close(a, c, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(b, c, rtol=1e-12, atol=1e-12)


def test_fused_passes_compile_and_match_eager():
    """torch.compile of the fused passes (inductor; the C++ backend on CPU) against their eager form."""
    import grpo.kernels.logprobs as lp

    gen = torch.Generator().manual_seed(3)
    raw = torch.randn(37, 301, generator=gen)
    index = torch.randint(-1, 301, (37, 4), generator=gen)
    grad = torch.randn(37, 4, generator=gen).masked_fill(index < 0, 0.0)
    want = lp.fused_forward_reference(raw, index, 1 / 0.7)
    got = lp._fused_forward()(raw, index, 1 / 0.7)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lp._fused_grad()(raw, index, want[2], grad, 1 / 0.7),
                               lp.fused_grad_reference(raw, index, want[2], grad, 1 / 0.7), rtol=1e-5, atol=1e-5)
    neg_row_grad = -grad.sum(1, keepdim=True)
    into, eager = raw.clone(), raw.clone()
    lp._fused_probs_into()(into, want[2], neg_row_grad, 1 / 0.7)
    lp.fused_probs_into_reference(eager, want[2], neg_row_grad, 1 / 0.7)
    torch.testing.assert_close(into, eager, rtol=1e-5, atol=1e-5)
    # the in-place pass plus the scatter at the ids is the fused gradient
    torch.testing.assert_close(lp._block_grad_logits(raw.clone(), index, want[2], grad, 1 / 0.7),
                               lp.fused_grad_reference(raw, index, want[2], grad, 1 / 0.7), rtol=1e-5, atol=1e-5)


def test_kept_rows_are_whole_chunks_within_the_budget():
    """All rows when their logits fit, else the most whole chunks that do (so no chunk is half kept)."""
    from grpo.kernels.logprobs import _kept_rows

    assert _kept_rows(29, 10, 8, 290) == 29  # all fit
    assert _kept_rows(29, 10, 8, 289) == 24  # 3 whole chunks of 8
    assert _kept_rows(29, 10, 8, 79) == 0  # not even one chunk
    assert _kept_rows(29, 10, 8, 0) == 0


def test_partially_kept_logits_are_read_by_the_backward(monkeypatch):
    """With 2 of 4 chunks kept, the backward recomputes the logits of the other two only: two fewer [c, V]
    matmuls than without keeping (counted on the hidden @ weight.T products)."""
    import grpo.kernels.logprobs as lp

    hidden, weight, targets, top_ids, _ = _case()
    counts = []
    for keep in (0, 2 * 8 * V * 8):
        calls = [0]
        real_mm = torch.Tensor.__matmul__

        def counting(a, b, calls=calls):
            calls[0] += int(b.shape == (H, V))
            return real_mm(a, b)

        monkeypatch.setattr(torch.Tensor, "__matmul__", counting)
        h = hidden.detach().clone().requires_grad_()
        out = lp.policy_token_logprobs(h, weight.detach(), targets, 1.0, top_ids, chunk_size=8, keep_logits_bytes=keep)
        out[0].sum().backward()
        monkeypatch.setattr(torch.Tensor, "__matmul__", real_mm)
        counts.append(calls[0])
    assert counts == [4, 2]
