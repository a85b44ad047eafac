"""The split attention's merge kernel (grpo/kernels/split_merge.py, Triton) == its definition (`merge_in_place`).

On CPU the kernel runs in Triton's interpreter; the GPU test of tests/test_tree_split.py runs it compiled, inside
the whole split against the fp64 reference.
"""

from __future__ import annotations

import pytest
import torch

from grpo.kernels.tree_split import merge_in_place

pytest.importorskip("triton")


@pytest.fixture
def interpreted(monkeypatch):
    """`merge_rows_triton` with its kernel built under Triton's interpreter (and rebuilt afresh after)."""
    from grpo.kernels import split_merge

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    split_merge._kernel.cache_clear()
    yield split_merge.merge_rows_triton
    split_merge._kernel.cache_clear()


def _parts(n, heads, dim, dtype, parent, gen):
    out_a, out_b = (torch.randn(n, heads, dim, generator=gen).to(dtype) for _ in range(2))
    lse_a, lse_b = (4 * torch.randn(heads, n, generator=gen) for _ in range(2))
    lse_b[:, ~parent] = float("inf")  # FlashAttention's lse for a query without keys ...
    out_b[~parent] = float("nan")  # ... and anything at all in its output: the merge must not read it
    return out_a, lse_a, out_b, lse_b


@pytest.mark.parametrize("n, heads, dim",
                         [(0, 2, 128), (1, 1, 128), (37, 3, 24), (130, 2, 128), (65, 4, 80), (9, 2, 256)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("pattern", ["random", "none", "all"])
def test_triton_merge_equals_the_definition(interpreted, n, heads, dim, dtype, pattern):
    """Odd token counts (a partial last block), head dims that are not powers of two, rows where no token, every
    token or a random half has a parent; NaN/+inf where part 2 has no keys never leak."""
    gen = torch.Generator().manual_seed(n * dim)
    parent = {"random": torch.rand(n, generator=gen) < 0.5, "none": torch.zeros(n, dtype=torch.bool),
              "all": torch.ones(n, dtype=torch.bool)}[pattern]
    parts = _parts(n, heads, dim, dtype, parent, gen)
    want_out, want_lse = merge_in_place(*parts, parent)
    got_out, got_lse = interpreted(*parts, parent)
    assert got_out.dtype == dtype and got_lse.dtype == torch.float32
    assert got_out.shape == want_out.shape and got_lse.shape == want_lse.shape
    assert torch.isfinite(got_out).all() and torch.isfinite(got_lse).all()
    torch.testing.assert_close(got_lse, want_lse, atol=1e-5, rtol=1e-6)
    ulp = 1e-5 if dtype == torch.float32 else 2 ** -7  # bf16: the two round the same fp32 value, or one ulp apart
    assert ((got_out.float() - want_out.float()).abs() <= ulp * want_out.float().abs().clamp_min(1)).all()
    if pattern == "none":
        assert torch.equal(got_out, parts[0]) and torch.equal(got_lse, parts[1])


def test_triton_merge_is_the_softmax_over_both_key_sets(interpreted):
    """From first principles: two attention partials over disjoint key sets merge into the attention over their
    union (fp32, one head, keys split 5 / 3)."""
    gen = torch.Generator().manual_seed(3)
    q, k, v = torch.randn(6, 16, generator=gen), torch.randn(8, 16, generator=gen), torch.randn(8, 16, generator=gen)
    s = q @ k.T

    def partial(cols):
        return (torch.softmax(s[:, cols], -1) @ v[cols])[:, None], torch.logsumexp(s[:, cols], -1)[None]

    (out_a, lse_a), (out_b, lse_b) = partial(slice(0, 5)), partial(slice(5, 8))
    out, lse = interpreted(out_a, lse_a, out_b, lse_b, torch.ones(6, dtype=torch.bool))
    torch.testing.assert_close(out[:, 0], torch.softmax(s, -1) @ v, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse[0], torch.logsumexp(s, -1), atol=1e-5, rtol=1e-6)
