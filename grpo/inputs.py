"""What a run is given, resolved and checked before any model loads: the config's own checks (`check_run_config`),
CLI names and import paths -> objects (`resolve_inputs`), the held-out prompts (`resolve_eval_dataset`).

Every check here fails with the flag or argument to change, before the trainer contacts a server.
"""

from __future__ import annotations

import logging
from typing import Any, NamedTuple

from grpo.config import DEFAULT_DATASET, AsyncGRPOConfig

log = logging.getLogger("train")


class RunInputs(NamedTuple):
    """What the rollout worker is handed, resolved and checked (`resolve_inputs`)."""

    reward_funcs: list
    dataset: Any  # None: the environment owns the data
    tools: list
    environment_factory: Any
    loop_cls: Any


def check_run_config(config: AsyncGRPOConfig):
    """Everything checkable from the config alone; returns (the loss function, the batch transforms)."""
    from grpo.advantages import batch_transforms, check_advantage_config
    from grpo.losses import loss_function
    from grpo.trackers import check_trackers

    check_not_reimported()
    check_config_values(config)
    check_model_path(config.model)
    loss_fn = loss_function(config.loss)  # an options class without a registered loss fails here
    check_advantage_config(config)  # the estimator, its options and the batch transforms, before any model loads
    transforms = batch_transforms(config.advantage_batch_transforms, config.transform)
    check_trackers(config.report_to)  # a tracker whose library is missing fails here, with the pip command
    log.info("vLLM servers: %s", " ".join(config.vllm_server_urls))  # a malformed URL fails here, before the data
    return loss_fn, transforms


def check_config_values(config: AsyncGRPOConfig) -> None:
    """Every field against its declared domain (grpo/config.py `FIELD_DOMAINS`), before anything starts: one
    ConfigValueError naming each bad flag and its range. A subclass's own fields without a domain are logged."""
    from grpo.domains import check_config

    unchecked = check_config(config, AsyncGRPOConfig)
    if unchecked:
        log.info("%s fields without a declared domain (unchecked; declare them in a FIELD_DOMAINS class attribute, "
                 "grpo/domains.py): %s", type(config).__name__, ", ".join(unchecked))
    raw = config.vllm_server_base_url
    for url in (raw,) if isinstance(raw, str) else raw:
        if url.rstrip("/").endswith("/v1"):
            log.info("--vllm-server-base-url %s ends in /v1 (the OpenAI-style URL): the trainer uses the server root "
                     "%s (its own routes sit beside /v1)", url, url.rstrip("/").removesuffix("/v1"))


def resolve_inputs(config: AsyncGRPOConfig, reward_funcs, train_dataset, tools, environment_factory,
                   loop_cls) -> RunInputs:
    """CLI names / import paths -> objects, for everything the Python caller did not pass."""
    from grpo.data import load_prompts, validate_prompts
    from grpo.imports import resolve_import
    from grpo.rewards import check_reward_columns, resolve_reward
    from grpo.worker_process import check_picklable
    from grpo.tools import check_environment_names, check_tools, environment_gives_reward

    if tools is None:
        tools = [resolve_import(path) for path in config.tools]
    if environment_factory is None and config.environment_factory:
        environment_factory = resolve_import(config.environment_factory)
    if reward_funcs is None:
        names = config.reward_funcs if config.reward_funcs is not None else (
            () if environment_factory is not None else ("accuracy",))
        reward_funcs = [resolve_reward(name) for name in names]
    elif callable(reward_funcs):
        reward_funcs = [reward_funcs]
    if loop_cls is None and config.loop_cls:
        loop_cls = resolve_import(config.loop_cls)
    dataset_name = config.dataset if config.dataset is not None else (
        None if environment_factory else DEFAULT_DATASET)
    if train_dataset is None and dataset_name is not None:
        train_dataset = load_prompts(dataset_name, config.dataset_split, require_prompt=environment_factory is None)
    else:  # the Python API's dataset gets the same checks as a loaded one
        validate_prompts(train_dataset, "train_dataset", require_prompt=environment_factory is None)
    if train_dataset is None and config.max_steps <= 0:
        raise ValueError("without a dataset the environment owns the data: set --max-steps to bound the run")
    if not reward_funcs and not environment_gives_reward(environment_factory) and loop_cls is None:
        raise ValueError("nothing scores the rollouts: pass reward functions (--reward-funcs NAME or "
                         "reward_funcs=[fn]) or an environment_factory whose class defines get_reward()")
    if train_dataset is not None:
        from grpo.data import dataset_columns

        check_reward_columns(reward_funcs, dataset_columns(train_dataset) - {"prompt"})
    check_tools(tools, environment_factory)
    check_environment_names(environment_factory, train_dataset)
    check_picklable(reward_funcs, tools, environment_factory, loop_cls)  # they cross into the spawned worker
    inputs = RunInputs(list(reward_funcs), train_dataset, list(tools), environment_factory, loop_cls)
    from grpo.advantages import check_advantage_config

    check_advantage_config(config, inputs)  # options' check(config, inputs): the resolved loop_cls, datasets
    return inputs


def check_tokenizer(tokenizer, model: str) -> None:
    """Rollouts render every prompt with the tokenizer's chat template: one without a template fails here, not
    inside the rollout loop."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"the tokenizer of --model {model!r} has no chat template (rollouts render conversational "
                         f"prompts with apply_chat_template); use an instruct/chat checkpoint, or set "
                         f"tokenizer.chat_template and save_pretrained it into the model directory")


def check_model_path(model: str) -> None:
    """A `--model` that is a filesystem path must exist (named before anything contacts the server)."""
    from pathlib import Path

    looks_like_path = model.startswith(("/", ".", "~")) or model.count("/") > 1
    if looks_like_path and not Path(model).expanduser().exists():
        raise FileNotFoundError(f"--model {model!r} is a path that does not exist; pass a local save_pretrained "
                                f"directory or a Hub id like Qwen/Qwen3-0.6B")


def check_not_reimported() -> None:
    """Under the spawn start method the rollout worker re-imports the script that called train.main; without an
    `if __name__ == "__main__":` guard it would load the model again and push a cold sync to the live server."""
    import multiprocessing

    if multiprocessing.parent_process() is not None:
        raise RuntimeError("train.main was called while a child process imported your script (the rollout worker "
                           "is spawned): put the call under `if __name__ == \"__main__\":`")


def resolve_eval_dataset(config: AsyncGRPOConfig, eval_dataset, environment_factory):
    """The held-out prompts: the Python argument, else `--eval-dataset` loaded; checked like the training set."""
    from grpo.data import load_prompts, validate_prompts

    if eval_dataset is None and config.eval_dataset is not None:
        eval_dataset = load_prompts(config.eval_dataset, config.eval_dataset_split,
                                    require_prompt=environment_factory is None)
    elif eval_dataset is not None:
        validate_prompts(eval_dataset, "eval_dataset", require_prompt=environment_factory is None)
    if eval_dataset is not None and config.eval_max_prompts is not None and config.eval_max_prompts < len(eval_dataset):
        n = config.eval_max_prompts
        eval_dataset = eval_dataset.select(range(n)) if hasattr(eval_dataset, "select") else list(eval_dataset)[:n]
    return eval_dataset
