"""Tools and environments for multi-turn rollouts: JSON schemas, running one call, the environment pool, and the
start-time checks that catch a tool the chat template cannot describe before any rollout runs.

A tool is a plain (sync or async) function with type hints and a Google-style docstring; its schema comes from
`transformers.utils.get_json_schema`. An environment is a class: `reset(**row)` starts an episode (a returned
string is the user prompt), `get_reward()` scores it, every other public method is a tool.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import logging
import time
from collections.abc import Callable
from typing import Any

from grpo.scoring import is_async_callable

log = logging.getLogger("grpo.rollout")
RESERVED_ENV_METHODS = ("reset", "get_reward")


def tool_schema(tool: Callable) -> dict:
    """The function-calling schema of a tool; TypeError naming the tool and the fix when it has none."""
    from transformers.utils import get_json_schema

    try:
        return get_json_schema(tool)
    except Exception as exc:  # transformers raises DocstringParsingException / TypeHintParsingException
        name = getattr(tool, "__qualname__", repr(tool))
        raise TypeError(f"tool {name!r} has no usable schema ({type(exc).__name__}: {exc}). Give it type hints and "
                        f"a Google-style docstring: a one-line description, then `Args:` with one line per "
                        f"parameter") from exc


def environment_tools(env: Any) -> list[Callable]:
    """Public methods of an environment, exposed as tools (reset and get_reward are reserved)."""
    return [getattr(env, n) for n in dir(type(env)) if not n.startswith("_") and n not in RESERVED_ENV_METHODS
            and callable(getattr(env, n))]


def _environment_classes(environment_factory) -> list[tuple[str, Any]]:
    if environment_factory is None:
        return []
    if isinstance(environment_factory, dict):
        return [(f"environment_factory[{k!r}]", v) for k, v in environment_factory.items()]
    return [("environment_factory", environment_factory)]


def check_tools(tools=(), environment_factory=None) -> None:
    """At start, in the trainer: every tool and environment method has a schema; environments can reset."""
    for tool in tools or ():
        tool_schema(tool)
    for where, factory in _environment_classes(environment_factory):
        if not isinstance(factory, type):
            continue  # a factory function: its instances are only known once it runs in the worker
        if not callable(getattr(factory, "reset", None)):
            raise TypeError(f"{where} {factory.__qualname__} has no reset() method; an environment needs "
                            f"reset(**row) (returning the prompt string or None) and usually get_reward()")
        for name in dir(factory):
            raw = inspect.getattr_static(factory, name)
            if name.startswith("_") or name in RESERVED_ENV_METHODS or not callable(getattr(factory, name)):
                continue
            # a plain method is checked bound (so `self` is not a parameter); static/class methods as they are
            tool_schema(raw.__get__(object()) if inspect.isfunction(raw) else getattr(factory, name))


def check_environment_names(environment_factory, dataset) -> None:
    """At start, in the trainer: with a dict `environment_factory`, every row's `environment` value must be one of
    its keys (the worker would otherwise find the first bad row only after the model loaded)."""
    if not isinstance(environment_factory, dict):
        return
    available = sorted(environment_factory, key=str)
    if dataset is None:
        raise ValueError(f"environment_factory is a dict ({available}): each row picks its environment by the "
                         f"dataset's `environment` column, but there is no dataset; pass a dataset with that column, "
                         f"or pass one environment class")
    if hasattr(dataset, "column_names"):
        names = dataset["environment"] if "environment" in dataset.column_names else [None] * len(dataset)
    else:
        names = [row.get("environment") if isinstance(row, dict) else None for row in dataset]
    missing: dict[Any, int] = {}  # name -> first row
    for index, name in enumerate(names):
        try:
            known = name in environment_factory
        except TypeError:  # an unhashable value
            known = False
        if not known:
            missing.setdefault(name if _hashable(name) else repr(name), index)
    if not missing:
        return
    if list(missing) == [None]:
        raise ValueError(f"environment_factory is a dict ({available}) but the dataset has no `environment` column "
                         f"(or it is empty from row {missing[None]}); add an `environment` column naming one of "
                         f"{available} per row, or pass one environment class")
    shown = ", ".join(f"{name!r} (first at row {row})" for name, row in list(missing.items())[:10])
    more = f" and {len(missing) - 10} more" if len(missing) > 10 else ""
    raise ValueError(f"the dataset's `environment` column names environments that environment_factory does not "
                     f"have: {shown}{more}; available: {available}. Rename them in the dataset or add them to "
                     f"environment_factory")


def _hashable(value: Any) -> bool:
    try:
        hash(value)
    except TypeError:
        return False
    return True


def environment_gives_reward(environment_factory) -> bool:
    return any(callable(getattr(f, "get_reward", None)) for _, f in _environment_classes(environment_factory))


def with_env_prompt(prompt: list[dict[str, Any]], text: str) -> list[dict[str, Any]]:
    """reset()'s string is the user prompt; with a dataset prompt it is appended to the last user message."""
    if not prompt:
        return [{"role": "user", "content": text}]
    prompt = [dict(m) for m in prompt]
    for message in reversed(prompt):
        if message.get("role") == "user":
            message["content"] = f"{message.get('content') or ''}\n\n{text}" if message.get("content") else text
            return prompt
    return prompt + [{"role": "user", "content": text}]


async def in_pool(pool, fn: Callable, *args, **kwargs):
    """Await an async callable; run a sync one in the thread pool so it never blocks the event loop."""
    if is_async_callable(fn):
        return await fn(*args, **kwargs)
    return await asyncio.get_running_loop().run_in_executor(pool, lambda: fn(*args, **kwargs))


async def call_tool(call, by_name: dict[str, Callable], pool, push) -> tuple[str, bool]:
    """Run one parsed call; return (message content, failed). Failures are the policy's problem: reported to it
    as the tool message and counted (`tools/<name>/failure_count`, `tools/unknown_name_count`)."""
    if call.error is not None:
        push("tools/malformed_call_count", 1)
        return f"Error: {call.error}", True
    tool = by_name.get(call.name)
    if tool is None:
        push("tools/unknown_name_count", 1)
        return f"Error: unknown tool {call.name!r}; available: {sorted(by_name)}", True
    start = time.perf_counter()
    failed = False
    try:
        result = await in_pool(pool, tool, **call.arguments)
        content = result if isinstance(result, str) else json.dumps(result, default=str)
    except Exception as exc:
        failed, content = True, f"Error: {type(exc).__name__}: {exc}"
    latency = time.perf_counter() - start
    push("tools/latency_s", latency)
    push(f"tools/{call.name}/latency_s", latency)
    push(f"tools/{call.name}/call_count", 1)
    push(f"tools/{call.name}/failure_count", int(failed))
    return content, failed


class EnvironmentPool:
    """Environment instances per factory name, reused between episodes (reset each time, as in the spec)."""

    def __init__(self, environment_factory):
        self.factory = environment_factory
        self._free: dict[str | None, list[Any]] = {}

    def factory_for(self, row: dict[str, Any]) -> tuple[str | None, Callable | None]:
        if self.factory is None:
            return None, None
        if isinstance(self.factory, dict):
            name = row.get("environment")
            if name not in self.factory:
                raise KeyError(f"row's environment {name!r} is not one of {sorted(self.factory)}; add an "
                               f"`environment` column naming a key of environment_factory")
            return name, self.factory[name]
        return None, self.factory

    def acquire(self, name: str | None, factory: Callable) -> Any:
        free = self._free.setdefault(name, [])
        return free.pop() if free else factory()

    def release(self, name: str | None, env: Any) -> None:
        self._free.setdefault(name, []).append(env)

    async def reset(self, name: str | None, factory: Callable, row: dict[str, Any], retries: int, pool,
                    push: Callable[[str, Any], None]) -> tuple[Any, Any]:
        """(environment, what reset() returned): a pooled instance first; when it raises, up to `retries` more
        attempts, each on a fresh instance (a failed one is discarded, not pooled); `EnvResetError` after the last."""
        attempts = 1 + max(int(retries), 0)
        kwargs = {k: v for k, v in row.items() if k != "environment"}
        label = env_label(name, factory)
        for attempt in range(attempts):
            try:
                env = self.acquire(name, factory) if attempt == 0 else factory()
                t0 = time.perf_counter()
                text = await in_pool(pool, env.reset, **kwargs)
                push("env/reset_s", time.perf_counter() - t0)
                return env, text
            except Exception as exc:
                if attempt + 1 == attempts:
                    raise EnvResetError(label, attempts, exc) from exc
                push("env/reset_retry_count", 1)
                log.warning("%s reset() failed (%s: %s); retrying on a fresh instance (attempt %d of %d)", label,
                            type(exc).__name__, exc, attempt + 2, attempts)
        raise AssertionError("unreachable")


class EnvResetError(RuntimeError):
    """An environment's reset() (or constructor) raised on every attempt; its prompt is dropped, the run goes on."""

    def __init__(self, env_name: str, attempts: int, cause: BaseException):
        self.env_name, self.attempts, self.cause = env_name, attempts, cause
        super().__init__(f"{env_name} reset() failed {attempts} time(s), last with {type(cause).__name__}: {cause}")


def env_label(env_name: str | None, factory: Callable) -> str:
    name = getattr(factory, "__qualname__", None) or type(factory).__name__
    return f"environment_factory[{env_name!r}] ({name})" if env_name is not None else f"environment {name}"
