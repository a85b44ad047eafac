"""What the trainer and the rollout worker process share: the process handles, the loop's options, the staleness
rule and the run-ahead allowance.

`SharedState` is built once by `RolloutWorker` (grpo/rollout_worker.py) from the spawn context, pickled into the
worker process with the `LoopOptions` and handed to the rollout loop (grpo/scheduler.py). A loop built outside a
worker (`rollout.py sample`, tests) gets only the fields it needs; every field left None is simply not used.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from grpo.samples import TrainingSample


@dataclass(frozen=True)
class SharedState:
    """The shared process objects (torch.multiprocessing, "spawn"). Frozen: the handles never change, their
    contents do (`.value`, `put`/`get`, `set`)."""

    samples: Any = None
    """Queue, worker -> trainer: `TrainingSample`s and `ConsumedGroup` markers (the spec's `rollout_buffer`)."""
    metrics: Any = None
    """Queue, worker -> trainer: lists of (metric name, value)."""
    exceptions: Any = None
    """Queue, worker -> trainer: the worker's formatted traceback when it fails."""
    failed: Any = None
    """Event: set by the worker when it fails (after putting its traceback)."""
    stop: Any = None
    """Event: set by the trainer to stop the worker."""
    model_version: Any = None
    """Value('q'): the weight version the servers hold; a group reads it at its first dispatch."""
    token_allowance: Any = None
    """Value('d'): tokens queued + in flight the worker may hold (`run_ahead_allowance`)."""
    queued_tokens: Any = None
    """Value('q'): tokens of samples published and not yet pulled by the trainer."""
    heartbeat: Any = None
    """Value('d'): time.time() of the worker's last beat."""
    eval_request: Any = None
    """Value('q'): the weight version the trainer wants evaluated (grpo/evaluation.py)."""
    eval_started: Any = None
    """Value('q'): the version whose evaluation the worker started."""
    eval_done: Any = None
    """Value('q'): the version whose evaluation the worker finished."""
    servers_alive: Any = None
    """Array('b'): 0/1 per vLLM server, also written by the trainer's WeightSync (0 = dead or dropped)."""

    @classmethod
    def create(cls, ctx, num_servers: int, model_version: int = 0, token_allowance: float = float("inf"),
               servers_alive=None) -> SharedState:
        """Fresh handles from a multiprocessing context; `servers_alive` (0/1 per server) defaults to all alive."""
        alive = [int(bool(a)) for a in servers_alive] if servers_alive is not None else [1] * num_servers
        return cls(samples=ctx.Queue(), metrics=ctx.Queue(), exceptions=ctx.Queue(), failed=ctx.Event(),
                   stop=ctx.Event(), model_version=ctx.Value("q", model_version),
                   token_allowance=ctx.Value("d", token_allowance), queued_tokens=ctx.Value("q", 0),
                   heartbeat=ctx.Value("d", time.time()), eval_request=ctx.Value("q", 0),
                   eval_started=ctx.Value("q", 0), eval_done=ctx.Value("q", 0), servers_alive=ctx.Array("b", alive))

    def beat(self) -> None:
        """The worker is alive now."""
        if self.heartbeat is not None:
            self.heartbeat.value = time.time()

    def put_sample(self, item) -> None:
        """Publish a training sample (with its numpy arrays attached: `TrainingSample.with_arrays`) or a
        `ConsumedGroup` to the trainer (dropped when nobody listens)."""
        if self.samples is not None:
            self.samples.put(item.with_arrays() if isinstance(item, TrainingSample) else item)


@dataclass(frozen=True)
class LoopOptions:
    """What a rollout loop takes besides its data and the shared state; every field is optional."""

    tools: tuple = ()
    """The trainer's tools (callables, each rollout may call them)."""
    environment_factory: Callable | dict[str, Callable] | None = None
    """An environment class (or a name -> class map for per-row environments)."""
    lora_name: str | None = None
    """Adapter-sync runs: requests name the adapter `{lora_name}-v{version}`."""
    dataset_start_index: int = 0
    """The prompt position the run starts from (a resumed run's low-water mark)."""
    skip_positions: frozenset[int] = frozenset()
    """Prompt positions a resumed run must not draw again (consumed before the checkpoint)."""
    eval_dataset: Any = None
    """Held-out prompts; with the shared eval values the worker runs evaluations (grpo/evaluation.py)."""
    group_callback: Callable[[Any, Any, bool], None] | None = None
    """Called with (group, advantages, kept) after each group is scored (`rollout.py sample`, tests)."""
    client: Any = None
    """Ready generation client(s) (tests); else one `VLLMClient` per server URL, built in `run`."""


def is_stale(current_version: int, sample_version: int, max_staleness: int) -> bool:
    """A sample generated under `sample_version` is too old to train at `current_version` (docs/design.md §2)."""
    return current_version - sample_version > max_staleness


def run_ahead_allowance(max_staleness: int, tokens_per_step: float) -> float:
    """Tokens queued + in flight the worker may hold: what training consumes in max(max_staleness, 1) steps
    (docs/design.md §3)."""
    return max(max_staleness, 1) * float(tokens_per_step)
