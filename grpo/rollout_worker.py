"""The rollout worker: the process that runs `AsyncRolloutLoop`, and its trainer-side handle `RolloutWorker`.

The worker is spawned (torch.multiprocessing, "spawn") with `CUDA_VISIBLE_DEVICES=""`; what crosses into it and
what it runs there are grpo/worker_process.py's (`check_picklable` says how to fix what does not pickle). Shared state (`SharedState`, grpo/shared_state.py): the sample queue, the model version, the token
allowance, the queued-token count, a heartbeat, a failure event with a traceback queue, and a metrics queue.

Trainer side, a reader thread moves items from the process queue into a local one, so `RolloutWorker.get` never
blocks in a pipe read (a worker frozen half-way through writing a sample would otherwise hang the trainer with
the heartbeat check unreachable). `get` pulls one sample, drops the over-stale ones, books every group in the
`PromptLedger`, and raises with the worker's traceback when the worker died, stopped beating for
`rollout_worker_timeout` seconds, or dropped `max_dropped_groups_in_a_row` groups at scoring with nothing kept.
The worker exits by itself when the trainer process dies (parent-death watchdog).
"""

from __future__ import annotations

import atexit
import collections
import logging
import os
import queue as queue_lib
import threading
import time
from collections import Counter
from dataclasses import replace
from typing import Any

from grpo.config import AsyncGRPOConfig
from grpo.ledger import PromptLedger
from grpo.progress import WaitProgress
from grpo.samples import ConsumedGroup
from grpo.shared_state import LoopOptions, SharedState, is_stale, run_ahead_allowance
from grpo.worker_process import (ServedModel, WorkerSpec, WorkerStart, _environ,  # noqa: F401 (re-exported)
                                 _kill_at_exit, _worker_main, check_picklable)

log = logging.getLogger("grpo.rollout")

class RolloutWorker:
    """Owns the rollout process and the state it shares with the trainer. Trainer API: start/stop, get,
    set_model_version, set_token_allowance, drain_metrics, mark_trained, drain_drops, state_dict."""

    def __init__(self, config: AsyncGRPOConfig, dataset, reward_funcs=(), options: LoopOptions = LoopOptions(), *,
                 loop_cls=None, served: ServedModel = ServedModel(), start: WorkerStart = WorkerStart()):
        import torch.multiprocessing as mp

        self.config = config
        self._ctx = mp.get_context("spawn")
        skips = frozenset(options.skip_positions) | {c["position"] for c in start.carried}
        self.spec = WorkerSpec(config, dataset, tuple(reward_funcs), replace(options, skip_positions=skips),
                               loop_cls or config.loop_cls, served, os.getpid())
        self.shared = SharedState.create(self._ctx, len(config.vllm_server_urls), start.model_version,
                                         servers_alive=start.servers_alive)
        self.process = None
        self._inbox: queue_lib.Queue = queue_lib.Queue()
        self._reader_stop = threading.Event()
        self._trainer_metrics: list[tuple[str, Any]] = []
        self._eval_seen = -1  # the newest weight version whose eval metrics the trainer has read off the queue
        self.wait_s = 0.0  # seconds `get` waited since the last `take_wait_s` (the trainer's per-step rollout wait)
        self.ledger = PromptLedger(options.dataset_start_index, sorted(options.skip_positions))
        self._front: collections.deque = collections.deque()
        """(item, counted in queued_tokens) to hand out before the inbox: carried samples, items pulled early."""
        self._carry_in(start.carried, options.dataset_start_index)
        self._dropped_in_a_row: Counter[str] = Counter()
        self._stale_since_sample = 0
        self.waiting = WaitProgress("samples from the rollout worker", config.progress_interval_s)
        self.on_idle = None
        """Called while `get` finds nothing (train.py: bring a dropped server back when none is alive)."""

    @property
    def delivered(self):
        return self.ledger.delivered

    @property
    def consumed(self):
        return self.ledger.consumed

    def _carry_in(self, carried, start_index: int) -> None:
        """A resumed run: the untrained samples of the checkpoint's partial groups are handed out first."""
        from grpo.ledger import carry_from_json

        samples = [carry_from_json(record, start_index) for record in carried]
        per_group = collections.Counter(s.group_id for s in samples)
        for s in samples:
            self._front.append((s, False))
        for group_id, n in per_group.items():
            size = next(s.group_size for s in samples if s.group_id == group_id)
            self.ledger.resume_partial(group_id, size - n, size)

    # ---- lifecycle -----------------------------------------------------------------------------------------------
    def start(self) -> None:
        spec = self.spec
        check_picklable(spec.reward_funcs, spec.options.tools, spec.options.environment_factory, spec.loop_cls)
        self.shared.beat()
        with _environ(CUDA_VISIBLE_DEVICES=""):  # the child inherits the environment at spawn: no GPU there
            # Not a daemon: reward functions, tools and environments may start processes of their own (the
            # `accuracy` reward runs math-verify in one), which multiprocessing forbids in a daemon. Instead the
            # worker exits when the trainer dies (parent watchdog), and `_kill_at_exit` stops it before
            # multiprocessing's exit hook would wait for it.
            self.process = self._ctx.Process(target=_worker_main, args=(spec, self.shared), name="rollout-worker",
                                             daemon=False)
            self.process.start()
        atexit.register(_kill_at_exit, self.process)
        threading.Thread(target=self._pump, name="rollout-queue-reader", daemon=True).start()
        self.waiting.restart()

    def _pump(self) -> None:
        """Reader thread: the only place that may block inside a pipe read (a frozen writer freezes only it)."""
        samples = self.shared.samples
        while not self._reader_stop.is_set():
            try:
                self._inbox.put(samples.get(timeout=0.5))
            except queue_lib.Empty:
                continue
            except (EOFError, OSError, ValueError):  # the queue was closed: the run is ending
                return

    def stop(self, timeout: float = 30.0) -> None:
        if self.process is None:
            self._reader_stop.set()
            return
        self.shared.stop.set()
        t0 = time.monotonic()
        self.process.join(timeout)  # the reader keeps draining meanwhile, so the worker never blocks on a full pipe
        how = "on its own"
        if self.process.is_alive():
            how = "terminated"
            self.process.terminate()
            self.process.join(5.0)
        if self.process.is_alive():
            how = "killed"
            self.process.kill()
            self.process.join()
        self._reader_stop.set()
        waited = time.monotonic() - t0
        if waited > 5.0:
            log.warning("the rollout worker took %.1f s to stop (%s)", waited, how)

    # ---- shared values -------------------------------------------------------------------------------------------
    def set_model_version(self, version: int) -> None:
        self.shared.model_version.value = version

    def request_eval(self, version: int) -> None:
        """Ask the worker to evaluate the held-out prompts at this weight version (grpo/evaluation.py). A previous
        request the worker has not started yet is superseded: counted in eval/skipped_count."""
        pending = int(self.shared.eval_request.value)
        if pending > int(self.shared.eval_started.value) and pending != version:
            self._trainer_metrics.append(("eval/skipped_count", 1))
        self.shared.eval_request.value = version

    def wait_eval(self, version: int, timeout: float) -> bool:
        """Block until the evaluation of `version` is done (True), the timeout passes (False) or the worker dies."""
        deadline = time.monotonic() + timeout
        while self.shared.eval_done.value < version:
            self.check_alive()
            if time.monotonic() > deadline:
                return False
            time.sleep(0.1)
        return self._receive_eval_metrics(version, deadline)

    def _receive_eval_metrics(self, version: int, deadline: float) -> bool:
        """The worker books an evaluation done after putting its metrics on the queue, but a queue's put reaches
        the pipe from a feeder thread, later: read the queue until the eval metrics of `version` (or newer) are in,
        keeping everything read on the way for the next `drain_metrics`."""
        while self._eval_seen < version:
            try:
                self._trainer_metrics += self._read_metrics(timeout=0.1)
            except queue_lib.Empty:
                self.check_alive()
                if time.monotonic() > deadline:
                    return False
        return True

    def _read_metrics(self, timeout: float | None = None) -> list[tuple[str, Any]]:
        """One item off the metrics queue (`get_nowait` when timeout is None); notes the eval versions it carries."""
        items = self.shared.metrics.get(timeout=timeout) if timeout is not None else self.shared.metrics.get_nowait()
        for name, value in items:
            if name == "eval/model_version":
                self._eval_seen = max(self._eval_seen, int(value))
        return items

    def set_token_allowance(self, tokens: float) -> None:
        self.shared.token_allowance.value = float(tokens)

    def set_allowance_from_step(self, tokens_per_step: float) -> None:
        """The worker may run ahead by what training consumes in max(max_staleness, 1) steps (at start: a step's
        token estimate; after each step: the tokens it trained)."""
        self.set_token_allowance(run_ahead_allowance(self.config.max_staleness, tokens_per_step))

    @property
    def servers_alive(self):
        """0/1 per vLLM server, shared with the worker (and the trainer's WeightSync): 0 = dead or dropped."""
        return self.shared.servers_alive

    @property
    def model_version(self) -> int:
        return int(self.shared.model_version.value)

    # ---- health ----------------------------------------------------------------------------------------------------
    def check_alive(self) -> None:
        if self.process is None:
            raise RuntimeError("rollout worker not started; call RolloutWorker.start() first")
        if self.shared.failed.is_set() or not self.process.is_alive():
            try:
                trace = self.shared.exceptions.get(timeout=2.0)
            except queue_lib.Empty:
                self.process.join(1.0)
                code = self.process.exitcode
                trace = f"no traceback: the process exited with code {code}"
                if code is not None and code < 0:
                    trace += (f" (killed by signal {-code}: the out-of-memory killer (check the kernel log, `dmesg`) "
                              f"or an outside kill; to use less memory lower max_concurrent_rollouts and "
                              f"score_queue_maxsize, then restart with --resume-from-checkpoint latest)")
            raise RuntimeError(f"rollout worker failed:\n{trace}")
        silent = time.time() - self.shared.heartbeat.value
        if silent > self.config.rollout_worker_timeout:
            raise RuntimeError(f"rollout worker hung: no heartbeat for {silent:.0f} s (rollout_worker_timeout="
                               f"{self.config.rollout_worker_timeout:.0f}); something blocks its event loop (a "
                               f"synchronous call inside an async hook?) or the process is stopped (SIGSTOP); "
                               f"py-spy dump --pid {self.process.pid} shows where")

    # ---- trainer side ------------------------------------------------------------------------------------------
    def get(self, timeout: float | None = None):
        """Next sample no staler than max_staleness, or None after `timeout` seconds. Raises if the worker died."""
        start = time.perf_counter()
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            self.check_alive()
            wait = 0.5 if deadline is None else min(0.5, max(deadline - time.monotonic(), 0.0))
            if self._front:
                item, counted = self._front.popleft()
                sample = self._accept(item, counted)
                if sample is not None:
                    self._trainer_metrics.append(("perf/rollout_wait_s", time.perf_counter() - start))
                    return sample
                continue
            try:
                item = self._inbox.get(timeout=wait)
            except queue_lib.Empty:
                if self.on_idle is not None:
                    self.on_idle()
                self.waiting.tick(self._waiting_detail())
                if deadline is not None and time.monotonic() >= deadline:
                    self.wait_s += time.perf_counter() - start
                    return None
                continue
            sample = self._accept(item)
            if sample is not None:
                self.wait_s += time.perf_counter() - start
                return sample

    def _waiting_detail(self) -> str:
        dropped = sum(self._dropped_in_a_row.values())
        beat = time.time() - self.shared.heartbeat.value
        return (f"{dropped} groups dropped at scoring ({dict(self._dropped_in_a_row)}) and {self._stale_since_sample} "
                f"stale samples since the last sample; worker heartbeat {beat:.0f} s ago; servers alive "
                f"{[u for u, a in zip(self.config.vllm_server_urls, self.servers_alive) if a]}")

    def _accept(self, item, counted: bool = True):
        """Book one queue item; return it if it is a sample fresh enough to train on, else None. `counted`: the
        item is in the shared queued-token count (carried samples of a resumed run are not)."""
        if isinstance(item, ConsumedGroup):
            self.ledger.dropped(item.group_id, item.reason)
            self._trainer_metrics.append((f"rollout/dropped_{item.reason}_count", 1))
            if item.reason != "filtered":
                self._dropped_in_a_row[item.reason] += 1
                self._check_dropped_in_a_row()
            return None
        if counted:
            with self.shared.queued_tokens.get_lock():
                self.shared.queued_tokens.value -= len(item)
        version = self.model_version
        staleness = version - item.model_version
        if is_stale(version, item.model_version, self.config.max_staleness):
            self.ledger.dropped(item.group_id, "stale")
            self._trainer_metrics.append(("sample/dropped_stale_count", 1))
            self._stale_since_sample += 1
            return None
        self.ledger.delivered_group(item.group_id)
        self._dropped_in_a_row.clear()
        self._stale_since_sample = 0
        self.waiting.restart()
        self._trainer_metrics += [("sample/time_in_queue_s", time.monotonic() - item.queued_at),
                                  ("sample/staleness_mean", staleness), ("sample/staleness_max", staleness),
                                  ("rollout/queue_size", self._qsize())]
        return item

    def _check_dropped_in_a_row(self) -> None:
        limit = self.config.max_dropped_groups_in_a_row
        total = sum(self._dropped_in_a_row.values())
        if limit and total >= limit:
            raise RuntimeError(
                f"{total} groups in a row were dropped at scoring and none kept ({dict(self._dropped_in_a_row)}; "
                f"equal_rewards = every rollout of the group got the same reward, unscored = every reward was "
                f"None/NaN): GRPO gets no signal. Check the reward functions on a few prompts with `python rollout.py "
                f"sample`, raise num_generations or temperature, or use an easier dataset "
                f"(max_dropped_groups_in_a_row={limit})")

    def recheck_staleness(self, rows: list[list]) -> tuple[list[list], int]:
        """Drop samples that became over-stale while waiting in the batcher across a weight sync; a row left
        empty keeps a zero-weight dummy. Returns (rows, dropped)."""
        from grpo.batcher import dummy_sample

        out, dropped = [], 0
        for row in rows:
            fresh = []
            for s in row:
                if s.group_id < 0 or not is_stale(self.model_version, s.model_version, self.config.max_staleness):
                    fresh.append(s)
                else:
                    self.ledger.dropped(s.group_id, "stale")
                    dropped += 1
            out.append(fresh or [dummy_sample(row[0])])
        if dropped:
            self._trainer_metrics.append(("sample/dropped_stale_count", dropped))
        return out, dropped

    def _qsize(self) -> float:
        try:
            return float(self.shared.samples.qsize() + self._inbox.qsize())
        except NotImplementedError:  # macOS
            return float("nan")

    def mark_trained(self, samples) -> None:
        """Called by the trainer after an optimizer step with the samples it trained: their groups are consumed.
        Pulling a sample is not enough, since samples waiting in the batcher die with the run."""
        self.ledger.trained(samples)

    def drain_drops(self) -> list[tuple[int, str]]:
        """(prompt position, reason) of the groups dropped since the last call."""
        return self.ledger.drain_drops()

    @property
    def consumed_groups(self) -> int:
        return self.ledger.consumed.count

    def take_wait_s(self) -> float:
        """Seconds the trainer waited for samples since the last call (one step's `perf/rollout_wait_s`)."""
        wait, self.wait_s = self.wait_s, 0.0
        return wait

    def drain_metrics(self) -> list[tuple[str, Any]]:
        """Everything the worker and `get` pushed since the last call."""
        items, self._trainer_metrics = self._trainer_metrics, []
        while True:
            try:
                items += self._read_metrics()
            except queue_lib.Empty:
                return items

    def state_dict(self, open_samples=()) -> dict:
        """`rollout_state.json`: the ledger's resume point (low-water mark, consumed positions above it, partially
        trained groups), the model version, and the untrained samples of the partial groups ("carried": those in
        `open_samples`, the batcher's open micro-batch, and those still on their way from the worker)."""
        from grpo.ledger import carry_to_json

        carried = [carry_to_json(s, self.ledger.start_index + s.group_id) for s in self.untrained_of_partial(
            open_samples)]
        return self.ledger.state_dict() | {"model_version": self.model_version, "carried": carried}

    def untrained_of_partial(self, open_samples=(), wait_s: float = 30.0) -> list:
        """The samples not yet trained of every partial group. A group is published whole, so the ones not in
        `open_samples` or already pulled are in the pipe: they are pulled now (and handed out later, in order)."""
        partial = self.ledger.partial_groups()
        if not partial:
            return []
        held = [s for s in open_samples if s.group_id in partial]
        held += [item for item, _ in self._front if getattr(item, "group_id", None) in partial
                 and not isinstance(item, ConsumedGroup)]
        missing = lambda: sum(size - trained for trained, size in partial.values()) - len(held)  # noqa: E731
        running = self.process is not None and self.process.is_alive() and not self.shared.stop.is_set()
        deadline = time.monotonic() + (wait_s if running else 0.0)  # not running: what the inbox holds, no wait
        while missing() > 0 and (time.monotonic() < deadline or not self._inbox.empty()):
            if running:
                self.check_alive()
            try:
                item = self._inbox.get(timeout=0.5)
            except queue_lib.Empty:
                continue
            self._front.append((item, True))
            if not isinstance(item, ConsumedGroup) and item.group_id in partial:
                held.append(item)
        if missing() > 0:
            log.warning("checkpoint: %d untrained samples of partly trained groups %s did not arrive from the "
                        "rollout worker within %.0f s; a resume will not train them", missing(),
                        sorted(self.ledger.start_index + g for g in partial), wait_s)
        return held
