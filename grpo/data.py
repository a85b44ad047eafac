"""Prompt datasets: a Hub name, a local json/jsonl/parquet file (or directory), or a built-in synthetic task.

Prompts must be conversational (`prompt` = a list of `{"role", "content"}` messages, spec "Compatibilidad y
restricciones"); every other column is kept and reaches the reward functions as a keyword argument. A `content`
may be a string or a list of text parts (joined into one string before rendering); non-text parts and `None` are
refused at start, by row (`message_text`).
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
    check_dataset_type(dataset, source)
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


def check_dataset_type(dataset, source: str) -> None:
    """A map-style dataset (`datasets.Dataset`, a list of row dicts, anything with len() and indexing) passes; a
    pandas DataFrame and a streaming `IterableDataset` are refused with the conversion to make.

    Streaming datasets: the spec lets the worker restart one from the first prompt on resume, since it cannot be
    repositioned. This trainer resumes by prompt position (the ledger skips every consumed position, and the
    epochs are counted in prompts, `num_train_epochs * len(dataset)`), which a stream has neither of; it is
    refused at start rather than trained without a resume point or an end."""
    kind = type(dataset).__name__
    if kind == "DataFrame":
        raise ValueError(f"{source} is a pandas DataFrame; convert it with datasets.Dataset.from_pandas(df) (its "
                         f"`prompt` column holding lists of {{'role', 'content'}} messages), or pass "
                         f"df.to_dict('records')")
    if kind == "IterableDataset" or not hasattr(dataset, "__len__"):
        raise ValueError(f"{source} is a streaming {kind}: it has no length (the epochs are counted in prompts) and "
                         f"cannot be repositioned on resume (a streaming dataset restarts from its first prompt, so "
                         f"resumes would train the same prompts again). Materialise the prompts you want: "
                         f"datasets.Dataset.from_list(list(dataset.take(N))), or load it without streaming=True")


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
    for j, message in enumerate(prompt):
        if not isinstance(message, dict) or "role" not in message or "content" not in message:
            raise ValueError(f"{where}: every prompt message needs `role` and `content` keys, got {message!r}")
        message_text(message, f"{where}, message {j}")


def message_text(message: dict[str, Any], where: str = "a message") -> str | None:
    """A message's `content` as the text the chat template renders (ValueError naming `where` and the fix).

    A string is itself. A list of parts (OpenAI / multimodal style, `[{"type": "text", "text": ...}, ...]`) is
    its text parts joined with nothing between them, as multimodal chat templates render consecutive text parts.
    This trainer is text-only: a non-text part (image, audio, file) is refused, since dropping it would train on
    a prompt the dataset did not mean. `None` is refused (templates render it as the text "None"), except in an
    assistant message that carries `tool_calls`, where it is the OpenAI convention for "no text".
    """
    content = message.get("content")
    if isinstance(content, str):
        return content
    if content is None:
        if message.get("role") == "assistant" and message.get("tool_calls"):
            return None
        raise ValueError(f"{where} (role {message.get('role')!r}): `content` is None, which chat templates render as "
                         f"the text 'None'; give every message its text (an empty string if it has none), or drop "
                         f"the message")
    if isinstance(content, list | tuple):
        texts = []
        for k, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            if kind != "text" or not isinstance(part.get("text"), str):
                raise ValueError(
                    f"{where}: content part {k} has type {kind!r}; this trainer is text-only (a non-text part cannot "
                    f"be rendered for the policy nor trained). Keep only text parts, e.g. dataset.map(lambda row: "
                    f"{{'prompt': [{{**m, 'content': ''.join(p['text'] for p in m['content'] if p['type'] == 'text')}}"
                    f" for m in row['prompt']]}}), or use a text-only dataset")
            texts.append(part["text"])
        return "".join(texts)
    raise ValueError(f"{where}: `content` must be a string or a list of text parts, got {type(content).__name__} "
                     f"({content!r:.80}); make it a string")


def text_messages(prompt: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The prompt with every `content` given as text (`message_text`): what the rollouts render and the reward
    functions see. String contents are left as they are (a message is copied only when it changes)."""
    out = []
    for j, message in enumerate(prompt):
        content = message.get("content")
        if isinstance(content, str) or (content is None and message.get("tool_calls")):
            out.append(message)
        else:
            out.append({**message, "content": message_text(message, f"prompt message {j}")})
    return out


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


def letters_heldout_rows(num_rows: int = 128) -> list[dict[str, Any]]:
    """`builtin:letters_heldout`: the held-out split of `letters` for `--eval-dataset`: rows drawn with another seed,
    minus every prompt `builtin:letters` has (so short one-word prompts, which repeat, are rarer here)."""
    seen = {row["prompt"][0]["content"] for row in letters_rows()}
    rows, seed = [], 1
    while len(rows) < num_rows:
        for row in letters_rows(4 * num_rows, seed=seed):
            if row["prompt"][0]["content"] not in seen:
                seen.add(row["prompt"][0]["content"])
                rows.append(row)
        seed += 1
    return rows[:num_rows]


def _word_problems(heldout: bool):
    """Deferred import: the generator lives in its own module (grpo/word_problems.py)."""
    def rows() -> list[dict[str, Any]]:
        from grpo import word_problems

        return word_problems.word_problems_heldout_rows() if heldout else word_problems.word_problems_rows()
    return rows


BUILTIN_TASKS = {"letters": letters_rows, "letters_heldout": letters_heldout_rows,
                 "word_problems": _word_problems(False), "word_problems_heldout": _word_problems(True)}
"""`--dataset builtin:<name>` -> row builder. `letters` is scored by the same-named reward in grpo/rewards.py;
`word_problems` rows carry a `solution` column for the default `accuracy` reward."""


def builtin_dataset(name: str) -> list[dict[str, Any]]:
    """A built-in task's rows as a plain list (no `datasets` import: the GPU machines' images lack it)."""
    if name not in BUILTIN_TASKS:
        raise ValueError(f"unknown built-in task {name!r}: choose one of {sorted(BUILTIN_TASKS)} "
                         f"(e.g. --dataset builtin:letters --reward-funcs letters)")
    return BUILTIN_TASKS[name]()
