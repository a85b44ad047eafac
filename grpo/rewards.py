"""Reward functions: a name registry (`--reward-funcs accuracy format`) plus import paths (`pkg.module:func`).

A reward function follows the spec's contract: keyword arguments `prompts`, `completions` (conversational:
lists of message dicts), `completion_ids`, and every dataset column except `prompt`; it returns one float per
completion, or None where it does not apply. They run in the rollout worker's threads, so they must be picklable
module-level callables; `accuracy` runs math-verify in a helper process so its timeouts work (signals only work
in a main thread). The worker is not a daemon process, so a reward function may start processes of its own.
"""

from __future__ import annotations

import logging
import os
import re
import threading
import time
from collections.abc import Callable
from typing import Any

from grpo.imports import resolve_import

RewardFunc = Callable[..., list[float | None]]
log = logging.getLogger("grpo.rewards")


def completion_text(completion: list[dict[str, Any]] | str) -> str:
    """The text a completion ends with: its last assistant message's content (or the string itself)."""
    if isinstance(completion, str):
        return completion
    for message in reversed(completion):
        if message.get("role", "assistant") == "assistant" and isinstance(message.get("content"), str):
            return message["content"]
    return ""


# ---- accuracy (math): the spec's quick-start reward on trl-lib/DeepMath-103K's `solution` column -----------------


ACCURACY_TIMEOUT_S = 20.0
"""Seconds one completion's math-verify check may take (math-verify's own limits are 5 s for parsing and for
verifying each; this outer limit catches what they cannot interrupt)."""

_verifier = None  # concurrent.futures.ProcessPoolExecutor, created on first use in the process that scores
_verifier_lock = threading.Lock()
accuracy_timeouts = 0
"""Answers scored None because math-verify overran ACCURACY_TIMEOUT_S (this process)."""


def _verify_one(reference: str, completion: str) -> float | None:
    """Runs in the verifier process's main thread, where math-verify's signal-based timeouts work."""
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

    gold = parse(reference, parsing_timeout=5)
    if not gold:
        return None
    # boxed_match_priority=0: a \boxed{} answer wins over any other expression in the completion.
    answer_config = [LatexExtractionConfig(boxed_match_priority=0), ExprExtractionConfig()]
    predicted = parse(completion, extraction_config=answer_config, parsing_timeout=5)
    return float(bool(predicted) and verify(gold, predicted, timeout_seconds=5))


def _verifier_pool():
    global _verifier
    with _verifier_lock:
        if _verifier is None:
            import multiprocessing
            from concurrent.futures import ProcessPoolExecutor

            _verifier = ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn"),
                                            initializer=_exit_with_parent, initargs=(os.getpid(),))
        return _verifier


def _exit_with_parent(parent_pid: int, interval: float = 1.0) -> None:
    """Verifier-process initializer: exit when the scoring process is gone (killed, it cannot shut us down)."""
    def watch():
        while os.getppid() == parent_pid:
            time.sleep(interval)
        os._exit(3)

    threading.Thread(target=watch, name="parent-watchdog", daemon=True).start()


def _restart_verifier(stuck) -> None:
    """Kill a verifier process stuck past the timeout (a thread cannot be interrupted; a process can)."""
    global _verifier
    with _verifier_lock:
        if _verifier is stuck:
            for process in list(getattr(stuck, "_processes", {}).values()):
                process.kill()
            stuck.shutdown(wait=False, cancel_futures=True)
            _verifier = None


def accuracy_reward(completions: list, solution: list[str] | None = None, answer: list[str] | None = None,
                    **kwargs: Any) -> list[float | None]:
    """1.0 when the completion's final answer (its last `\\boxed{}` first, else the last expression) equals the
    reference under math-verify; None where the reference itself does not parse (the row is not scored) or the
    check overran ACCURACY_TIMEOUT_S (counted in `accuracy_timeouts`).

    math-verify runs in a helper process: its timeouts are signal-based and only work in a main thread, and the
    rollout worker scores in threads. A check that overruns kills the helper, which restarts on the next call."""
    global accuracy_timeouts
    from concurrent.futures import TimeoutError as FutureTimeout
    from concurrent.futures.process import BrokenProcessPool

    references = solution if solution is not None else answer
    if references is None:
        raise ValueError("the `accuracy` reward needs a `solution` (or `answer`) dataset column with the reference "
                         "answer; add one or pick another reward with --reward-funcs")
    rewards: list[float | None] = []
    for completion, reference in zip(completions, references, strict=True):
        pool = _verifier_pool()
        future = pool.submit(_verify_one, str(reference), completion_text(completion))
        try:
            rewards.append(future.result(timeout=ACCURACY_TIMEOUT_S))
        except (FutureTimeout, BrokenProcessPool):
            accuracy_timeouts += 1
            log.warning("math-verify overran %.0f s on a completion (%d so far): scored None",
                        ACCURACY_TIMEOUT_S, accuracy_timeouts)
            _restart_verifier(pool)
            rewards.append(None)
    return rewards


accuracy_reward.required_columns = ("solution", "answer")  # one of them


def check_reward_columns(reward_funcs, columns) -> None:
    """At start: every column a reward function needs is in the dataset (instead of failing in the worker)."""
    import inspect

    standard = {"prompts", "completions", "completion_ids", "trainer_state", "log_extra", "log_metric"}
    columns = set(columns)
    for func in reward_funcs:
        name = getattr(func, "__name__", type(func).__name__)
        any_of = getattr(func, "required_columns", None)
        if any_of and not columns & set(any_of):
            raise ValueError(f"reward {name!r} needs a dataset column named one of {list(any_of)} (columns: "
                             f"{sorted(columns)}); add it or pick another reward with --reward-funcs")
        try:
            params = inspect.signature(func).parameters.values()
        except (TypeError, ValueError):
            continue
        for p in params:
            if p.default is p.empty and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) \
                    and p.name not in standard and p.name not in columns:
                raise ValueError(f"reward {name!r} takes `{p.name}` but the dataset has no such column (columns: "
                                 f"{sorted(columns)}); add the column or give the parameter a default")


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
