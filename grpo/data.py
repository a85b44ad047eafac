"""Prompt datasets: a Hub name, a local json/jsonl/parquet file (or directory), or a built-in synthetic task.

Prompts must be conversational (`prompt` = a list of `{"role", "content"}` messages, spec "Compatibilidad y
restricciones"); every other column is kept and reaches the reward functions as a keyword argument.
`datasets` is imported inside the functions (CLI `--help` stays fast).
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

_LOCAL_BUILDERS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv"}


def load_prompts(name_or_path: str, split: str = "train", require_prompt: bool = True):
    """Load and validate a prompt dataset -> `datasets.Dataset`.

    `require_prompt=False` is for an environment_factory whose `reset()` provides the prompt (spec).
    """
    if name_or_path.startswith("builtin:"):
        dataset = builtin_dataset(name_or_path.removeprefix("builtin:"))
        validate_prompts(dataset, name_or_path, require_prompt)
        return dataset
    import datasets

    if Path(name_or_path).is_file():
        path = Path(name_or_path)
        builder = _LOCAL_BUILDERS.get(path.suffix.lower())
        if builder is None:
            raise ValueError(f"unsupported dataset file {path.name!r}: use one of {sorted(_LOCAL_BUILDERS)}")
        # A local file holds one split; it is named after the requested one.
        dataset = datasets.load_dataset(builder, data_files={split: str(path)}, split=split)
    else:
        dataset = datasets.load_dataset(name_or_path, split=split)
    validate_prompts(dataset, name_or_path, require_prompt)
    return dataset


def validate_prompts(dataset, source: str = "dataset", require_prompt: bool = True) -> None:
    """Raise a ValueError naming the row and the fix unless the dataset is non-empty and every `prompt` holds
    conversational messages. Works on a `datasets.Dataset` or a list of row dicts (the Python API)."""
    if dataset is None:
        return
    if len(dataset) == 0:
        raise ValueError(f"{source} is empty: there is nothing to train on (check the split name and the file)")
    columns = dataset_columns(dataset)
    if "prompt" not in columns:
        if not require_prompt:
            return
        raise ValueError(f"{source} has no `prompt` column (columns: {sorted(columns)}); rename the column holding "
                         f"the messages to `prompt`, e.g. dataset.rename_column('question', 'prompt')")
    prompts = dataset["prompt"] if hasattr(dataset, "column_names") else [row.get("prompt") for row in dataset]
    for index, prompt in enumerate(prompts):
        check_conversation(prompt, f"{source} row {index}")


def dataset_columns(dataset) -> set[str]:
    """Column names of a `datasets.Dataset`, or the union of the keys of a list of row dicts."""
    if hasattr(dataset, "column_names"):
        return set(dataset.column_names)
    rows = list(dataset[:1]) if not isinstance(dataset, list) else dataset[:1]
    if not isinstance(rows[0], dict):
        raise ValueError(f"dataset rows must be dicts with a `prompt` key, got {type(rows[0]).__name__}")
    return set().union(*(row.keys() for row in (dataset if isinstance(dataset, list) else rows)))


def check_conversation(prompt: Any, where: str) -> None:
    if isinstance(prompt, str):
        raise ValueError(f"{where}: `prompt` is a plain string; prompts must be conversational. Wrap it: "
                         f"dataset.map(lambda row: {{'prompt': [{{'role': 'user', 'content': row['prompt']}}]}})")
    if not isinstance(prompt, list | tuple) or not prompt:
        raise ValueError(f"{where}: `prompt` must be a non-empty list of messages, got {type(prompt).__name__}")
    for message in prompt:
        if not isinstance(message, dict) or "role" not in message or "content" not in message:
            raise ValueError(f"{where}: every prompt message needs `role` and `content` keys, got {message!r}")


# ---- built-in synthetic tasks ---------------------------------------------------------------------------------------

_WORDS = ("the and that with from this what some other word have they one out can was for are but his you had "
          "cat sun tree river stone light house water bird green").split()


def letters_rows(num_rows: int = 1024, seed: int = 0) -> list[dict[str, Any]]:
    """`builtin:letters`: instructions to answer in words only, scored by the `letters` reward.

    Designed for a randomly initialised tiny model: the reward is graded and a random policy already scores about
    0.13 with spread inside each group, so GRPO learns it in about 100 steps (measured with a REINFORCE-with-
    group-baseline loop on the 0.5M-parameter tiny Qwen3 at lr 1e-3: 0.135 -> 0.998). The trailing words make
    prompts distinct without changing the task.
    """
    rng = random.Random(seed)
    openers = ("Answer with English words only.", "Reply in words, no numbers.", "Use only letters in your reply.",
               "Write a few words, no digits.")
    rows = []
    for _ in range(num_rows):
        words = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(1, 4)))
        rows.append({"prompt": [{"role": "user", "content": f"{rng.choice(openers)} {words}"}], "task": "letters"})
    return rows


BUILTIN_TASKS = {"letters": letters_rows}
"""`--dataset builtin:<name>` -> row builder; each task has a same-named reward in grpo/rewards.py."""


def builtin_dataset(name: str) -> list[dict[str, Any]]:
    """A built-in task's rows as a plain list (no `datasets` import: the GPU machines' images lack it)."""
    if name not in BUILTIN_TASKS:
        raise ValueError(f"unknown built-in task {name!r}: choose one of {sorted(BUILTIN_TASKS)} "
                         f"(e.g. --dataset builtin:letters --reward-funcs letters)")
    return BUILTIN_TASKS[name]()
