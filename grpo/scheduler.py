"""The rollout worker's scheduler: the plumbing under `AsyncRolloutLoop`'s hooks.

It draws prompts in dataset order (epochs cycling, positions saved by a checkpoint skipped), starts a group when
the token allowance and a server's concurrency cap allow (`flow_control.py`), places the whole group on one vLLM
server (`server_pool.py`: group affinity; a rollout whose server dies is re-dispatched with the rest of its group to
a surviving one), runs each rollout through the hooks, scores completed groups in order (reward functions in
threads), and publishes training samples, or a `ConsumedGroup` marker with the reason, to the trainer's queue.
Background tasks beat the heartbeat, poll every server's `/metrics` every `metrics_poll_s` (a failed poll is
counted, never fatal) and flush metrics. The hooks never see any of it: `self.client` is the client of the server
the current rollout runs on.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from grpo.data import text_messages
from grpo.flow_control import ConcurrencyCap, TokenAllowance
from grpo.multiturn import FoldStats, fold_turns
from grpo.samples import ConsumedGroup, Rollout, RolloutGroup, TrainingSample
from grpo.scoring import (RewardFunctionError, drop_reason, group_metrics, rollout_metrics, score_group,
                          timed_get_reward)
from grpo.server_pool import GroupHome, NoServerLeftError, Server, ServerPool
from grpo.shared_state import LoopOptions, SharedState
from grpo.tools import (EnvironmentPool, EnvResetError, call_tool, environment_tools, tool_schema,
                        with_env_prompt)

if TYPE_CHECKING:  # a plug-in module may subclass the loop; grpo.config imports plug-ins (no cycle)
    from grpo.config import AsyncGRPOConfig

log = logging.getLogger("grpo.rollout")
model_version_var: contextvars.ContextVar[int] = contextvars.ContextVar("model_version", default=0)
"""Weight version of the group a rollout belongs to (read by generate_one_turn for LoRA adapter names)."""
current_server_var: contextvars.ContextVar[Server | None] = contextvars.ContextVar("vllm_server", default=None)
"""The server the current rollout runs on (`RolloutScheduler.client` is its client)."""


@dataclass
class _RolloutResult:
    rollout: Rollout | None
    """None when the environment could not be reset (`reset_error`): nothing was generated."""
    prompt: list[dict[str, Any]]
    samples: list[TrainingSample]
    fold: FoldStats
    env_reward: tuple[type, Any] | None
    duration_s: float
    reset_error: EnvResetError | None = None


class RolloutScheduler:
    metrics_poll_s: float = 5.0
    """Seconds between `/metrics` polls (spec: 5 s). Tests lower it in a subclass."""

    def __init__(self, config: AsyncGRPOConfig, model_name: str, dataset, reward_funcs: list[Callable],
                 processing_class, eos_token_ids: list[int], shared: SharedState | None = None,
                 options: LoopOptions | None = None):
        options = options or LoopOptions()
        self.config, self.model_name, self.dataset = config, model_name, dataset
        self.reward_funcs = list(reward_funcs or [])
        self.tokenizer = processing_class
        self.eos_token_ids = set(eos_token_ids)
        self.shared = shared or SharedState()
        self.tools = list(options.tools or [])
        self.environment_factory = options.environment_factory
        self.lora_name, self.dataset_start_index = options.lora_name, options.dataset_start_index
        self.skip_positions, self.eval_dataset = frozenset(options.skip_positions), options.eval_dataset
        self.group_callback = options.group_callback
        self.allowance = TokenAllowance(self.shared.token_allowance, self.shared.queued_tokens)
        self._client_arg = options.client  # ready client(s) (tests); else one per URL, built in run()
        self.pool: ServerPool | None = None
        self._metric_items: list[tuple[str, Any]] = []
        self._envs = EnvironmentPool(options.environment_factory)
        self._schema_cache: dict[int, dict] = {}
        self._generated_tokens = 0
        self._nonfinite_seen: dict[str, int] = {}  # reward source -> NaN/±inf values so far (warned once each)
        self._reset_drops = self._reward_error_drops = 0
        self._length_checked = self._length_warned = False

    @property
    def client(self):
        """The generation client of the server the current rollout runs on (server 0 outside a rollout)."""
        server = current_server_var.get()
        if server is not None:
            return server.client
        if self.pool is not None:
            return self.pool.servers[0].client
        return self._client_arg[0] if isinstance(self._client_arg, list) else self._client_arg

    @client.setter
    def client(self, value) -> None:
        self._client_arg = value

    @property
    def cap(self) -> ConcurrencyCap | None:
        """Server 0's concurrency cap (each server has its own: `self.pool.servers[i].cap`)."""
        return self.pool.servers[0].cap if self.pool is not None else None

    # ================================ tools (used by generate_one) ============================================

    def _render(self, messages: list[dict], schemas: list[dict] | None) -> list[int]:
        ids = self.tokenizer.apply_chat_template(messages, tools=schemas, add_generation_prompt=True, tokenize=True,
                                                 **dict(self.config.chat_template_kwargs))
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)

    def _tool_schema(self, tool: Callable) -> dict:
        key = id(getattr(tool, "__func__", tool))
        if key not in self._schema_cache:
            self._schema_cache[key] = tool_schema(tool)
        return self._schema_cache[key]

    async def _call_tool(self, call, by_name: dict[str, Callable]) -> tuple[str, bool]:
        return await call_tool(call, by_name, self._pool, self._push)

    @staticmethod
    def environment_tools(env: Any) -> list[Callable]:
        return environment_tools(env)

    async def _check_completion_length(self) -> None:
        """Once per run, before the first request: warn when max_completion_length does not fit under the server's
        max_model_len. The client clamps every request's max_tokens to the room the prompt leaves (vllm_client
        `generate`), which would otherwise go unsaid."""
        limit_of = getattr(self.client, "max_model_len", None)
        if self._length_checked or limit_of is None:
            return
        limit = await limit_of()
        self._length_checked = True
        wanted = self.config.max_completion_length
        if wanted >= limit and not self._length_warned:
            self._length_warned = True
            log.warning("max_completion_length=%d does not fit under the vLLM server's max_model_len=%d (%s): every "
                        "request is clamped to max_model_len - prompt tokens; lower --max-completion-length below %d "
                        "or restart vLLM with a larger --max-model-len", wanted, limit, self.client.base_url, limit)

    # ================================ one rollout, one group ====================================================

    async def _run_rollout(self, row: dict[str, Any], group_id: int, version: int) -> _RolloutResult:
        model_version_var.set(version)
        start = time.perf_counter()
        prompt = text_messages(list(row.get("prompt") or []))  # text parts joined (checked at start)
        env_name, factory = self._envs.factory_for(row)
        env, tools = None, list(self.tools)
        try:
            if factory is not None:
                try:
                    env, text = await self._envs.reset(env_name, factory, row, self.config.env_reset_retries,
                                                       self._pool, self._push)  # pooled, reset per episode (spec)
                except EnvResetError as exc:
                    return _RolloutResult(None, prompt, [], FoldStats(), None, time.perf_counter() - start, exc)
                if isinstance(text, str):
                    prompt = with_env_prompt(prompt, text)
                tools += self.environment_tools(env)
            rollout = await self.generate_one(prompt, tools, group_id)
            env_reward = None
            if env is not None and callable(getattr(env, "get_reward", None)):
                t0 = time.perf_counter()
                value = await timed_get_reward(env, self._pool, self.config.reward_timeout_s,
                                               self.config.reward_errors, f"prompt {self.dataset_start_index + group_id}")
                self._push("env/reward_s", time.perf_counter() - t0)
                env_reward = (type(env), value)  # checked and converted at scoring (named TypeError, NaN/inf rule)
        finally:
            if env is not None:
                self._envs.release(env_name, env)
        samples, fold = fold_turns(rollout.turns, self.config.num_sampler_logprobs or None)
        return _RolloutResult(rollout, prompt, samples, fold, env_reward, time.perf_counter() - start)

    async def _rollout_slot(self, row, group_id, version, home: GroupHome, server: Server) -> _RolloutResult:
        """Run one rollout on `server` (slot held); if the server dies under it, run it again where the group went."""
        from grpo.vllm_client import ServerUnreachableError

        while True:
            current_server_var.set(server)
            epoch = server.epoch
            try:
                result = await self._run_rollout(row, group_id, version)
                if result.rollout is not None:
                    self._push(f"rollout/server{server.index}_rollouts_count", 1)
                    result.rollout.server = server.url
                return result
            except ServerUnreachableError as exc:
                if exc.base_url != server.client.base_url:
                    raise
                self.pool.mark_dead(server, f"{type(exc).__name__}: {exc}", epoch)
                self._push("rollout/redispatched_count", 1)
                cause = exc
            finally:
                server.cap.release()
            try:
                server = await self.pool.slot(home)
            except NoServerLeftError as none_left:
                raise none_left from cause

    async def _start_group(self, tg: asyncio.TaskGroup, group_id: int, row_index: int, row: dict[str, Any]) -> None:
        """Dispatch the group's rollouts one slot at a time, all to one server; the group's version is read at its
        first dispatch."""
        tasks, version = [], None
        self.allowance.group_started()
        home = GroupHome(await self.pool.pick_alive())
        for _ in range(self.config.num_generations):
            server = await self.pool.slot(home)
            if version is None:
                version = int(self.shared.model_version.value) if self.shared.model_version is not None else 0
            tasks.append(tg.create_task(self._rollout_slot(row, group_id, version, home, server)))
        tg.create_task(self._collect_group(tasks, group_id, row_index, row, version))

    async def _collect_group(self, tasks, group_id: int, row_index: int, row: dict, version: int) -> None:
        results: list[_RolloutResult] = list(await asyncio.gather(*tasks))
        has_tools = bool(self.tools) or self.environment_factory is not None
        for r in results:
            if r.rollout is not None:
                self._metric_items += rollout_metrics(r.rollout, len(r.samples), r.fold, r.duration_s, has_tools)
        failed = [r.reset_error for r in results if r.reset_error is not None]
        if failed:
            self._drop_unreset_group(group_id, row_index, results, failed)
            return
        group = self.group_from_results(results, group_id, row_index, row, version)
        start = time.perf_counter()
        group.queued_at = time.monotonic()
        await self._score_queue.put(group)
        if (blocked := time.perf_counter() - start) > 1e-3:
            self._push("rollout/score_block_s", blocked)

    @staticmethod
    def group_from_results(results: list[_RolloutResult], group_id: int, row_index: int, row: dict,
                           version: int) -> RolloutGroup:
        """The RolloutGroup of a prompt's finished rollouts (every one with a rollout), ready for scoring."""
        kwargs = {k: [v] * len(results) for k, v in row.items() if k != "prompt"}
        return RolloutGroup(
            prompts=[r.prompt for r in results], reward_kwargs=kwargs,
            completions=[r.rollout.completion for r in results],
            completions_ids=[r.rollout.completion_ids for r in results],
            completions_sequences=[r.samples for r in results],
            tool_call_counts=[r.rollout.tool_call_count for r in results],
            tool_failure_counts=[r.rollout.tool_failure_count for r in results],
            model_version=version, group_id=group_id, row_index=row_index,
            env_rewards=[r.env_reward for r in results], rollout_rewards=[r.rollout.reward for r in results],
            rollouts=[r.rollout for r in results])

    def eval_rows(self) -> list[dict[str, Any]]:
        """The held-out prompts (grpo/evaluation.py)."""
        return [dict(self.eval_dataset[i]) for i in range(len(self.eval_dataset))]

    def _drop_unreset_group(self, group_id: int, row_index: int, results: list[_RolloutResult],
                            failed: list[EnvResetError]) -> None:
        """A rollout's environment could not be reset: the prompt is dropped like a scoring drop (a ConsumedGroup
        with reason env_reset_failed: the trainer counts it, the ledger records it in dropped_prompts.jsonl)."""
        self._reset_drops += 1
        first = failed[0]
        log.warning("dropping prompt %d (row %d, reason env_reset_failed): %d of %d rollouts could not start, %s; "
                    "%d prompts dropped so far (env_reset_retries=%d)", self.dataset_start_index + group_id,
                    row_index, len(failed), len(results), first, self._reset_drops, self.config.env_reset_retries,
                    exc_info=first.cause if self._reset_drops == 1 else None)
        self.allowance.group_finished(sum(len(s) for r in results for s in r.samples))
        self.shared.put_sample(ConsumedGroup(group_id, "env_reset_failed"))
        self._flush_metrics()

    def _drop_reward_error(self, group: RolloutGroup, exc: RewardFunctionError) -> None:
        """reward_errors="drop": the group leaves as a ConsumedGroup "reward_error" (counted by the trainer in
        rollout/dropped_reward_error_count, recorded in dropped_prompts.jsonl); the first traceback is logged."""
        self._reward_error_drops += 1
        log.warning("dropping prompt %d (reason %s): %s; %d groups dropped for reward errors so far "
                    "(reward_errors=drop; set --reward-errors raise to stop at the first)",
                    self.dataset_start_index + group.group_id, exc.reason, exc, self._reward_error_drops,
                    exc_info=exc.cause if self._reward_error_drops == 1 else None)
        self.allowance.group_finished(sum(len(s) for seq in group.completions_sequences for s in seq))
        self.shared.put_sample(ConsumedGroup(group.group_id, exc.reason))
        self._score_queue.task_done()
        self._flush_metrics()

    def _warn_nonfinite(self, group: RolloutGroup) -> None:
        """One warning per reward source, at its first NaN/±inf (counted in every group's metrics after that)."""
        for name, values in group.nonfinite_rewards.items():
            first = name not in self._nonfinite_seen
            self._nonfinite_seen[name] = self._nonfinite_seen.get(name, 0) + len(values)
            if first:
                envs = {env[0].__name__ for env in group.env_rewards if env is not None}
                source = ("Rollout.reward" if name == "rollout_reward" else f"environment {name}.get_reward()"
                          if name in envs else f"reward function {name!r}")
                shown = ", ".join(str(v) for v in values[:4])
                log.warning("%s returned non-finite rewards (%s) in prompt %d: scored as None (unscored), counted "
                            "in rewards/nonfinite_count and rewards/%s/nonfinite_count; return None to leave a "
                            "completion unscored (this warning is shown once per source)", source, shown,
                            self.dataset_start_index + group.group_id, name)

    # ================================ scoring =================================================================

    async def _score_forever(self) -> None:
        while True:
            group = await self._score_queue.get()
            self._push("rollout/score_wait_s", time.monotonic() - group.queued_at)
            start = time.perf_counter()
            try:
                sources = await score_group(group, self.reward_funcs, self.config.reward_errors,
                                            self.config.reward_timeout_s, self.config.progress_interval_s,
                                            f"prompt {self.dataset_start_index + group.group_id}")
            except RewardFunctionError as exc:  # reward_errors="drop"
                self._drop_reward_error(group, exc)
                continue
            if group.nonfinite_rewards:
                self._warn_nonfinite(group)
            # compute_advantages runs for every group; the drop decision looks at rewards only (spec).
            advantages = np.asarray(self.compute_advantages(group), dtype=np.float64)
            samples = [s for seq in group.completions_sequences for s in seq]
            reason = drop_reason(group.rewards, len(samples), self.config.drop_equal_reward_groups)
            kept = reason is None
            self._push("rollout/score_s", time.perf_counter() - start)
            self._metric_items += group_metrics(group, sources, kept, self.eos_token_ids)
            self.allowance.group_finished(sum(len(s) for s in samples))
            if kept:
                self._publish(group, advantages)
            else:
                self.shared.put_sample(ConsumedGroup(group.group_id, reason))
            if self.group_callback is not None:
                self.group_callback(group, advantages, kept)
            self._score_queue.task_done()
            self._flush_metrics()

    def _publish(self, group: RolloutGroup, advantages: np.ndarray) -> None:
        tokens, group_size = 0, sum(len(seq) for seq in group.completions_sequences)
        for i, seq in enumerate(group.completions_sequences):
            for j, sample in enumerate(seq):
                sample.advantage, sample.fork_index = float(advantages[i]), j
                sample.group_id, sample.row_index = group.group_id, group.row_index
                sample.model_version, sample.rollout_id = group.model_version, group.rollouts[i].rollout_id
                sample.reward = float(group.rewards[i])
                sample.completion_length = len(group.rollouts[i].completion_ids)
                sample.turns = len(group.rollouts[i].turns)
                sample.queued_at, sample.group_size = time.monotonic(), group_size
                tokens += len(sample)
                self.shared.put_sample(sample)
        self.allowance.queued(tokens)

    # ================================ scheduling ==============================================================

    def _push(self, name: str, value: Any) -> None:
        self._metric_items.append((name, value))

    def _flush_metrics(self) -> None:
        if self.shared.metrics is not None and self._metric_items:
            self.shared.metrics.put(self._metric_items)
            self._metric_items = []

    def _stopping(self) -> bool:
        return self.shared.stop is not None and self.shared.stop.is_set()

    async def _poll_forever(self) -> None:
        """Per-server adaptive caps + server gauges every `metrics_poll_s`; also the generation-rate pair."""
        last_t, last_retry, last_errors = time.perf_counter(), 0, 0
        while True:
            await asyncio.sleep(self.metrics_poll_s)
            alive = self.pool.alive
            polled = await asyncio.gather(*(s.client.metrics() for s in alive))
            for server, m in zip(alive, polled):
                if m is not None:
                    server.cap.update(m.kv_cache_usage, m.waiting)
            now = time.perf_counter()
            self._push("rollout/generated_tokens_per_s", (self._generated_tokens, now - last_t))
            self._generated_tokens, last_t = 0, now
            self._push("rollout/concurrency", sum(s.cap.inflight for s in alive))
            self._push("rollout/concurrency_cap", sum(s.cap.limit for s in alive))
            self._push("rollout/score_queue_size", self._score_queue.qsize())
            retries = sum(s.client.retry_count for s in self.pool.servers)
            errors = sum(s.client.metrics_error_count for s in self.pool.servers)
            self._push("rollout/vllm_retry_count", retries - last_retry)
            self._push("rollout/vllm_metrics_error_count", errors - last_errors)
            last_retry, last_errors = retries, errors
            self._metric_items += self.pool.gauges(alive, polled)
            self._flush_metrics()

    async def _heartbeat_forever(self) -> None:
        while True:
            self.shared.beat()
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
            if prompt_index in self.skip_positions:  # consumed before the checkpoint this run resumed from
                epoch_accepted += 1
                group_id, prompt_index = group_id + 1, prompt_index + 1
                continue
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
            else:
                self.shared.put_sample(ConsumedGroup(group_id, "filtered"))
            await asyncio.sleep(0)
            group_id += 1
            prompt_index += 1

    async def _run_tasks(self, max_groups: int | None) -> None:
        async with asyncio.TaskGroup() as tg:
            background = [tg.create_task(self._heartbeat_forever()), tg.create_task(self._poll_forever()),
                          tg.create_task(self._score_forever())]
            if self.eval_dataset is not None and self.shared.eval_request is not None:
                from grpo.evaluation import run_eval_forever

                background.append(tg.create_task(run_eval_forever(self)))
            await self._dispatch(tg, max_groups)
            while not self._stopping() and self.allowance.inflight_groups > 0:
                await asyncio.sleep(0.05)
            for task in asyncio.all_tasks():  # only this loop's tasks live on this event loop
                if task is not asyncio.current_task() and (task in background or self._stopping()):
                    task.cancel()

    async def run(self, max_groups: int | None = None) -> None:
        """Generate until stopped (or `max_groups` prompts drawn, then drain). Failures propagate."""
        self.pool = self._build_pool()
        self._pool = ThreadPoolExecutor(max_workers=self.config.max_concurrent_rollouts * len(self.pool),
                                        thread_name_prefix="rollout-tool")
        self._score_queue: asyncio.Queue[RolloutGroup] = asyncio.Queue(maxsize=self.config.score_queue_maxsize)
        try:
            self.shared.beat()
            await self.setup()
            for server in self.pool.servers:
                first = await server.client.metrics()
                if first is not None and first.kv_cache_max_concurrency > 0:
                    server.cap.start_from(first.kv_cache_max_concurrency)
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
                for server in self.pool.servers:
                    await server.client.close()
                self._pool.shutdown(wait=False, cancel_futures=True)

    def _build_pool(self) -> ServerPool:
        """One client and one concurrency cap per server URL (or the client handed to the constructor)."""
        from grpo.vllm_client import VLLMClient

        cfg = self.config
        if self._client_arg is not None:  # one ready client, or a list (one per server)
            clients = self._client_arg if isinstance(self._client_arg, list) else [self._client_arg]
            urls = [c.base_url for c in clients]
        else:
            urls = list(cfg.vllm_server_urls)
            clients = [VLLMClient(url, self.model_name, timeout=cfg.vllm_server_timeout,
                                  fail_fast_on_refused=len(urls) > 1) for url in urls]
        return ServerPool(urls, clients, cfg.max_concurrent_rollouts, self.shared.servers_alive,
                          rejoin_wait_s=cfg.server_rejoin_wait_s, progress_every=cfg.progress_interval_s)


def _leaves(group: BaseExceptionGroup) -> list[BaseException]:
    out = []
    for exc in group.exceptions:
        out += _leaves(exc) if isinstance(exc, BaseExceptionGroup) else [exc]
    return out


