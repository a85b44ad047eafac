"""Reward functions: a name registry (`--reward-funcs accuracy format`) plus import paths (`pkg.module:func`).

A reward function follows the spec's contract: keyword arguments `prompts`, `completions` (conversational:
lists of message dicts), `completion_ids`, and every dataset column except `prompt`; it returns one float per
completion, or None where it does not apply. They run in the rollout worker's threads, so they must be picklable
module-level callables, and `math_verify` is called with its signal-based timeouts off (signals only work in the
main thread).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from grpo.imports import resolve_import

RewardFunc = Callable[..., list[float | None]]


def completion_text(completion: list[dict[str, Any]] | str) -> str:
    """The text a completion ends with: its last assistant message's content (or the string itself)."""
    if isinstance(completion, str):
        return completion
    for message in reversed(completion):
        if message.get("role", "assistant") == "assistant" and isinstance(message.get("content"), str):
            return message["content"]
    return ""


# ---- accuracy (math): the spec's quick-start reward on trl-lib/DeepMath-103K's `solution` column -----------------


def accuracy_reward(completions: list, solution: list[str] | None = None, answer: list[str] | None = None,
                    **kwargs: Any) -> list[float | None]:
    """1.0 when the completion's final answer (its last `\\boxed{}` first, else the last expression) equals the
    reference under math-verify; None where the reference itself does not parse (the row is not scored)."""
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

    references = solution if solution is not None else answer
    if references is None:
        raise ValueError("the `accuracy` reward needs a `solution` (or `answer`) dataset column with the reference "
                         "answer; add one or pick another reward with --reward-funcs")
    # boxed_match_priority=0: a \boxed{} answer wins over any other expression in the completion.
    answer_config = [LatexExtractionConfig(boxed_match_priority=0), ExprExtractionConfig()]
    rewards: list[float | None] = []
    for completion, reference in zip(completions, references, strict=True):
        gold = parse(str(reference), parsing_timeout=None)
        if not gold:
            rewards.append(None)
            continue
        predicted = parse(completion_text(completion), extraction_config=answer_config, parsing_timeout=None)
        rewards.append(float(bool(predicted) and verify(gold, predicted, timeout_seconds=None)))
    return rewards


# ---- format: the DeepSeek-R1 reasoning format (spec, "Uso de una función de recompensa personalizada") -----------

_THINK_ANSWER = re.compile(r"^\s*<think>.*?</think>\s*<answer>.*?</answer>\s*$", re.DOTALL)


def format_reward(completions: list, **kwargs: Any) -> list[float]:
    """1.0 when the completion is `<think>...</think><answer>...</answer>` (DeepSeek-R1, arXiv 2501.12948)."""
    return [float(_THINK_ANSWER.match(completion_text(c)) is not None) for c in completions]


# ---- letters: the built-in synthetic task (`--dataset builtin:letters --reward-funcs letters`) --------------------


def letters_reward(completions: list, **kwargs: Any) -> list[float]:
    """Fraction of the completion's non-space characters that are ASCII letters (0 for an empty completion).

    Graded on purpose: 674 of the tiny tokenizer's 1024 tokens are digit strings (its corpus was half arithmetic),
    so a random policy scores about 0.13 with a spread inside every group, and GRPO has signal from step one.
    """
    rewards = []
    for completion in completions:
        chars = [c for c in completion_text(completion) if not c.isspace()]
        rewards.append(sum(c.isascii() and c.isalpha() for c in chars) / len(chars) if chars else 0.0)
    return rewards


REWARDS: dict[str, RewardFunc] = {
    "accuracy": accuracy_reward,
    "format": format_reward,
    "letters": letters_reward,
}


def resolve_reward(name_or_import_path: str) -> RewardFunc:
    """A registry name (`accuracy`) or an import path (`my_pkg.rewards:my_func`) -> the callable."""
    if name_or_import_path in REWARDS:
        return REWARDS[name_or_import_path]
    if ":" not in name_or_import_path:
        raise ValueError(f"unknown reward {name_or_import_path!r}: use one of {sorted(REWARDS)} or an import path "
                         f"'package.module:function'")
    func = resolve_import(name_or_import_path, "reward")
    if not callable(func):
        raise ValueError(f"reward {name_or_import_path!r} is not callable")
    return func
