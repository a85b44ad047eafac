"""grpo/kernels/gdn_fla.py: FLA's Gated DeltaNet kernels over a trie row in one pass (its state kernels per level).

FLA's Triton kernels run in Triton's interpreter on CPU (tests/fla_interpret_tree.py, in a subprocess: fla-core
sits in a side folder, .venv/fla-cpu, that `scripts/install.sh cpu` fills). On a GPU the rule is checked against
FLA's per-level calls at run time (grpo/kernels/gdn_choice.py `_check_one_pass`) and in tests/test_gpu_step.py.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from fla_interpret import run_interpreted


def test_one_pass_rule_equals_the_reference_and_flas_per_level_calls():
    """On four trie rows (two groups of a shared prompt, not in level-major order; one shared prompt; a 7-level
    tree; nothing shared), with segments of 1 to 150 tokens and grouped heads: the one-pass rule's output and q, k, v,
    g, beta gradients equal the fp64 token-by-token recurrence along each path to fp32 rounding and FLA's public
    kernel called per level to 1e-6 (the same kernels on the same chunks); the plan's chunk tables are FLA's. A Qwen3.5
    GDN layer through grpo/kernels/gdn.py's tree forward: one pass == per level (output, input and weight gradients). Then
    the run-time check: passed, a rule 10 % off refused, an fla-core with other state-kernel arguments not used."""
    report = run_interpreted("fla_interpret_tree.py")
    rows = report["rows"]
    assert {r["levels"] for r in rows.values()} >= {1, 2, 7}
    assert {r["level_major"] for r in rows.values()} == {True, False}
    for name, r in rows.items():
        assert r["chunk_tables_equal_flas"], name
        assert max(r["vs_reference"].values()) < 1e-5, (name, r["vs_reference"])
        assert max(r["vs_per_level"].values()) < 1e-6, (name, r["vs_per_level"])
    assert report["layer_one_pass_vs_per_level"] < 1e-6  # a Qwen3.5 GDN layer: output, input and weight grads
    launches = report["launches"]  # Triton launches, forward + backward: each level past the first adds only the
    base = launches["nothing shared (one level)"]["one_pass"]  # state kernels (forward, its recompute, backward)
    assert launches["nothing shared (one level)"]["per_level"] == base
    for name, count in launches.items():
        assert count["one_pass"] == base + 3 * (count["levels"] - 1), (name, count)
        assert count["per_level"] == base * count["levels"], (name, count)
    settled = report["settled"]
    assert settled["error"] < 1e-6 and settled["passed"][0]
    assert "one pass per trie row" in settled["passed"][1]
    assert not settled["off"][0] and "failed its check" in settled["off"][1]
    assert not settled["other_fla"][0] and "other arguments" in settled["other_fla"][1]


@pytest.mark.parametrize("lengths", [[1], [64], [65, 1, 128, 3], [200, 64, 63, 129]])
def test_chunk_tables_cover_every_segment_in_whole_chunks(lengths):
    """Segment bounds, (segment, chunk) pairs and chunk offsets as FLA's varlen kernels read them: chunk j of segment
    s covers tokens cu[s] + 64 j .. min(cu[s] + 64 (j + 1), cu[s + 1]), every token in exactly one chunk."""
    from grpo.kernels.gdn_plan import _chunk_tables

    cu, chunk_indices, chunk_offsets = _chunk_tables(np.asarray(lengths, dtype=np.int64))
    assert cu.tolist() == np.concatenate([[0], np.cumsum(lengths)]).tolist()
    covered = []
    for n, (seg, j) in enumerate(chunk_indices.tolist()):
        assert chunk_offsets[seg] <= n < chunk_offsets[seg + 1] and n - chunk_offsets[seg] == j
        lo = int(cu[seg]) + 64 * j
        covered += range(lo, min(lo + 64, int(cu[seg + 1])))
    assert covered == list(range(sum(lengths)))


def test_plan_lists_levels_in_the_order_of_its_permutation():
    """The plan's level-major segment bounds are the ones its `order` permutation lays the row out in: each level's
    segments back to back, level after level (what the one-pass rule's varlen kernels read)."""
    import random

    from test_gdn import _sample, multi_level

    from grpo.kernels.gdn import plan_tree_scan
    from grpo.trie import pack_samples

    row = pack_samples([_sample(t) for t in multi_level(random.Random(3))])
    plan = plan_tree_scan(row.token_pred, row.cu_seqlens_q, row.seg_parent, 4)
    flat = torch.cat([level.flat_index for level in plan.levels])
    assert torch.equal(flat, plan.order)
    per_level = [int(level.cu_seqlens_cpu[-1]) for level in plan.levels]
    bounds = plan.seg_cu_seqlens.tolist()
    assert [bounds[i] for i in plan.level_segments] == np.concatenate([[0], np.cumsum(per_level)]).tolist()
    assert len(plan.level_segments) == len(plan.levels) + 1 and plan.level_segments[-1] == len(row.seg_parent)


def test_without_fla_there_is_no_one_pass_rule():
    """Where `fla` does not import (this CPU test environment), `fla_tree_kernels` is None: nothing reaches FLA."""
    from grpo.kernels.gdn_fla import fla_tree_kernels

    try:
        import fla  # noqa: F401
    except ImportError:
        assert fla_tree_kernels() is None
    else:
        pytest.skip("fla imports here")


@pytest.mark.parametrize("kind", ["shared_prompt", "multi_level", "nothing_shared"])
def test_the_conv_runs_on_the_row_in_level_major_order(kind):
    """With the one-pass rule a GDN layer runs on its row in level-major order (grpo/kernels/gdn.py `tree_gdn_forward`): the
    tree conv there, with the plan's `ordered_*` tables, equals the conv of the row in its own order, permuted
    (fp64: the contiguous conv and the recomputed rows alike)."""
    import random

    from test_gdn import TRIES, _sample

    from grpo.kernels.gdn import plan_tree_scan, tree_causal_conv1d
    from grpo.trie import pack_samples

    row = pack_samples([_sample(t) for t in TRIES[kind](random.Random(4))])
    plan = plan_tree_scan(row.token_pred, row.cu_seqlens_q, row.seg_parent, 4)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(row.num_tokens, 6, generator=gen, dtype=torch.float64)
    weight = torch.randn(6, 4, generator=gen, dtype=torch.float64)
    in_row_order = tree_causal_conv1d(x, weight, None, "silu", plan.conv_index, plan.conv_fix_index)
    ordered = tree_causal_conv1d(x[plan.order], weight, None, "silu", plan.ordered_conv_index,
                                 plan.ordered_conv_fix_index)
    torch.testing.assert_close(ordered, in_row_order[plan.order], rtol=1e-12, atol=1e-12)
    if not plan.level_major:  # children no longer follow their parents: their first taps are recomputed
        assert plan.ordered_conv_fix_index.numel() > 0
