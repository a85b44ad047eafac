"""The rollout worker's own process: what crosses into it at spawn (`WorkerSpec`, checked by `check_picklable`) and
what it runs there (`_worker_main`: the tokenizer, the rollout loop class, `asyncio.run(loop.run())`, failures
reported through the shared state). The trainer-side handle that spawns and watches it is grpo/rollout_worker.py.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from grpo.config import AsyncGRPOConfig
from grpo.imports import resolve_import
from grpo.shared_state import LoopOptions, SharedState


# ---- picklability ------------------------------------------------------------------------------------------------


def check_picklable(reward_funcs=(), tools=(), environment_factory=None, loop_cls=None) -> None:
    """Raise TypeError naming the object and the fix when something cannot cross into the spawned worker."""
    items: list[tuple[str, Any]] = [("reward function", f) for f in reward_funcs or ()]
    items += [("tool", t) for t in tools or ()]
    if isinstance(environment_factory, dict):
        items += [(f"environment_factory[{k!r}]", v) for k, v in environment_factory.items()]
    elif environment_factory is not None:
        items.append(("environment_factory", environment_factory))
    if loop_cls is not None and not isinstance(loop_cls, str):
        items.append(("loop_cls", loop_cls))
    for kind, obj in items:
        try:
            pickle.dumps(obj)
        except Exception as exc:
            name = getattr(obj, "__qualname__", None) or repr(obj)
            raise TypeError(
                f"{kind} {name!r} cannot be pickled for the rollout worker process ({type(exc).__name__}: {exc}). "
                f"Define it at module level, or wrap it with functools.partial, or use an instance of a callable "
                f"class; lambdas and closures cannot cross into the spawned process.") from exc


# ---- the worker process ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ServedModel:
    """The model the rollouts are generated with: the name requests carry, the tokenizer, the stop tokens."""

    name: str | None = None
    """The served model name (the server may spell `--model` otherwise); None = `config.model`."""
    tokenizer_path: str | None = None
    """None = `config.model`."""
    eos_token_ids: tuple[int, ...] | None = None
    """None = the tokenizer's eos token."""


@dataclass(frozen=True)
class WorkerStart:
    """The first contents of the shared values, and the samples a resumed run carries over."""

    model_version: int = 0
    """The weight version the servers hold at start (after the cold sync)."""
    servers_alive: tuple | None = None
    """0/1 per server; None = all alive."""
    carried: tuple = ()
    """The checkpoint's untrained samples of partly trained groups (`rollout_state.json` "carried")."""


@dataclass(frozen=True)
class WorkerSpec:
    """Everything the child needs to build the loop (pickled once at spawn)."""

    config: AsyncGRPOConfig
    dataset: Any
    reward_funcs: tuple[Callable, ...]
    options: LoopOptions
    loop_cls: Any  # class or "pkg.module:Class"
    served: ServedModel
    parent_pid: int = 0


def format_exception(exc: BaseException) -> str:
    return "".join(traceback.format_exception(exc))


def _watch_parent(parent_pid: int, interval: float = 1.0) -> None:
    """Exit the worker when the trainer that spawned it is gone (SIGKILL leaves no chance to stop it)."""
    def watch():
        while True:
            time.sleep(interval)
            if os.getppid() != parent_pid:
                print(f"rollout worker: trainer process {parent_pid} is gone; exiting", file=sys.stderr, flush=True)
                os._exit(3)

    threading.Thread(target=watch, name="parent-watchdog", daemon=True).start()


STOP_REPORT_AFTER_S = 10.0
"""A worker still running this long after the trainer asked it to stop prints where it is (`_watch_stop`);
env GRPO_WORKER_STOP_REPORT_S overrides. The trainer terminates it after 30 s (`RolloutWorker.stop`)."""

_EVENT_LOOP = None  # the worker's asyncio loop, for `_watch_stop`'s report


def _watch_stop(shared: SharedState, after_s: float) -> None:
    """Once the trainer sets `stop`, wait `after_s`; if this process is still alive then, print every thread's stack
    and the event loop's pending tasks to stderr (once), so a slow exit names what it waits for."""
    import asyncio
    import faulthandler

    def report():
        # Polled, not `stop.wait()`: a multiprocessing Event's set() waits for every sleeping waiter to wake, and
        # a waiter in a process that died (a failed worker) never does, so the trainer's stop() would hang.
        while not shared.stop.is_set():
            time.sleep(0.5)
        time.sleep(after_s)
        print(f"rollout worker: still running {after_s:.0f} s after the trainer asked it to stop; its threads and "
              "tasks:", file=sys.stderr, flush=True)
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        if _EVENT_LOOP is not None:
            for _ in range(3):  # all_tasks reads a set the loop's thread may change meanwhile
                with contextlib.suppress(RuntimeError):
                    tasks = list(asyncio.all_tasks(_EVENT_LOOP))
                    break
            else:
                tasks = []
            for task in tasks:
                print(f"-- task {task.get_name()}, awaiting (outermost first):", file=sys.stderr)
                for line in _await_chain(task.get_coro()):
                    print(f"   {line}", file=sys.stderr)
        sys.stderr.flush()

    if shared.stop is not None:
        threading.Thread(target=report, name="stop-watchdog", daemon=True).start()


def _await_chain(coro) -> list[str]:
    """file:line in function, for each coroutine a suspended task awaits through, then what the innermost waits on
    (a Future, a sleep): the task's whole stack, which `Task.print_stack` does not show for a suspended task."""
    lines = []
    while coro is not None:
        frame = getattr(coro, "cr_frame", None) or getattr(coro, "gi_frame", None)
        if frame is None:
            lines.append(repr(coro)[:200])
            break
        lines.append(f"{frame.f_code.co_filename}:{frame.f_lineno} in {frame.f_code.co_qualname}")
        coro = getattr(coro, "cr_await", None) or getattr(coro, "gi_yieldfrom", None)
    return lines


async def _run_loop(loop) -> None:
    global _EVENT_LOOP
    import asyncio

    _EVENT_LOOP = asyncio.get_running_loop()
    await loop.run()


def _worker_main(spec: WorkerSpec, shared: SharedState) -> None:
    import asyncio

    import logging

    shared.beat()  # spawn start-up (imports) must not read as a hang
    # The spawned process starts without the trainer's logging setup: same format, so its warnings say WARNING.
    logging.basicConfig(level=logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s (rollout worker): %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    if spec.parent_pid:
        _watch_parent(spec.parent_pid)
    _watch_stop(shared, float(os.environ.get("GRPO_WORKER_STOP_REPORT_S", STOP_REPORT_AFTER_S)))
    try:
        loop_cls = spec.loop_cls
        if loop_cls is None:
            from grpo.rollout_loop import AsyncRolloutLoop as loop_cls
        elif isinstance(loop_cls, str):
            loop_cls = resolve_import(loop_cls)
        from transformers import AutoTokenizer

        cfg, served = spec.config, spec.served
        tokenizer = AutoTokenizer.from_pretrained(served.tokenizer_path or cfg.model,
                                                  trust_remote_code=cfg.trust_remote_code)
        shared.beat()
        loop = loop_cls(cfg, served.name or cfg.model, spec.dataset, list(spec.reward_funcs), tokenizer,
                        list(served.eos_token_ids or [tokenizer.eos_token_id]), shared, spec.options)
        asyncio.run(_run_loop(loop))
        # Stopped by the trainer: buffered samples die with the run (spec), so do not block exit on flushing them
        # into a pipe nobody reads.
        shared.samples.cancel_join_thread()
        shared.metrics.cancel_join_thread()  # undrained metrics must not block the exit either
    except BaseException as exc:  # report everything, KeyboardInterrupt included, then die
        shared.exceptions.put(format_exception(exc))
        shared.failed.set()
        raise SystemExit(1) from None


def _kill_at_exit(process) -> None:
    """atexit (runs before multiprocessing's own hook, which joins non-daemon children): a worker the trainer did
    not stop (an exception unwinding past `stop`) must not keep the trainer's interpreter from exiting."""
    if process.is_alive():
        process.kill()
        process.join(5.0)


@contextlib.contextmanager
def _environ(**values: str):
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
