"""builtin:word_problems: answers checked against an independent reading of each question, disjoint splits, and
the default `accuracy` reward scoring the task's answers right on hand cases."""

import random
import re

import pytest

from grpo.data import load_prompts
from grpo.rewards import accuracy_reward
from grpo.word_problems import WordProblemConfig, word_problem, word_problems_heldout_rows, word_problems_rows


def solve(question: str) -> int:
    """Reference: the answer read off the question's wording and numbers, written apart from the generator."""
    n = [int(x) for x in re.findall(r"\d+", question)]
    if "then loses" in question:
        return n[0] + n[1] - n[2]
    if "packs of" in question:
        return n[0] * n[1] - n[2]
    if "more" in question:
        return n[0] + n[1]
    if "away" in question:
        return n[0] - n[1]
    if "bags with" in question:
        return n[0] * n[1]
    if "equally among" in question:
        assert n[0] % n[1] == 0, question
        return n[0] // n[1]
    raise AssertionError(f"unknown wording: {question}")


def question_of(row) -> str:
    return row["prompt"][0]["content"].split("\n")[0]


@pytest.mark.parametrize("config", [WordProblemConfig(), WordProblemConfig(max_value=99, two_step_share=0.9)])
def test_answers_match_an_independent_reading(config):
    rows = word_problems_rows(2000, seed=3, config=config)
    assert all(int(row["solution"]) == solve(question_of(row)) for row in rows)
    assert all(int(row["solution"]) >= 0 for row in rows)
    largest = max(max(int(x) for x in re.findall(r"\d+", question_of(row))) for row in rows)
    assert largest <= max(config.max_value, 81)
    kinds = {"two" if ("then loses" in question_of(r) or "packs of" in question_of(r)) else "one" for r in rows}
    assert kinds == {"one", "two"}


def test_two_step_share_is_respected():
    rng = random.Random(0)
    config = WordProblemConfig(two_step_share=0.3)
    share = sum(("then loses" in q or "packs of" in q) for q, _ in (word_problem(rng, config) for _ in range(4000)))
    assert abs(share / 4000 - 0.3) < 0.03


def test_heldout_split_is_disjoint_and_registered():
    train = load_prompts("builtin:word_problems")
    held_out = load_prompts("builtin:word_problems_heldout")
    train_texts = {row["prompt"][0]["content"] for row in train}
    held_texts = [row["prompt"][0]["content"] for row in held_out]
    assert len(train) == 4096 and len(held_out) == 512
    assert not train_texts & set(held_texts)
    assert len(set(held_texts)) == len(held_texts)
    assert held_out[:256] == word_problems_heldout_rows()[:256]  # deterministic: the baseline's 256 are fixed
    assert all(row["task"] == "word_problems" and row["solution"] for row in held_out)


def test_accuracy_reward_scores_the_task_on_hand_cases():
    solution = "17"
    completions = ["She has 21 - 4 = 17 left. \\boxed{17}", "\\boxed{16}", "21 - 4 = 17, so the answer is 17.",
                   "Start with 17 cards, then \\boxed{18}", "I am not sure.", "\\boxed{17 cards}"]
    # the last: math-verify does not parse a unit inside the box, hence the prompt's "a single number"
    expected = [1.0, 0.0, 1.0, 0.0, 0.0, 0.0]
    rewards = accuracy_reward([[{"role": "assistant", "content": c}] for c in completions],
                              solution=[solution] * len(completions))
    assert rewards == expected


def test_the_cli_names_reach_the_run_inputs():
    """`--dataset builtin:word_problems --eval-dataset builtin:word_problems_heldout` with the default reward name:
    train.py's input resolution accepts them and the reward finds its column in both splits."""
    import tyro

    from grpo.config import config_class
    from grpo.inputs import resolve_inputs
    from grpo.rewards import check_reward_columns

    argv = ["--model", "m", "--dataset", "builtin:word_problems", "--reward-funcs", "accuracy",
            "--eval-dataset", "builtin:word_problems_heldout"]
    cls, args = config_class(argv)
    config = tyro.cli(cls, args=args)
    funcs, rows, _, _, _ = resolve_inputs(config, None, None, None, None, None)
    assert funcs == [accuracy_reward] and len(rows) == 4096
    held_out = load_prompts(config.eval_dataset, config.eval_dataset_split)
    check_reward_columns(funcs, held_out[0].keys())
