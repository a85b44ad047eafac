"""The split tree attention (grpo/tree_split.py) == the ancestor-mask attention, values and gradients.

On CPU the split runs the dense reference of FlashAttention's contract, so these tests check the split itself: the
index plan (children grouped by parent, each parent's path once), the log-sum-exp merge, and the backward run with
the merged output and lse. The GPU tests check torch's flash primitives against that reference.
"""

from __future__ import annotations

import random

import pytest
import torch

from grpo.tree_attention import _BACKEND_FN, TreeContext
from grpo.tree_split import flash_backward, flash_forward, reference_backward, reference_forward
from grpo.trie import pack_samples
from tests.test_tree_attention import random_row_samples


def _attend(row, backend, q, k, v, scale=0.3):
    return _BACKEND_FN[backend](TreeContext(row=row, backend=backend), q, k, v, scale, None)  # [1, N, H, D]


@pytest.mark.parametrize("kind", ["shared_prompt", "multi_turn", "nothing_shared"])
@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (4, 2), (6, 1)])
def test_split_equals_ancestor_mask_attention(kind, heads, kv_heads):
    rng = random.Random(hash((kind, heads, kv_heads)) % 997)
    gen = torch.Generator().manual_seed(rng.randrange(1000))
    for _ in range(4):
        row = pack_samples(random_row_samples(rng, kind))
        n, d = row.num_tokens, 8
        q = torch.randn(1, heads, n, d, dtype=torch.float64, generator=gen, requires_grad=True)
        k = torch.randn(1, kv_heads, n, d, dtype=torch.float64, generator=gen, requires_grad=True)
        v = torch.randn(1, kv_heads, n, d, dtype=torch.float64, generator=gen, requires_grad=True)
        probe = torch.randn(1, n, heads, d, dtype=torch.float64, generator=gen)
        results = []
        for backend in ("sdpa", "flash_split"):
            out = _attend(row, backend, q, k, v)
            results.append((out, *torch.autograd.grad((out * probe).sum(), (q, k, v))))
        for name, ref, got in zip(("out", "dq", "dk", "dv"), *results):
            torch.testing.assert_close(got, ref, atol=1e-12, rtol=0, msg=f"{kind}: {name}")


@pytest.mark.parametrize("kind", ["shared_prompt", "multi_turn", "nothing_shared"])
def test_each_parent_path_is_read_once(kind):
    """Part 2's queries are every non-root token once; its keys are each parent's path once, so the split reads
    N + sum over parents of |path| keys where the path gather reads N + sum over segments of their ancestors."""
    rng = random.Random(5)
    for _ in range(5):
        row = pack_samples(random_row_samples(rng, kind))
        parent = row.seg_parent
        cu = row.cu_seqlens_q.long()
        non_root = torch.cat([torch.arange(int(cu[s]), int(cu[s + 1])) for s in range(len(parent)) if parent[s] >= 0]
                             or [torch.zeros(0, dtype=torch.long)])
        assert sorted(row.anc_q_index.tolist()) == non_root.tolist()
        parents = sorted({int(p) for p in parent if p >= 0})
        paths = [row.kv_index[int(row.cu_seqlens_k[p]):int(row.cu_seqlens_k[p + 1])] for p in parents]
        assert row.anc_kv_index.tolist() == (torch.cat(paths).tolist() if paths else [])
        assert row.anc_kv_index.numel() + row.num_tokens <= row.kv_index.numel()
        assert row.anc_max_q == (int(row.anc_cu_q.diff().max()) if parents else 0)


def _varlen_inputs(lens_q, lens_k, heads, kv_heads, d, dtype, device, seed=0):
    gen = torch.Generator(device="cpu").manual_seed(seed)
    tq, tk = sum(lens_q), sum(lens_k)

    def make(*shape):
        return torch.randn(*shape, generator=gen).to(device, dtype)

    def cu(lens):
        return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=device)

    return make(tq, heads, d), make(tk, kv_heads, d), make(tk, kv_heads, d), cu(lens_q), cu(lens_k)


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [True, False])
def test_flash_primitives_follow_the_reference_contract(causal):
    """torch's FlashAttention varlen forward (out, lse [H, T_q]) and backward from a GIVEN out/lse (the merged ones
    in the split) against the dense reference, bf16 inputs, GQA, causal with equal lengths and non-causal with
    more keys than queries."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    lens_q, lens_k = ([37, 64, 5], [37, 64, 5]) if causal else ([40, 130, 3], [70, 9, 200])
    q, k, v, cu_q, cu_k = _varlen_inputs(lens_q, lens_k, 8, 2, 128, torch.bfloat16, "cuda")
    scale = 128 ** -0.5
    args = (cu_q, cu_k, max(lens_q), max(lens_k), causal, scale)
    out, lse, aux = flash_forward(q, k, v, *args)
    ref_out, ref_lse, _ = reference_forward(q.double(), k.double(), v.double(), *args)
    torch.testing.assert_close(lse.double(), ref_lse, atol=2e-2, rtol=0)
    torch.testing.assert_close(out.double(), ref_out, atol=3e-2, rtol=0)
    dout = torch.randn_like(out)
    got = flash_backward(dout, q, k, v, out, lse, *args, aux)
    ref = reference_backward(dout.double(), q.double(), k.double(), v.double(), out.double(), lse.double(), *args,
                             None)
    for name, g, r in zip(("dq", "dk", "dv"), got, ref):
        scale_r = r.abs().max().item()
        assert (g.double() - r).abs().max().item() <= 3e-2 * scale_r, name


@pytest.mark.parametrize("kind", ["shared_prompt", "nothing_shared"])
def test_split_custom_op_equals_the_eager_split_and_passes_opcheck(kind):
    """The custom op a compiled layer calls (`split_attention_in_graph`) == the eager autograd Function, values
    and gradients; `torch.library.opcheck` checks its schema, fake (shape) functions and autograd registration."""
    from grpo.tree_split import plan_tensors, split_attention, split_attention_in_graph

    rng = random.Random(11)
    row = pack_samples(random_row_samples(rng, kind))
    gen = torch.Generator().manual_seed(3)
    n = row.num_tokens
    q, k, v = (torch.randn(n, h, 8, dtype=torch.float64, generator=gen, requires_grad=True) for h in (4, 2, 2))
    probe = torch.randn(n, 4, 8, dtype=torch.float64, generator=gen)
    results = []
    for fn in (lambda: split_attention(row, q, k, v, 0.3, flash=False),
               lambda: split_attention_in_graph(plan_tensors(row), q, k, v, 0.3, False)):
        out = fn()
        results.append((out, *torch.autograd.grad((out * probe).sum(), (q, k, v))))
    for name, ref, got in zip(("out", "dq", "dk", "dv"), *results):
        torch.testing.assert_close(got, ref, atol=1e-12, rtol=0, msg=name)
    args = (q.detach().requires_grad_(), k.detach().requires_grad_(), v.detach().requires_grad_(),
            *plan_tensors(row), 0.3, False)
    torch.library.opcheck(torch.ops.grpo.split_attention.default, args)
