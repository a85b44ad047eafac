"""fold_turns (docs/design.md §9): append vs fork, drift, every generated token trained exactly once."""

from __future__ import annotations

import random

import numpy as np
import pytest

from grpo.multiturn import fold_turns, parse_tool_calls
from grpo.samples import TurnRecord


def turn(prompt, out, mask=None, top=None, lp=None):
    return TurnRecord(prompt_ids=list(prompt), output_ids=list(out),
                      output_log_probs=lp if lp is not None else [-0.1 * (i + 1) for i in range(len(out))],
                      output_mask=mask, output_sampler_logprobs=top, finish_reason="stop")


def test_single_turn_layout():
    samples, stats = fold_turns([turn([1, 2, 3], [10, 11], lp=[-0.5, -0.25])])
    (s,) = samples
    assert s.input_ids == [1, 2, 3, 10, 11]
    assert s.completion_mask == [0, 0, 0, 1, 1]
    assert s.sampler_logprobs == [0.0, 0.0, 0.0, -0.5, -0.25]
    assert stats.transitions == 0 and stats.forks == 0


def test_append_extends_one_sample():
    t1 = turn([1, 2], [10, 11])
    t2 = turn([1, 2, 10, 11, 50, 51], [12])  # re-rendered prompt = history + tool response
    samples, stats = fold_turns([t1, t2])
    (s,) = samples
    assert s.input_ids == [1, 2, 10, 11, 50, 51, 12]
    assert s.completion_mask == [0, 0, 1, 1, 0, 0, 1]
    assert stats.transitions == 1 and stats.forks == 0 and stats.drift_tokens == [0]


def test_fork_starts_a_new_sample_and_counts_drift():
    t1 = turn([1, 2, 3], [10, 11, 12])
    t2 = turn([1, 2, 3, 10, 99, 50], [13, 14])  # template rewrote history after token 10
    samples, stats = fold_turns([t1, t2])
    assert len(samples) == 2
    assert samples[0].input_ids == [1, 2, 3, 10, 11, 12] and samples[0].num_trained == 3
    assert samples[1].input_ids == [1, 2, 3, 10, 99, 50, 13, 14]
    assert samples[1].completion_mask == [0] * 6 + [1, 1]  # earlier outputs are context only in the fork
    assert stats.forks == 1 and stats.drift_tokens == [6 - 4]


def test_untrained_sample_is_dropped_and_masked_outputs_are_context():
    t1 = turn([1], [5, 6], mask=[0, 0])
    t2 = turn([7, 8], [9], mask=[1])  # fork (prompt does not start with [1, 5, 6])
    samples, stats = fold_turns([t1, t2])
    assert len(samples) == 1 and samples[0].input_ids == [7, 8, 9]
    assert stats.drift_tokens == [3]


def test_top_logprobs_padding():
    top = [{4: -0.1, 5: -2.0, 6: -3.0}, {7: -0.5}]
    (s,) = fold_turns([turn([1, 2], [4, 7], top=top)], num_top=3)[0]
    assert s.sampler_top_ids.shape == (4, 3) and s.sampler_top_logprobs.dtype == np.float32
    assert s.sampler_top_ids[2].tolist() == [4, 5, 6]
    assert s.sampler_top_ids[3].tolist() == [7, -1, -1]
    assert np.isneginf(s.sampler_top_logprobs[3, 1:]).all()
    assert (s.sampler_top_ids[:2] == -1).all()


def test_missing_logprobs_for_trained_tokens_is_an_error():
    with pytest.raises(ValueError, match="sampler logprob"):
        fold_turns([TurnRecord(prompt_ids=[1], output_ids=[2, 3])])


@pytest.mark.parametrize("seed", range(20))
def test_every_generated_token_trained_exactly_once(seed):
    """Random conversations with random re-rendering: the trained (position, logprob) multiset equals the outputs."""
    rng = random.Random(seed)
    history, turns, expected = [rng.randrange(100) for _ in range(rng.randint(1, 5))], [], []
    for t in range(rng.randint(1, 6)):
        prompt = list(history)
        if t and rng.random() < 0.4:  # rewrite part of the history (drops reasoning / normalises whitespace)
            cut = rng.randrange(len(prompt))
            prompt = prompt[:cut] + [rng.randrange(100, 200) for _ in range(rng.randint(0, 3))]
        prompt += [rng.randrange(100) for _ in range(rng.randint(1, 3))]  # tool response + generation prompt
        out = [rng.randrange(1000) for _ in range(rng.randint(1, 4))]
        lp = [-rng.random() for _ in out]
        turns.append(turn(prompt, out, lp=lp))
        expected += list(zip(out, lp))
        history = prompt + out
    samples, stats = fold_turns(turns)
    trained = [(s.input_ids[i], s.sampler_logprobs[i]) for s in samples for i, m in enumerate(s.completion_mask) if m]
    assert sorted(trained) == sorted(expected)
    assert stats.transitions == len(turns) - 1 and len(samples) == stats.forks + 1


def test_parse_tool_calls():
    text = 'Let me compute.\n<tool_call>\n{"name": "multiply", "arguments": {"a": 3, "b": 4}}\n</tool_call>' \
           '<tool_call>{"name": "add", "arguments": "{\\"a\\": 1}"}</tool_call><tool_call>{oops}</tool_call>'
    content, calls = parse_tool_calls(text)
    assert content == "Let me compute."
    assert [(c.name, c.arguments) for c in calls[:2]] == [("multiply", {"a": 3, "b": 4}), ("add", {"a": 1})]
    assert calls[2].error is not None
    assert parse_tool_calls("plain answer") == ("plain answer", [])
