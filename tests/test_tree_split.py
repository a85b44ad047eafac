"""The split tree attention (grpo/kernels/tree_split.py) == the ancestor-mask attention, values and gradients.

On CPU the split runs the dense reference of FlashAttention's contract, so these tests check the split itself: the
index plan (children grouped by parent, each parent's path once), the log-sum-exp merge, and the backward run with
the merged output and lse. The GPU tests check torch's flash primitives against that reference.
"""

from __future__ import annotations

import random

import pytest
import torch

import grpo.trie as trie
from grpo.tree_attention import _BACKEND_FN, TreeContext
from grpo.kernels.tree_split import flash_backward, flash_forward, reference_backward, reference_forward
from grpo.trie import pack_samples
from tests.test_tree_attention import random_row_samples


def _attend(row, backend, q, k, v, scale=0.3):
    return _BACKEND_FN[backend](TreeContext(row=row, backend=backend), q, k, v, scale, None)  # [1, N, H, D]


def _row_paths(row) -> list[torch.Tensor]:
    return [row.kv_index[int(row.cu_seqlens_k[s]):int(row.cu_seqlens_k[s + 1])] for s in range(row.num_segments)]


def with_part2(row, plan: str):
    """`row` with its split plan rebuilt as `plan`: "grouped", or "in_place" (the runs plan, whatever the packer's
    rule would pick for this row)."""
    import dataclasses

    parent = row.seg_parent.tolist()
    cu_q, paths = row.cu_seqlens_q.long().numpy(), [p.numpy() for p in _row_paths(row)]
    if plan == "in_place" and any(p >= 0 for p in parent):
        fields = trie._ancestor_runs(parent, cu_q, paths)
    else:
        saved, trie.SPLIT_IN_PLACE = trie.SPLIT_IN_PLACE, False
        try:
            fields = {"anc_in_place": False, **trie._ancestor_groups(parent, cu_q, paths)}
        finally:
            trie.SPLIT_IN_PLACE = saved
    out = dataclasses.replace(row, **fields)
    out.sample_leaf = row.sample_leaf
    return out


@pytest.mark.parametrize("kind", ["shared_prompt", "multi_turn", "nothing_shared"])
@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (4, 2), (6, 1)])
@pytest.mark.parametrize("plan", ["packer", "grouped", "in_place"])
def test_split_equals_ancestor_mask_attention(kind, heads, kv_heads, plan):
    """Both part-2 plans (and the packer's choice between them) against the dense ancestor mask, fp64."""
    rng = random.Random(hash((kind, heads, kv_heads)) % 997)
    gen = torch.Generator().manual_seed(rng.randrange(1000))
    for _ in range(4):
        row = pack_samples(random_row_samples(rng, kind))
        row = row if plan == "packer" else with_part2(row, plan)
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


def _non_root_tokens(row) -> torch.Tensor:
    cu = row.cu_seqlens_q.long()
    return torch.cat([torch.arange(int(cu[s]), int(cu[s + 1])) for s in range(row.num_segments)
                      if row.seg_parent[s] >= 0] or [torch.zeros(0, dtype=torch.long)])


@pytest.mark.parametrize("kind", ["shared_prompt", "multi_turn", "nothing_shared"])
def test_each_parent_path_is_read_once(kind, monkeypatch):
    """Grouped: part 2's queries are every non-root token once; its keys are each parent's path once, so the split
    reads N + sum over parents of |path| keys where the path gather reads N + sum over segments of their
    ancestors."""
    monkeypatch.setattr(trie, "SPLIT_IN_PLACE", False)
    rng = random.Random(5)
    for _ in range(5):
        row = pack_samples(random_row_samples(rng, kind))
        parent = row.seg_parent
        assert not row.anc_in_place
        assert sorted(row.anc_q_index.tolist()) == _non_root_tokens(row).tolist()
        parents = sorted({int(p) for p in parent if p >= 0})
        paths = _row_paths(row)
        assert row.anc_kv_index.tolist() == (torch.cat([paths[p] for p in parents]).tolist() if parents else [])
        assert row.anc_kv_index.numel() + row.num_tokens <= row.kv_index.numel()
        assert row.anc_max_q == (int(row.anc_cu_q.diff().max()) if parents else 0)


@pytest.mark.parametrize("kind", ["shared_prompt", "multi_turn"])
def test_in_place_runs_cover_the_row(kind):
    """In place: the runs tile the row in order, each run's segments share one parent and its keys are that
    parent's path (none for roots); the mask marks exactly the non-root tokens. Where every parent's children lie
    together (every two-level trie: shared prompts) the keys are the grouped plan's, and the packer picks it."""
    rng, checked = random.Random(7), []
    for _ in range(12):
        packed = pack_samples(random_row_samples(rng, kind))
        row = with_part2(packed, "in_place")
        assert row.anc_in_place
        assert row.anc_q_index.dtype == torch.bool
        assert row.anc_q_index.nonzero().flatten().tolist() == _non_root_tokens(row).tolist()
        bounds, cu_k = row.anc_cu_q.long().tolist(), row.anc_cu_k.long().tolist()
        assert bounds[0] == 0 and bounds[-1] == row.num_tokens and bounds == sorted(bounds)
        cu, parent, paths = row.cu_seqlens_q.long().tolist(), row.seg_parent.tolist(), _row_paths(row)
        for r in range(len(bounds) - 1):
            segs = [s for s in range(row.num_segments) if bounds[r] <= cu[s] < bounds[r + 1]]
            assert len({parent[s] for s in segs}) == 1
            keys = row.anc_kv_index[cu_k[r]:cu_k[r + 1]].tolist()
            assert keys == (paths[parent[segs[0]]].tolist() if parent[segs[0]] >= 0 else [])
        grouped = with_part2(packed, "grouped")
        parents = {p for p in parent if p >= 0}
        if parents and all(parent[p] < 0 for p in parents):  # two levels: every parent a root
            checked.append(kind)
            assert row.anc_kv_index.tolist() == grouped.anc_kv_index.tolist()
            assert packed.anc_in_place
        if packed.anc_in_place:  # the packer's rule: in place only where it gathers no more than grouped
            assert row.anc_kv_index.numel() <= grouped.anc_kv_index.numel() + grouped.anc_q_index.numel()
        else:
            assert not parents or row.anc_kv_index.numel() > grouped.anc_kv_index.numel()
    assert kind != "shared_prompt" or checked  # some two-level rows were drawn


def test_reference_contract_for_queries_without_keys():
    """A varlen sequence with queries and no keys (an in-place run of roots): out 0 and lse +inf, as
    FlashAttention writes them; no gradient reaches those queries."""
    q, k, v = torch.randn(7, 2, 4, dtype=torch.float64), torch.randn(5, 1, 4, dtype=torch.float64), \
        torch.randn(5, 1, 4, dtype=torch.float64)
    cu_q, cu_k = torch.tensor([0, 3, 7], dtype=torch.int32), torch.tensor([0, 0, 5], dtype=torch.int32)
    out, lse, _ = reference_forward(q, k, v, cu_q, cu_k, 4, 5, False, 0.5)
    assert out[:3].abs().max() == 0 and torch.isinf(lse[:, :3]).all() and (lse[:, :3] > 0).all()
    assert torch.isfinite(out[3:]).all() and torch.isfinite(lse[:, 3:]).all()
    dq, dk, dv = reference_backward(torch.randn_like(out), q, k, v, out, torch.zeros_like(lse), cu_q, cu_k, 4, 5,
                                    False, 0.5, None)
    assert dq[:3].abs().max() == 0 and dq[3:].abs().max() > 0


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
    more keys than queries and a sequence with no keys (an in-place run of roots: out 0, lse +inf)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    lens_q, lens_k = ([37, 64, 5], [37, 64, 5]) if causal else ([40, 130, 3, 50], [70, 9, 200, 0])
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


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["shared_prompt", "multi_turn"])
@pytest.mark.parametrize("merge", ["triton", "compiled"])
def test_flash_split_plans_on_gpu_match_the_reference(kind, merge, monkeypatch):
    """On CUDA (torch's FlashAttention, the in-place merge as the Triton kernel or torch.compile's) both part-2
    plans against the fp64 dense reference of the same split: output and gradients within bf16's error of their
    scale."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    import grpo.kernels.tree_split as tree_split
    from grpo.kernels.tree_split import split_attention

    monkeypatch.setattr(tree_split, "MERGE_KERNEL", merge)

    rng = random.Random(23)
    gen = torch.Generator().manual_seed(4)
    for _ in range(3):
        packed = pack_samples(random_row_samples(rng, kind))
        n = packed.num_tokens
        inputs = [torch.randn(n, h, 128, dtype=torch.float64, generator=gen) for h in (8, 2, 2)]
        probe = torch.randn(n, 8, 128, dtype=torch.float64, generator=gen)
        for plan in ("grouped", "in_place"):
            row = with_part2(packed, plan)
            results = []
            for device, dtype, flash in (("cpu", torch.float64, False), ("cuda", torch.bfloat16, True)):
                q, k, v = (x.to(device, dtype).requires_grad_() for x in inputs)
                out = split_attention(row.to(device), q, k, v, 128 ** -0.5, flash=flash)
                grads = torch.autograd.grad((out * probe.to(device, dtype)).sum(), (q, k, v))
                results.append([t.detach().double().cpu() for t in (out, *grads)])
            for name, ref, got in zip(("out", "dq", "dk", "dv"), *results):
                assert (got - ref).abs().max() <= 2e-2 * ref.abs().max(), f"{kind} {plan}: {name}"


@pytest.mark.parametrize("kind", ["shared_prompt", "nothing_shared"])
def test_split_custom_op_equals_the_eager_split_and_passes_opcheck(kind):
    """The custom op a compiled layer calls (`split_attention_in_graph`) == the eager autograd Function, values
    and gradients; `torch.library.opcheck` checks its schema, fake (shape) functions and autograd registration."""
    from grpo.kernels.tree_split import plan_tensors, split_attention, split_attention_in_graph

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
