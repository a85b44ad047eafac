"""`AsyncRolloutLoop`: generates, scores and queues rollout groups inside the rollout worker process.

Each prompt goes through `filter_prompt` -> `num_generations` x `generate_one` (which calls `generate_one_turn`
per sampling request) -> scoring (reward functions + environment `get_reward` + `Rollout.reward`, summed) ->
`compute_advantages` -> training samples pushed to the trainer's queue. Subclass it and override only the hooks
that change; the subclass must be importable (module level) because the loop is built in a spawned process.

Three limits decide when a rollout starts (algorithms.md sections 3-4): the token allowance (queued + in-flight
tokens stay within what training consumes in max(max_staleness, 1) steps), the adaptive concurrency cap read from
the server's `/metrics`, and `max_concurrent_rollouts`. Scheduling lives in `run`; the hooks never see it.
"""

from __future__ import annotations

import asyncio
import contextvars
import json
import time
import traceback
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from grpo.advantages import estimate_advantages
from grpo.config import AsyncGRPOConfig
from grpo.multiturn import FoldStats, fold_turns, parse_tool_calls
from grpo.queue import ConcurrencyCap, TokenAllowance
from grpo.samples import Rollout, RolloutGroup, TrainingSample, TurnRecord
from grpo.scoring import group_metrics, is_async_callable, is_kept, rollout_metrics, score_group

_model_version: contextvars.ContextVar[int] = contextvars.ContextVar("model_version", default=0)
RESERVED_ENV_METHODS = ("reset", "get_reward")


@dataclass
class ConsumedGroup:
    """Put on the trainer queue for a prompt that yields no samples (filtered or dropped at scoring), so the trainer
    can count it toward the epoch and the resume low-water mark."""

    group_id: int
    reason: str  # "filtered" | "dropped"


@dataclass
class _RolloutResult:
    rollout: Rollout
    prompt: list[dict[str, Any]]
    samples: list[TrainingSample]
    fold: FoldStats
    env_reward: tuple[type, float] | None
    duration_s: float


class AsyncRolloutLoop:
    metrics_poll_s: float = 5.0
    """Seconds between `/metrics` polls (spec: 5 s). Tests lower it in a subclass."""

    def __init__(self, config: AsyncGRPOConfig, model_name: str, dataset, reward_funcs: list[Callable],
                 processing_class, eos_token_ids: list[int], rollout_buffer=None, model_version_value=None,
                 token_allowance=None, heartbeat_value=None, failed_event=None, exception_info_queue=None,
                 metrics_queue=None, tools: list[Callable] | None = None,
                 environment_factory: Callable | dict[str, Callable] | None = None, score_queue_maxsize: int = 16,
                 lora_name: str | None = None, dataset_start_index: int = 0, queued_tokens_value=None,
                 stop_event=None, group_callback: Callable[[RolloutGroup, np.ndarray, bool], None] | None = None,
                 client=None):
        self.config, self.model_name, self.dataset = config, model_name, dataset
        self.reward_funcs = list(reward_funcs or [])
        self.tokenizer = processing_class
        self.eos_token_ids = set(eos_token_ids)
        self.rollout_buffer, self.metrics_queue = rollout_buffer, metrics_queue
        self.model_version_value, self.heartbeat_value = model_version_value, heartbeat_value
        self.failed_event, self.exception_info_queue = failed_event, exception_info_queue
        self.tools = list(tools or [])
        self.environment_factory = environment_factory
        self.score_queue_maxsize, self.lora_name = score_queue_maxsize, lora_name
        self.dataset_start_index, self.stop_event = dataset_start_index, stop_event
        self.group_callback = group_callback
        self.allowance = TokenAllowance(token_allowance, queued_tokens_value)
        self.cap = ConcurrencyCap(config.max_concurrent_rollouts)
        self.client = client
        self._metric_items: list[tuple[str, Any]] = []
        self._env_pool: dict[str | None, list[Any]] = {}
        self._schema_cache: dict[int, dict] = {}
        self._generated_tokens = 0

    # ================================ hooks (override these) ================================================

    def filter_prompt(self, row_index: int, row: dict[str, Any], epoch: int) -> bool:
        """Whether to generate for this prompt; a rejected prompt counts as consumed for this epoch."""
        return True

    async def setup(self) -> None:
        """Create resources the other hooks need (runs on the loop's event loop before the first prompt)."""

    async def close(self) -> None:
        """Release what `setup` created (runs when the loop stops, also on failure)."""

    async def generate_one_turn(self, prompt_ids: list[int]) -> TurnRecord:
        """One vLLM request with the config's sampling settings."""
        cfg = self.config
        version = _model_version.get()
        adapter = f"{self.lora_name}-v{version}" if self.lora_name and version > 0 else None
        num_logprobs = cfg.num_sampler_logprobs  # what the loss declared it needs (SamplerNeeds)
        turn = await self.client.generate(
            prompt_ids, max_tokens=cfg.max_completion_length, temperature=cfg.temperature, top_p=cfg.top_p,
            top_k=cfg.top_k, min_p=cfg.min_p, repetition_penalty=cfg.repetition_penalty, num_logprobs=num_logprobs,
            use_generate_endpoint=cfg.uses_truncated_sampling, model=adapter)
        self._generated_tokens += len(turn.output_ids)
        return turn

    async def generate_one(self, prompt: list[dict[str, Any]], tools: list[Callable], group_id: int = 0) -> Rollout:
        """Multi-turn tool loop: render the conversation, sample, run the tool calls it contains, repeat."""
        from grpo.vllm_client import AdapterNotLoadedError, PromptTooLongError

        messages, completion, turns = list(prompt), [], []
        by_name = {t.__name__: t for t in tools}
        schemas = [self._tool_schema(t) for t in tools] or None
        calls = failures = rounds = 0
        exhausted = False
        while True:
            prompt_ids = self._render(messages, schemas)
            try:
                turn = await self.generate_one_turn(prompt_ids)
            except (PromptTooLongError, AdapterNotLoadedError):
                break  # the conversation filled max_model_len, or its LoRA version left the staleness window
            turns.append(turn)
            content, tool_calls = parse_tool_calls(self.tokenizer.decode(turn.output_ids, skip_special_tokens=True))
            message: dict[str, Any] = {"role": "assistant", "content": content}
            if tool_calls:
                message["tool_calls"] = [{"type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                                         for c in tool_calls]
            messages.append(message)
            completion.append(message)
            if not tool_calls or turn.finish_reason == "length":
                break
            limit = self.config.max_tool_calling_iterations
            if limit is not None and rounds >= limit:
                exhausted = True
                break
            rounds += 1
            self._push("tools/parallel_calls_mean", len(tool_calls))
            for call in tool_calls:  # in the order the model emitted them (spec)
                result, failed = await self._call_tool(call, by_name)
                calls, failures = calls + 1, failures + int(failed)
                tool_message = {"role": "tool", "name": call.name, "content": result}
                messages.append(tool_message)
                completion.append(tool_message)
        if tools:
            self._push("tools/loop_exhausted_frac", float(exhausted))
        completion_ids = [t for turn in turns for t in turn.output_ids]
        return Rollout(completion=completion, completion_ids=completion_ids, turns=turns, tool_call_count=calls,
                       tool_failure_count=failures)

    def compute_advantages(self, group: RolloutGroup) -> np.ndarray:
        """Advantages [G] by the configured estimator (grpo/advantages.py); NaN rewards get 0."""
        cfg = self.config
        lengths = np.array([len(r.completion_ids) for r in group.rollouts])
        return estimate_advantages(cfg.advantage_estimator, group.rewards, lengths, cfg.max_completion_length,
                                   cfg.overlong_buffer_length, cfg.overlong_penalty_factor)

    # ================================ tools and environments =================================================

    def _render(self, messages: list[dict], schemas: list[dict] | None) -> list[int]:
        ids = self.tokenizer.apply_chat_template(messages, tools=schemas, add_generation_prompt=True, tokenize=True,
                                                 **dict(self.config.chat_template_kwargs))
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)

    def _tool_schema(self, tool: Callable) -> dict:
        key = id(getattr(tool, "__func__", tool))
        if key not in self._schema_cache:
            from transformers.utils import get_json_schema

            self._schema_cache[key] = get_json_schema(tool)
        return self._schema_cache[key]

    async def _call_tool(self, call, by_name: dict[str, Callable]) -> tuple[str, bool]:
        """Run one call; return (message content, failed). Sync tools run in the pool so they never block the loop."""
        if call.error is not None:
            return f"Error: {call.error}", True
        tool = by_name.get(call.name)
        if tool is None:
            self._push("tools/unknown_name_count", 1)
            return f"Error: unknown tool {call.name!r}; available: {sorted(by_name)}", True
        start = time.perf_counter()
        failed = False
        try:
            if is_async_callable(tool):
                result = await tool(**call.arguments)
            else:
                result = await asyncio.get_running_loop().run_in_executor(self._pool, lambda: tool(**call.arguments))
            content = result if isinstance(result, str) else json.dumps(result, default=str)
        except Exception as exc:  # a failing tool is the policy's problem, reported to it and counted
            failed, content = True, f"Error: {type(exc).__name__}: {exc}"
        latency = time.perf_counter() - start
        self._push("tools/latency_s", latency)
        self._push(f"tools/{call.name}/latency_s", latency)
        self._push(f"tools/{call.name}/call_count", 1)
        self._push(f"tools/{call.name}/failure_count", int(failed))
        return content, failed

    def _factory_for(self, row: dict[str, Any]) -> tuple[str | None, Callable | None]:
        factory = self.environment_factory
        if factory is None:
            return None, None
        if isinstance(factory, dict):
            name = row.get("environment")
            if name not in factory:
                raise KeyError(f"row's environment {name!r} is not one of {sorted(factory)}; add an `environment` "
                               f"column naming a key of environment_factory")
            return name, factory[name]
        return None, factory

    @staticmethod
    def environment_tools(env: Any) -> list[Callable]:
        """Public methods of an environment, exposed as tools (reset and get_reward are reserved)."""
        return [getattr(env, n) for n in dir(type(env)) if not n.startswith("_") and n not in RESERVED_ENV_METHODS
                and callable(getattr(env, n))]

    async def _in_pool(self, fn: Callable, *args, **kwargs):
        if is_async_callable(fn):
            return await fn(*args, **kwargs)
        return await asyncio.get_running_loop().run_in_executor(self._pool, lambda: fn(*args, **kwargs))

    # ================================ one rollout, one group ====================================================

    async def _run_rollout(self, row: dict[str, Any], group_id: int, version: int) -> _RolloutResult:
        _model_version.set(version)
        start = time.perf_counter()
        prompt = list(row.get("prompt") or [])
        env_name, factory = self._factory_for(row)
        env, tools = None, list(self.tools)
        try:
            if factory is not None:
                pool = self._env_pool.setdefault(env_name, [])
                env = pool.pop() if pool else factory()  # instances are reused, reset between episodes (spec)
                t0 = time.perf_counter()
                text = await self._in_pool(env.reset, **{k: v for k, v in row.items() if k != "environment"})
                self._push("env/reset_s", time.perf_counter() - t0)
                if isinstance(text, str):
                    prompt = _with_env_prompt(prompt, text)
                tools += self.environment_tools(env)
            rollout = await self.generate_one(prompt, tools, group_id)
            env_reward = None
            if env is not None and callable(getattr(env, "get_reward", None)):
                t0 = time.perf_counter()
                value = await self._in_pool(env.get_reward)
                self._push("env/reward_s", time.perf_counter() - t0)
                env_reward = (type(env), float("nan") if value is None else float(value))
        finally:
            if env is not None:
                self._env_pool[env_name].append(env)
        samples, fold = fold_turns(rollout.turns, self.config.num_sampler_logprobs or None)
        return _RolloutResult(rollout, prompt, samples, fold, env_reward, time.perf_counter() - start)

    async def _rollout_slot(self, row, group_id, version) -> _RolloutResult:
        try:
            return await self._run_rollout(row, group_id, version)
        finally:
            self.cap.release()

    async def _start_group(self, tg: asyncio.TaskGroup, group_id: int, row_index: int, row: dict[str, Any]) -> None:
        """Dispatch the group's rollouts one slot at a time; the group's version is read at its first dispatch."""
        tasks, version = [], None
        self.allowance.group_started()
        for _ in range(self.config.num_generations):
            await self.cap.acquire()
            if version is None:
                version = int(self.model_version_value.value) if self.model_version_value is not None else 0
            tasks.append(tg.create_task(self._rollout_slot(row, group_id, version)))
        tg.create_task(self._collect_group(tasks, group_id, row_index, row, version))

    async def _collect_group(self, tasks, group_id: int, row_index: int, row: dict, version: int) -> None:
        results: list[_RolloutResult] = list(await asyncio.gather(*tasks))
        has_tools = bool(self.tools) or self.environment_factory is not None
        for r in results:
            self._metric_items += rollout_metrics(r.rollout, len(r.samples), r.fold, r.duration_s, has_tools)
        kwargs = {k: [v] * len(results) for k, v in row.items() if k != "prompt"}
        group = RolloutGroup(
            prompts=[r.prompt for r in results], reward_kwargs=kwargs,
            completions=[r.rollout.completion for r in results],
            completions_ids=[r.rollout.completion_ids for r in results],
            completions_sequences=[r.samples for r in results],
            tool_call_counts=[r.rollout.tool_call_count for r in results],
            tool_failure_counts=[r.rollout.tool_failure_count for r in results],
            model_version=version, group_id=group_id, row_index=row_index,
            env_rewards=[r.env_reward for r in results], rollout_rewards=[r.rollout.reward for r in results],
            rollouts=[r.rollout for r in results])
        start = time.perf_counter()
        group.queued_at = time.monotonic()
        await self._score_queue.put(group)
        if (blocked := time.perf_counter() - start) > 1e-3:
            self._push("rollout/score_block_s", blocked)

    # ================================ scoring =================================================================

    async def _score_forever(self) -> None:
        while True:
            group = await self._score_queue.get()
            self._push("rollout/score_wait_s", time.monotonic() - group.queued_at)
            start = time.perf_counter()
            sources = await score_group(group, self.reward_funcs)
            # compute_advantages runs for every group; the drop decision looks at rewards only (spec).
            advantages = np.asarray(self.compute_advantages(group), dtype=np.float64)
            samples = [s for seq in group.completions_sequences for s in seq]
            kept = is_kept(group.rewards, self.config.drop_equal_reward_groups) and len(samples) > 0
            self._push("rollout/score_s", time.perf_counter() - start)
            self._metric_items += group_metrics(group, sources, kept, self.eos_token_ids)
            self.allowance.group_finished(sum(len(s) for s in samples))
            if kept:
                self._publish(group, advantages)
            elif self.rollout_buffer is not None:
                self.rollout_buffer.put(ConsumedGroup(group.group_id, "dropped"))
            if self.group_callback is not None:
                self.group_callback(group, advantages, kept)
            self._score_queue.task_done()
            self._flush_metrics()

    def _publish(self, group: RolloutGroup, advantages: np.ndarray) -> None:
        tokens = 0
        for i, seq in enumerate(group.completions_sequences):
            for sample in seq:
                sample.advantage = float(advantages[i])
                sample.group_id, sample.row_index = group.group_id, group.row_index
                sample.model_version, sample.rollout_id = group.model_version, group.rollouts[i].rollout_id
                sample.reward = float(group.rewards[i])
                sample.queued_at = time.monotonic()
                tokens += len(sample)
                if self.rollout_buffer is not None:
                    self.rollout_buffer.put(sample)
        self.allowance.queued(tokens)

    # ================================ scheduling ==============================================================

    def _push(self, name: str, value: Any) -> None:
        self._metric_items.append((name, value))

    def _flush_metrics(self) -> None:
        if self.metrics_queue is not None and self._metric_items:
            self.metrics_queue.put(self._metric_items)
            self._metric_items = []

    def _stopping(self) -> bool:
        return self.stop_event is not None and self.stop_event.is_set()

    async def _poll_forever(self) -> None:
        """Adaptive cap + server gauges every `metrics_poll_s`; also the generation-rate pair."""
        last_t, last_preempt, last_retry = time.perf_counter(), None, 0
        while True:
            await asyncio.sleep(self.metrics_poll_s)
            m = await self.client.metrics()
            if m is not None:
                self.cap.update(m.kv_cache_usage, m.waiting)
            now = time.perf_counter()
            self._push("rollout/generated_tokens_per_s", (self._generated_tokens, now - last_t))
            self._generated_tokens, last_t = 0, now
            self._push("rollout/concurrency", self.cap.inflight)
            self._push("rollout/concurrency_cap", self.cap.limit)
            self._push("rollout/score_queue_size", self._score_queue.qsize())
            self._push("rollout/vllm_retry_count", self.client.retry_count - last_retry)
            last_retry = self.client.retry_count
            if m is not None:
                self._push("rollout/vllm_kv_cache_usage_frac", m.kv_cache_usage)
                self._push("rollout/vllm_running_requests", m.running)
                self._push("rollout/vllm_queued_requests", m.waiting)
                if last_preempt is not None:
                    self._push("rollout/vllm_preemption_count", max(m.preemptions_total - last_preempt, 0.0))
                last_preempt = m.preemptions_total
            self._flush_metrics()

    async def _heartbeat_forever(self) -> None:
        while True:
            if self.heartbeat_value is not None:
                self.heartbeat_value.value = time.time()
            await asyncio.sleep(1.0)

    async def _wait_to_start_group(self) -> None:
        """Hold a new group while the token allowance is used up or the score queue is full."""
        start = time.perf_counter()
        while not self.allowance.can_start() and not self._stopping():
            await asyncio.sleep(0.02)
        if (waited := time.perf_counter() - start) > 1e-3:
            self._push("rollout/backpressure_s", waited)
        start = time.perf_counter()
        while self._score_queue.full() and not self._stopping():
            await asyncio.sleep(0.02)
        if (blocked := time.perf_counter() - start) > 1e-3:
            self._push("rollout/score_block_s", blocked)

    def _row(self, prompt_index: int) -> tuple[int, int, dict[str, Any]]:
        """(row_index, epoch, row) of the prompt_index-th prompt drawn (dataset order, epochs cycling)."""
        if self.dataset is None:  # an environment that samples its own tasks: no epochs
            return prompt_index, 0, {}
        n = len(self.dataset)
        return prompt_index % n, prompt_index // n, dict(self.dataset[prompt_index % n])

    async def _dispatch(self, tg: asyncio.TaskGroup, max_groups: int | None) -> None:
        prompt_index = self.dataset_start_index
        epoch_accepted, epoch_complete = 0, self.dataset_start_index % max(len(self.dataset or [0]), 1) == 0
        group_id = 0
        while not self._stopping() and (max_groups is None or group_id < max_groups):
            row_index, epoch, row = self._row(prompt_index)
            if self.dataset is not None and row_index == 0 and prompt_index != self.dataset_start_index:
                if epoch_complete and epoch_accepted == 0:
                    raise RuntimeError(f"filter_prompt rejected every prompt of epoch {epoch - 1}: no sample can "
                                       f"reach the trainer; make filter_prompt admit at least one prompt per epoch")
                epoch_accepted, epoch_complete = 0, True
            if self.filter_prompt(row_index, row, epoch):
                epoch_accepted += 1
                await self._wait_to_start_group()
                if self._stopping():
                    break
                await self._start_group(tg, group_id, row_index, row)
            elif self.rollout_buffer is not None:
                self.rollout_buffer.put(ConsumedGroup(group_id, "filtered"))
            await asyncio.sleep(0)
            group_id += 1
            prompt_index += 1

    async def _run_tasks(self, max_groups: int | None) -> None:
        async with asyncio.TaskGroup() as tg:
            background = [tg.create_task(self._heartbeat_forever()), tg.create_task(self._poll_forever()),
                          tg.create_task(self._score_forever())]
            await self._dispatch(tg, max_groups)
            while not self._stopping() and self.allowance.inflight_groups > 0:
                await asyncio.sleep(0.05)
            for task in asyncio.all_tasks():  # only this loop's tasks live on this event loop
                if task is not asyncio.current_task() and (task in background or self._stopping()):
                    task.cancel()

    async def run(self, max_groups: int | None = None) -> None:
        """Generate until stopped (or `max_groups` prompts drawn, then drain). Failures propagate."""
        from grpo.vllm_client import VLLMClient

        if self.client is None:
            self.client = VLLMClient(self.config.vllm_server_base_url, self.model_name,
                                     timeout=self.config.vllm_server_timeout)
        self._pool = ThreadPoolExecutor(max_workers=self.config.max_concurrent_rollouts,
                                        thread_name_prefix="rollout-tool")
        self._score_queue: asyncio.Queue[RolloutGroup] = asyncio.Queue(maxsize=self.score_queue_maxsize)
        try:
            if self.heartbeat_value is not None:
                self.heartbeat_value.value = time.time()
            await self.setup()
            first = await self.client.metrics()
            if first is not None and first.kv_cache_max_concurrency > 0:
                self.cap.start_from(first.kv_cache_max_concurrency)
            try:
                await self._run_tasks(max_groups)
            except BaseExceptionGroup as group:  # raise the first failure plainly, with its own traceback
                first, *others = _leaves(group)
                if others:
                    first.add_note(f"({len(others)} more concurrent failures in the rollout loop)")
                raise first from None
            self._flush_metrics()
        finally:
            try:
                await self.close()
            finally:
                await self.client.close()
                self._pool.shutdown(wait=False, cancel_futures=True)


def _with_env_prompt(prompt: list[dict[str, Any]], text: str) -> list[dict[str, Any]]:
    """reset()'s string is the user prompt; with a dataset prompt it is appended to the last user message."""
    if not prompt:
        return [{"role": "user", "content": text}]
    prompt = [dict(m) for m in prompt]
    for message in reversed(prompt):
        if message.get("role") == "user":
            message["content"] = f"{message.get('content') or ''}\n\n{text}" if message.get("content") else text
            return prompt
    return prompt + [{"role": "user", "content": text}]


def _leaves(group: BaseExceptionGroup) -> list[BaseException]:
    out = []
    for exc in group.exceptions:
        out += _leaves(exc) if isinstance(exc, BaseExceptionGroup) else [exc]
    return out


def format_exception(exc: BaseException) -> str:
    return "".join(traceback.format_exception(exc))
