"""Prefix-trie packing invariants against a naive per-token trie (docs/design.md §7)."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from grpo.samples import TrainingSample
from grpo.trie import pack_samples
from test_tree_attention import random_row_samples


def naive_layout(samples):
    """Per-token dict trie keyed by (token, next token), DFS pre-order with children in insertion order.
    Returns [(token, depth)] in packed order and, per sample, its packed indices."""
    root: dict = {}
    for s in samples:
        node = root
        ids = list(s.input_ids)
        for d, tok in enumerate(ids):
            key = (tok, ids[d + 1] if d + 1 < len(ids) else None)
            node = node.setdefault(key, {})
    order, index_of = [], {}

    def visit(node, prefix):
        for key, child in node.items():
            index_of[prefix + (key,)] = len(order)
            order.append((key[0], len(prefix)))
            visit(child, prefix + (key,))

    visit(root, ())
    paths = []
    for s in samples:
        ids, prefix, path = list(s.input_ids), (), []
        for d, tok in enumerate(ids):
            prefix = prefix + ((tok, ids[d + 1] if d + 1 < len(ids) else None),)
            path.append(index_of[prefix])
        paths.append(path)
    return order, paths


KINDS = ["shared_prompt", "multi_turn", "nothing_shared"]


@pytest.mark.parametrize("kind", KINDS)
def test_layout_matches_naive_trie(kind):
    rng = random.Random(1)
    for _ in range(50):
        samples = random_row_samples(rng, kind)
        row = pack_samples(samples)
        order, paths = naive_layout(samples)
        assert row.input_ids.tolist() == [t for t, _ in order]
        assert row.position_ids.tolist() == [d for _, d in order]
        assert [p.tolist() for p in row.sample_paths()] == paths
        assert row.num_tokens == len(order)  # unique-token count
        assert row.packing_ratio == pytest.approx(sum(len(s) for s in samples) / len(order))
        assert row.attention_cost == sum(d + 1 for _, d in order)


@pytest.mark.parametrize("kind", KINDS)
def test_paths_masks_and_metadata_agree(kind):
    rng = random.Random(2)
    for _ in range(30):
        samples = random_row_samples(rng, kind)
        row = pack_samples(samples)
        mask = row.ancestor_mask()
        for s, path in zip(samples, row.sample_paths()):
            assert row.input_ids[path].tolist() == s.input_ids  # every path is the sample's tokens
            assert row.position_ids[path].tolist() == list(range(len(s)))  # position = depth
            for j, q in enumerate(path.tolist()):
                assert torch.nonzero(mask[q])[:, 0].tolist() == sorted(path[: j + 1].tolist())
                assert row.token_pred[q] == (path[j - 1] if j else -1)
        cu_q, cu_k = row.cu_seqlens_q.tolist(), row.cu_seqlens_k.tolist()
        for seg in range(row.num_segments):
            seg_path = row.kv_index[cu_k[seg]:cu_k[seg + 1]]
            own = list(range(cu_q[seg], cu_q[seg + 1]))
            assert seg_path[-len(own):].tolist() == own  # segment is the tail of its path
            assert torch.nonzero(mask[own[-1]])[:, 0].tolist() == sorted(seg_path.tolist())
            parent = int(row.seg_parent[seg])
            expect_prefix = row.kv_index[cu_k[parent]:cu_k[parent + 1]].tolist() if parent >= 0 else []
            assert seg_path[: len(seg_path) - len(own)].tolist() == expect_prefix
        assert row.max_seqlen_q == max(np.diff(cu_q)) and row.max_seqlen_k == max(np.diff(cu_k))
        for packed in (row, pack_samples(samples, share_prefixes=False)):  # attention reads K/V in place exactly here
            identity = packed.kv_index.tolist() == list(range(packed.num_tokens))
            assert packed.kv_is_identity == identity == bool((packed.seg_parent < 0).all())
        assert row.cu_seqlens_q.dtype == torch.int32 and row.cu_seqlens_k.dtype == torch.int32


def test_loss_terms_keep_targets_advantages_and_logprobs():
    rng = random.Random(3)
    for _ in range(30):
        samples = random_row_samples(rng, "multi_turn")
        for s in samples:
            s.sampler_logprobs = [rng.uniform(-5, 0) for _ in s.input_ids]
        row = pack_samples(samples)
        expect = []
        for sid, (s, path) in enumerate(zip(samples, row.sample_paths())):
            for i in range(1, len(s)):
                if s.completion_mask[i]:
                    expect.append((int(path[i - 1]), s.input_ids[i], s.sampler_logprobs[i], s.advantage, sid))
        got = list(zip(row.token_index.tolist(), row.targets.tolist(), row.sampler_logprobs.tolist(),
                       row.advantages.tolist(), row.sample_id.tolist()))
        assert len(got) == len(expect) == row.num_loss_terms
        for g, e in zip(got, expect):
            assert g[0] == e[0] and g[1] == e[1] and g[4] == e[4]
            assert g[2] == pytest.approx(e[2], abs=1e-6) and g[3] == pytest.approx(e[3], abs=1e-6)
        assert (row.shift_labels[row.token_index] == row.targets).all()
        labelled = set(row.token_index.tolist())
        assert all((row.shift_labels[i] == -100) == (i not in labelled) for i in range(row.num_tokens))


def test_spec_example_layout():
    """The spec's two-rollout example: p3 is stored twice since it predicts a1 in one rollout, b1 in the other."""
    p1, p2, p3, a1, a2, b1, b2 = 11, 12, 13, 21, 22, 31, 32
    mk = lambda ids: TrainingSample(ids, [0, 0, 0, 1, 1], [0.0] * 5, 1.0, 0, 0)  # noqa: E731
    row = pack_samples([mk([p1, p2, p3, a1, a2]), mk([p1, p2, p3, b1, b2])])
    assert row.input_ids.tolist() == [p1, p2, p3, a1, a2, p3, b1, b2]
    assert row.position_ids.tolist() == [0, 1, 2, 3, 4, 2, 3, 4]
    assert row.cu_seqlens_q.tolist() == [0, 2, 5, 8]
    assert row.kv_index.tolist() == [0, 1, 0, 1, 2, 3, 4, 0, 1, 5, 6, 7]
    assert row.token_index.tolist() == [2, 3, 5, 6]
    assert row.num_raw_tokens == 10 and row.num_tokens == 8


def test_nothing_shared_is_plain_packing():
    rng = random.Random(4)
    samples = random_row_samples(rng, "shared_prompt")
    row = pack_samples(samples, share_prefixes=False)
    assert row.input_ids.tolist() == [t for s in samples for t in s.input_ids]
    assert row.position_ids.tolist() == [i for s in samples for i in range(len(s))]
    assert row.cu_seqlens_q.tolist() == row.cu_seqlens_k.tolist() == np.cumsum([0] + [len(s) for s in samples]).tolist()
    assert row.kv_index.tolist() == list(range(row.num_tokens))
    assert (row.seg_parent == -1).all() and row.packing_ratio == 1.0
    from grpo.tree_attention import _path_kv

    key = torch.randn(1, 2, row.num_tokens, 4)
    assert _path_kv(row, key, 2) is key  # nothing shared: attention reads K/V in place (no gather, no scatter-add)
    shared = pack_samples(samples)
    assert shared.num_loss_terms == row.num_loss_terms and torch.equal(shared.targets, row.targets)


def test_duplicate_and_prefix_samples():
    mk = lambda ids: TrainingSample(ids, [0] + [1] * (len(ids) - 1), [0.0] * len(ids), 0.5, 0, 0)  # noqa: E731
    row = pack_samples([mk([5, 6, 7]), mk([5, 6, 7]), mk([5, 6])])
    # duplicates share every node; [5, 6] forks at 5 (5 predicts 6 in both, but 6 predicts 7 vs end)
    assert row.input_ids.tolist() == [5, 6, 7, 6]
    assert row.num_loss_terms == 2 + 2 + 1


def test_top_logprobs_and_sampling_mask_padding():
    k = 3
    a = TrainingSample([1, 2, 3], [0, 1, 1], [0.0, -0.1, -0.2], 1.0, 0, 0,
                       sampler_top_ids=np.array([[-1] * k, [2, 4, 5], [3, 6, -1]]),
                       sampler_top_logprobs=np.array([[-np.inf] * k, [-0.1, -2, -3], [-0.2, -1.5, -np.inf]],
                                                     dtype=np.float32),
                       sampling_mask=[None, [2, 4], [3, 6, 7]])
    b = TrainingSample([1, 9], [0, 1], [0.0, -0.3], 1.0, 0, 0)
    row = pack_samples([a, b])
    assert row.sampler_top_ids.tolist() == [[2, 4, 5], [3, 6, -1], [-1, -1, -1]]
    assert row.sampler_top_logprobs[2].isinf().all()
    assert row.sampling_mask.tolist() == [[2, 4, -1], [3, 6, 7], [-1, -1, -1]]  # all -1 = full vocabulary
    plain = pack_samples([b])
    assert plain.sampler_top_ids is None and plain.sampling_mask is None


def test_to_keeps_sample_paths():
    row = pack_samples(random_row_samples(random.Random(5), "multi_turn"))
    moved = row.to("cpu")
    assert [p.tolist() for p in moved.sample_paths()] == [p.tolist() for p in row.sample_paths()]
    with pytest.raises(ValueError, match="at least one"):
        pack_samples([])


def test_to_device_packs_every_field_into_one_buffer_and_back():
    """`to_device`'s one-buffer path (what a CPU row takes to a GPU, forced here on CPU): every dtype, shape and
    None comes back equal, and all tensors are views of one storage (one copy)."""
    from grpo.trie import to_device

    row = pack_samples(random_row_samples(random.Random(7), "multi_turn"))
    odd = [torch.tensor([True, False, True]), torch.zeros(0, 3), torch.randn(2, 2, dtype=torch.float64)[:, 0],
           torch.tensor(3.5), torch.randn(5, dtype=torch.bfloat16), torch.randn(4, requires_grad=True), None]
    tensors = [v for v in vars(row).values() if isinstance(v, torch.Tensor)] + odd
    moved = to_device(tensors, "cpu", packed=True)
    storages = {t.untyped_storage().data_ptr() for t in moved if t is not None}
    assert len(storages) == 1
    for before, after in zip(tensors, moved):
        if before is None:
            assert after is None
            continue
        assert after.dtype == before.dtype and after.shape == before.shape
        assert torch.equal(after, before)


def test_plans_from_the_host_twin_equal_plans_from_the_row():
    """A GPU row keeps its CPU twin (`PackedRow.host`); the GDN plan built from it and moved in one copy equals the
    plan built where the row is, table for table."""
    from grpo.kernels.gdn import plan_tree_scan

    for kind in ("shared_prompt", "multi_turn", "nothing_shared"):
        row = pack_samples(random_row_samples(random.Random(3), kind))
        assert row.host is None and row.to("cpu").host is row
        direct = plan_tree_scan(row.token_pred, row.cu_seqlens_q, row.seg_parent, 4)
        moved = direct.to("cpu", packed=True)
        assert moved.level_major == direct.level_major and len(moved.levels) == len(direct.levels)
        for name in ("conv_index", "conv_fix_index", "unpermute"):
            assert torch.equal(getattr(moved, name), getattr(direct, name)), name
        for a, b in zip(moved.levels, direct.levels):
            for name in ("gather_index", "valid", "valid_index", "flat_index", "cu_seqlens", "cu_seqlens_cpu"):
                assert torch.equal(getattr(a, name), getattr(b, name)), name
            assert (a.parent_slot is None) == (b.parent_slot is None)
            assert a.parent_slot is None or torch.equal(a.parent_slot, b.parent_slot)
            assert a.flat_range == b.flat_range


@pytest.mark.parametrize("kind", ["shared_prompt", "multi_turn", "nothing_shared"])
def test_samples_published_with_arrays_pack_and_batch_the_same(kind):
    """What the rollout worker publishes (`with_arrays`, then a pickle round trip to the trainer) packs into the same
    row and closes the same micro-batches as the samples' lists; `arrays()` is their conversion; packing leaves
    the attached arrays as they were (a mask edited in place would change the next row)."""
    import pickle

    from grpo.batcher import TokenBudgetBatcher

    rng = random.Random(7)
    samples = random_row_samples(rng, kind)
    samples[0].completion_mask[0] = 1  # marked but never a loss term: packing must not clear it in place
    sent = [pickle.loads(pickle.dumps(TrainingSample(**{f: getattr(s, f) for f in s.__dataclass_fields__})
                                      .with_arrays())) for s in samples]
    for s, t in zip(samples, sent):
        ids, mask, logprobs = t.arrays()
        assert "_arrays" in t.__dict__ and "_arrays" not in s.__dict__  # travelled; the lists' sample kept none
        assert ids.tolist() == list(s.input_ids) and mask.tolist() == list(s.completion_mask)
        np.testing.assert_array_equal(logprobs, np.asarray(s.sampler_logprobs, dtype=np.float32))
        assert t.num_trained == s.num_trained and repr(t) == repr(s)  # fields only: the arrays are not shown
    before = [a.copy() for t in sent for a in t.arrays()]
    want, got = pack_samples(samples), pack_samples(sent)
    for name in ("input_ids", "position_ids", "shift_labels", "token_index", "targets", "sampler_logprobs",
                 "advantages", "sample_id", "kv_index", "cu_seqlens_q"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    for a, b in zip(before, (a for t in sent for a in t.arrays())):
        np.testing.assert_array_equal(a, b)
    plans = []
    for batch in (samples, sent):
        batcher, closed = TokenBudgetBatcher(64, 1), []
        for s in batch:
            if (rows := batcher.add(s)) is not None:
                closed.append([[x.key for x in r] for r in rows])
        plans.append(closed)
    assert plans[0] == plans[1]
