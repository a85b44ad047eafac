"""The rollout queue: the worker process that runs `AsyncRolloutLoop`, the state it shares with the trainer, and the
flow control both sides obey (algorithms.md sections 2-4).

The worker is spawned (torch.multiprocessing, "spawn") with `CUDA_VISIBLE_DEVICES=""`, so everything handed to it
(reward functions, tools, environment factories, the loop class) must pickle; `check_picklable` says how to fix
what does not. Shared state: the sample queue, the model version, the token allowance, the queued-token count, a
heartbeat, a failure event with a traceback queue, and a metrics queue.

Trainer side, `RolloutWorker.get` pulls one sample, drops the over-stale ones, and raises with the worker's
traceback when the worker died or stopped beating for `rollout_worker_timeout` seconds.
"""

from __future__ import annotations

import contextlib
import math
import os
import pickle
import queue as queue_lib
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from grpo.config import AsyncGRPOConfig
from grpo.imports import resolve_import

# ---- flow control (runs inside the worker's event loop) ------------------------------------------------------


class ConcurrencyCap:
    """Live cap on rollouts in flight, steered by the server's KV-cache gauges (algorithms.md section 4)."""

    def __init__(self, max_concurrent: int):
        self.max_concurrent = max_concurrent
        self.limit = max_concurrent  # no /metrics: the user's limit
        self.initial_limit = max_concurrent
        self.inflight = 0
        self.finished_since_increase = 0
        self._changed = None

    def start_from(self, kv_max_concurrency: float) -> None:
        """Start at the number of full-length requests the KV cache holds, clamped to [1, max_concurrent]."""
        self.limit = self.initial_limit = min(max(int(kv_max_concurrency), 1), self.max_concurrent)
        self.finished_since_increase = 0

    def update(self, kv_usage: float, waiting: int) -> None:
        if kv_usage > 0.80:
            self.limit = max(1, math.floor(self.limit * 0.70))
        elif kv_usage < 0.60 and waiting == 0 and self.finished_since_increase >= self.limit:
            # Round up so the cap still grows from 1-3; the finished-rollouts rate limit keeps the near-empty cache
            # right after a weight sync from inflating it [inferred].
            self.limit = min(self.max_concurrent, math.ceil(self.limit * 1.25))
            self.finished_since_increase = 0
            self._notify()

    def _notify(self) -> None:
        if self._changed is not None:
            self._changed.set()

    async def acquire(self) -> None:
        import asyncio

        if self._changed is None:
            self._changed = asyncio.Event()
        while self.inflight >= min(self.limit, self.max_concurrent):
            self._changed.clear()
            await self._changed.wait()
        self.inflight += 1

    def release(self) -> None:
        self.inflight -= 1
        self.finished_since_increase += 1
        self._notify()


class TokenAllowance:
    """Staleness backpressure in tokens (algorithms.md section 3).

    outstanding = tokens of samples sitting in the trainer queue (shared counter the trainer decrements) + an
    estimate per in-flight group (running mean of completed groups' pre-packing sample tokens, dropped groups
    included). A new group starts only if it fits: outstanding + estimate <= allowance, or when nothing at all is
    outstanding (a group larger than the allowance must still make progress). Until a group completes there is no
    estimate, so one group at a time. Requiring the new group to fit, rather than outstanding < allowance, keeps
    queued + in-flight within the allowance as far as the estimate is right [inferred].
    """

    def __init__(self, allowance_value=None, queued_value=None):
        self.allowance_value, self.queued_value = allowance_value, queued_value
        self.inflight_groups = 0
        self.completed_groups = 0
        self.mean_group_tokens = 0.0

    @property
    def queued_tokens(self) -> int:
        return int(self.queued_value.value) if self.queued_value is not None else 0

    def outstanding(self) -> float:
        return self.queued_tokens + self.inflight_groups * self.mean_group_tokens

    def can_start(self) -> bool:
        if self.allowance_value is None:
            return True
        if self.inflight_groups == 0 and self.queued_tokens == 0:
            return True
        if self.completed_groups == 0:
            return self.inflight_groups == 0
        return self.outstanding() + self.mean_group_tokens <= float(self.allowance_value.value)

    def group_started(self) -> None:
        self.inflight_groups += 1

    def group_finished(self, tokens: int) -> None:
        self.inflight_groups -= 1
        self.completed_groups += 1
        self.mean_group_tokens += (tokens - self.mean_group_tokens) / self.completed_groups

    def queued(self, tokens: int) -> None:
        if self.queued_value is not None:
            with self.queued_value.get_lock():
                self.queued_value.value += tokens


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


@dataclass
class WorkerSpec:
    """Everything the child needs to build the loop (pickled once at spawn)."""

    config: AsyncGRPOConfig
    loop_cls: Any  # class or "pkg.module:Class"
    dataset: Any
    reward_funcs: list[Callable]
    tools: list[Callable]
    environment_factory: Any
    model_name: str
    tokenizer_path: str
    eos_token_ids: list[int] | None
    lora_name: str | None
    dataset_start_index: int


def _worker_main(spec: WorkerSpec, shared: dict[str, Any]) -> None:
    import asyncio

    from grpo.rollout_loop import format_exception

    shared["heartbeat"].value = time.time()  # spawn start-up (imports) must not read as a hang
    try:
        loop_cls = spec.loop_cls
        if loop_cls is None:
            from grpo.rollout_loop import AsyncRolloutLoop as loop_cls
        elif isinstance(loop_cls, str):
            loop_cls = resolve_import(loop_cls)
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(spec.tokenizer_path, trust_remote_code=spec.config.trust_remote_code)
        shared["heartbeat"].value = time.time()
        loop = loop_cls(
            spec.config, spec.model_name, spec.dataset, spec.reward_funcs, tokenizer,
            spec.eos_token_ids or [tokenizer.eos_token_id], rollout_buffer=shared["samples"],
            model_version_value=shared["model_version"], token_allowance=shared["token_allowance"],
            heartbeat_value=shared["heartbeat"], failed_event=shared["failed"],
            exception_info_queue=shared["exceptions"], metrics_queue=shared["metrics"], tools=spec.tools,
            environment_factory=spec.environment_factory, score_queue_maxsize=spec.config.score_queue_maxsize,
            lora_name=spec.lora_name, dataset_start_index=spec.dataset_start_index,
            queued_tokens_value=shared["queued_tokens"], stop_event=shared["stop"])
        asyncio.run(loop.run())
        # Stopped by the trainer: buffered samples die with the run (spec), so do not block exit on flushing them
        # into a pipe nobody reads.
        shared["samples"].cancel_join_thread()
    except BaseException as exc:  # report everything, KeyboardInterrupt included, then die
        shared["exceptions"].put(format_exception(exc))
        shared["failed"].set()
        raise SystemExit(1) from None


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


class RolloutWorker:
    """Owns the rollout process and the state it shares with the trainer. Trainer API: start/stop, get,
    set_model_version, set_token_allowance, drain_metrics, state_dict."""

    def __init__(self, config: AsyncGRPOConfig, dataset, reward_funcs=(), *, tools=(), environment_factory=None,
                 loop_cls=None, model_name: str | None = None, tokenizer_path: str | None = None,
                 eos_token_ids: list[int] | None = None, lora_name: str | None = None, dataset_start_index: int = 0,
                 token_allowance: float = math.inf, model_version: int = 0):
        import torch.multiprocessing as mp

        self.config = config
        self._ctx = mp.get_context("spawn")
        self.spec = WorkerSpec(config, loop_cls or config.loop_cls, dataset, list(reward_funcs), list(tools),
                               environment_factory, model_name or config.model, tokenizer_path or config.model,
                               eos_token_ids, lora_name, dataset_start_index)
        ctx = self._ctx
        self.shared = dict(samples=ctx.Queue(), metrics=ctx.Queue(), exceptions=ctx.Queue(),
                           model_version=ctx.Value("q", model_version), token_allowance=ctx.Value("d", token_allowance),
                           queued_tokens=ctx.Value("q", 0), heartbeat=ctx.Value("d", time.time()),
                           failed=ctx.Event(), stop=ctx.Event())
        self.process = None
        self._trainer_metrics: list[tuple[str, Any]] = []
        self.delivered = GroupCounter()  # groups with a sample pulled, or a drop/filter marker received
        self.consumed = GroupCounter()  # groups trained (any sample), dropped at scoring or filtered

    # ---- lifecycle -----------------------------------------------------------------------------------------------
    def start(self) -> None:
        spec = self.spec
        check_picklable(spec.reward_funcs, spec.tools, spec.environment_factory, spec.loop_cls)
        self.shared["heartbeat"].value = time.time()
        with _environ(CUDA_VISIBLE_DEVICES=""):  # the child inherits the environment at spawn: no GPU there
            self.process = self._ctx.Process(target=_worker_main, args=(spec, self.shared), name="rollout-worker",
                                             daemon=True)
            self.process.start()

    def stop(self, timeout: float = 30.0) -> None:
        if self.process is None:
            return
        self.shared["stop"].set()
        self.process.join(timeout)
        if self.process.is_alive():
            self.process.terminate()
            self.process.join(5.0)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()

    # ---- shared values -------------------------------------------------------------------------------------------
    def set_model_version(self, version: int) -> None:
        self.shared["model_version"].value = version

    def set_token_allowance(self, tokens: float) -> None:
        """allowance = max(max_staleness, 1) x tokens used by the last step (algorithms.md section 3)."""
        self.shared["token_allowance"].value = float(tokens)

    @property
    def model_version(self) -> int:
        return int(self.shared["model_version"].value)

    # ---- health ----------------------------------------------------------------------------------------------------
    def check_alive(self) -> None:
        if self.process is None:
            raise RuntimeError("rollout worker not started; call RolloutWorker.start() first")
        if self.shared["failed"].is_set() or not self.process.is_alive():
            try:
                trace = self.shared["exceptions"].get(timeout=2.0)
            except queue_lib.Empty:
                self.process.join(1.0)
                code = self.process.exitcode
                trace = (f"no traceback: the process exited with code {code}"
                         + (f" (killed by signal {-code})" if code is not None and code < 0 else ""))
            raise RuntimeError(f"rollout worker failed:\n{trace}")
        silent = time.time() - self.shared["heartbeat"].value
        if silent > self.config.rollout_worker_timeout:
            raise RuntimeError(f"rollout worker hung: no heartbeat for {silent:.0f} s (rollout_worker_timeout="
                               f"{self.config.rollout_worker_timeout:.0f}); something blocks its event loop (a "
                               f"synchronous call inside an async hook?)")

    # ---- trainer side ------------------------------------------------------------------------------------------
    def get(self, timeout: float | None = None):
        """Next sample no staler than max_staleness, or None after `timeout` seconds. Raises if the worker died."""
        start = time.perf_counter()
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            self.check_alive()
            wait = 0.5 if deadline is None else min(0.5, max(deadline - time.monotonic(), 0.0))
            try:
                item = self.shared["samples"].get(timeout=wait)
            except queue_lib.Empty:
                if deadline is not None and time.monotonic() >= deadline:
                    self._trainer_metrics.append(("perf/rollout_wait_s", time.perf_counter() - start))
                    return None
                continue
            sample = self._accept(item)
            if sample is not None:
                self._trainer_metrics.append(("perf/rollout_wait_s", time.perf_counter() - start))
                return sample

    def _accept(self, item):
        """Book one queue item; return it if it is a sample fresh enough to train on, else None."""
        from grpo.rollout_loop import ConsumedGroup

        if isinstance(item, ConsumedGroup):
            self.delivered.add(item.group_id)
            self.consumed.add(item.group_id)
            return None
        with self.shared["queued_tokens"].get_lock():
            self.shared["queued_tokens"].value -= len(item)
        staleness = self.model_version - item.model_version
        if staleness > self.config.max_staleness:
            self.delivered.add(item.group_id)  # handed over (and lost), but not consumed: it holds the resume point
            self._trainer_metrics.append(("sample/dropped_stale_count", 1))
            return None
        self.delivered.add(item.group_id)
        self._trainer_metrics += [("sample/time_in_queue_s", time.monotonic() - item.queued_at),
                                  ("sample/staleness_mean", staleness), ("sample/staleness_max", staleness),
                                  ("rollout/queue_size", self._qsize())]
        return item

    def _qsize(self) -> float:
        try:
            return float(self.shared["samples"].qsize())
        except NotImplementedError:  # macOS
            return float("nan")

    def mark_trained(self, group_ids) -> None:
        """Called by the trainer after an optimizer step: these groups are consumed. Pulling a sample is not
        enough, since samples waiting in the batcher die with the run (the resume point is the trained one)."""
        for group_id in group_ids:
            self.consumed.add(group_id)

    @property
    def consumed_groups(self) -> int:
        return self.consumed.count

    def drain_metrics(self) -> list[tuple[str, Any]]:
        """Everything the worker and `get` pushed since the last call."""
        items, self._trainer_metrics = self._trainer_metrics, []
        while True:
            try:
                items += self.shared["metrics"].get_nowait()
            except queue_lib.Empty:
                return items

    def state_dict(self) -> dict[str, int]:
        """`rollout_state.json`: first prompt not yet consumed (low-water mark) and the model version."""
        return {"prompt_index": self.spec.dataset_start_index + self.consumed.low_water,
                "model_version": self.model_version}


class GroupCounter:
    """Distinct group ids seen, and the low-water mark: the first id not yet seen (ids below it are all seen)."""

    def __init__(self):
        self.count, self.low_water = 0, 0
        self._above: set[int] = set()

    def add(self, group_id: int) -> None:
        if group_id < self.low_water or group_id in self._above:
            return
        self._above.add(group_id)
        self.count += 1
        while self.low_water in self._above:
            self._above.discard(self.low_water)
            self.low_water += 1
