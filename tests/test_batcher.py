"""TokenBudgetBatcher rules (docs/design.md §8), checked against the packed rows the trainer will forward."""

from __future__ import annotations

import logging
import random

import pytest

from grpo.batcher import TokenBudgetBatcher, dummy_sample
from grpo.samples import TrainingSample
from grpo.trie import pack_samples


def _sample(ids, group, trained=None):
    mask = [0] * len(ids) if trained is None else [0] * (len(ids) - trained) + [1] * trained
    return TrainingSample(list(ids), mask, [0.0] * len(ids), 1.0, group, 0)


def _group_stream(rng, n_groups, group_size, prompt_len=(5, 40), completion_len=(1, 30)):
    out = []
    for g in range(n_groups):
        prompt = [rng.randrange(10, 1000) for _ in range(rng.randint(*prompt_len))]
        for _ in range(group_size):
            comp = [rng.randrange(10, 1000) for _ in range(rng.randint(*completion_len))]
            out.append(_sample(prompt + comp, g, trained=len(comp)))
    return out


def _run(batcher, stream):
    batches = [b for s in stream if (b := batcher.add(s)) is not None]
    last = batcher.flush()
    return batches + ([last] if last else [])


@pytest.mark.parametrize("num_ranks", [1, 2, 4])
def test_budget_respected_no_empty_row_and_nothing_lost(num_ranks):
    rng = random.Random(num_ranks)
    stream = _group_stream(rng, 12, 6)
    batcher = TokenBudgetBatcher(token_budget=200, num_ranks=num_ranks)
    batches = _run(batcher, stream)
    seen = []
    for mb in batches:
        assert len(mb) == num_ranks
        for row_samples in mb:
            assert row_samples  # never an empty row
            row = pack_samples(row_samples)
            assert row.num_tokens <= 200 and row.num_loss_terms <= 200  # unique tokens, as the trie stores them
            seen += [s for s in row_samples if s.rollout_id != "dummy"]
    assert sorted(map(id, seen)) == sorted(map(id, stream))
    assert batcher.dropped_oversize_count == 0


def test_unique_token_count_matches_trie():
    rng = random.Random(0)
    batcher = TokenBudgetBatcher(token_budget=10_000, num_ranks=1)
    stream = _group_stream(rng, 1, 8, prompt_len=(50, 50))
    for s in stream:
        assert batcher.add(s) is None
    row = batcher._rows[0]
    packed = pack_samples(row.samples)
    assert row.unique_tokens == packed.num_tokens
    assert row.load == packed.attention_cost
    assert row.loss_terms == packed.num_loss_terms
    mb = batcher.flush()
    stats = batcher.last_stats
    assert len(mb[0]) == 8 and stats.packing_ratio == pytest.approx(packed.packing_ratio)
    assert stats.row_fill_frac == pytest.approx(packed.num_tokens / 10_000)


def test_group_affinity_and_empty_rows_first():
    batcher = TokenBudgetBatcher(token_budget=1000, num_ranks=2)
    a0, a1, b0, a2 = (_sample([1, 2, 3, 4], 0), _sample([1, 2, 3, 5], 0), _sample([7, 8], 1),
                      _sample([1, 2, 3, 6], 0))
    for s in (a0, a1, b0, a2):
        assert batcher.add(s) is None
    mb = batcher.flush()
    assert mb == [[a0, a1, a2], [b0]]  # a1 joins its group although an empty row exists; b0 takes the empty row


def test_closes_rather_than_raising_the_max_load():
    batcher = TokenBudgetBatcher(token_budget=1000, num_ranks=2)
    short0, short1 = _sample([1, 2], 0), _sample([3, 4], 1)
    long2 = _sample(list(range(10, 20)), 2)
    assert batcher.add(short0) is None and batcher.add(short1) is None
    closed = batcher.add(long2)  # would raise the max row load (3) in either row -> close
    assert closed == [[short0], [short1]]
    small3 = _sample([5], 3)
    assert batcher.add(small3) is None  # empty row of the new micro-batch
    tiny4 = _sample([6], 4)
    assert batcher.add(tiny4) is None  # load 1 + 1 <= max load 55: joins the least-loaded row
    assert batcher.flush() == [[long2], [small3, tiny4]]


def test_budget_overflow_moves_group_to_another_row():
    batcher = TokenBudgetBatcher(token_budget=10, num_ranks=2)
    first = _sample(list(range(20, 28)), 0)
    second = _sample(list(range(30, 38)), 0)  # same group, does not fit the group's row (8 + 8 > 10)
    assert batcher.add(first) is None and batcher.add(second) is None
    assert batcher.flush() == [[first], [second]]


def test_oversize_dropped_and_counted(caplog):
    batcher = TokenBudgetBatcher(token_budget=5, num_ranks=1)
    with caplog.at_level(logging.WARNING):
        assert batcher.add(_sample(list(range(6)), 0)) is None
    assert batcher.dropped_oversize_count == 1 and "token_budget" in caplog.text
    assert batcher.flush() is None


def test_flush_pads_with_zero_weight_dummy():
    batcher = TokenBudgetBatcher(token_budget=100, num_ranks=3)
    real = _sample([1, 2, 3], 0, trained=2)
    batcher.add(real)
    mb = batcher.flush()
    assert mb[0] == [real] and all(len(r) == 1 and r[0].rollout_id == "dummy" for r in mb[1:])
    for r in mb[1:]:
        assert pack_samples(r).num_loss_terms == 0 and r[0].advantage == 0.0
    assert batcher.last_stats.samples_per_row == 1.0
    assert dummy_sample(real).num_trained == 0


def test_stats_imbalance():
    rng = random.Random(9)
    batcher = TokenBudgetBatcher(token_budget=300, num_ranks=4)
    for mb in _run(batcher, _group_stream(rng, 10, 4)):
        assert mb
    stats = batcher.last_stats
    assert stats.row_imbalance >= 1.0
    metrics = stats.as_metrics()
    assert set(metrics) >= {"batch/row_imbalance", "batch/row_fill_frac", "batch/samples_per_row",
                            "batch/packing_ratio"}
