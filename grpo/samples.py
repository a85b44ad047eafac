"""The records that flow through the pipeline, named as in the spec.

vLLM request -> `TurnRecord`; a whole conversation -> `Rollout` (one or more turns); the `num_generations`
rollouts of a prompt -> `RolloutGroup` (scored together); what the trainer consumes -> `TrainingSample`
(a rollout yields one per append-chain of turns, see `fold_turns`).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

import numpy as np

SAMPLER_NEG_INF = -9999.0
"""vLLM serializes -inf logprobs as -9999.0 on both generation endpoints; anything at or below it is -inf."""


@dataclass
class TurnRecord:
    """One sampling request: the prompt sent to the sampler and the tokens it produced."""

    prompt_ids: list[int]
    """Token ids of the whole prompt sent for this turn, earlier turns of the conversation included."""
    output_ids: list[int]
    """Token ids the sampler generated."""
    output_log_probs: list[float] = field(default_factory=list)
    """Sampler (processed) logprob of each output token. Required when any of them is trained."""
    output_mask: list[int] | None = None
    """Per output token: 1 = train on it, 0 = context only. None = train on all."""
    output_sampling_mask: list[list[int]] | None = None
    """Per output token: ids the sampler could draw from under top_k/top_p truncation. None = full vocabulary."""
    output_sampler_logprobs: list[dict[int, float]] | None = None
    """Per output token: the sampler's top-`num_sampler_logprobs` logprobs keyed by token id (score centering)."""
    finish_reason: str | None = None
    """"stop", "length" or "abort" as reported by vLLM."""


@dataclass
class Rollout:
    """A finished rollout, as returned by `AsyncRolloutLoop.generate_one`."""

    completion: list[dict[str, Any]]
    """Messages generated after the prompt (conversational format); passed to reward functions as `completions`."""
    completion_ids: list[int]
    """Token ids of the completion; passed to reward functions as `completion_ids`."""
    turns: list[TurnRecord]
    """Every sampling request of the rollout, in order. Training samples are built from these."""
    tool_call_count: int = 0
    tool_failure_count: int = 0
    reward: float | None = None
    """Reward set during generation (e.g. by an external judge); summed with the other sources."""
    rollout_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    server: str | None = None
    """URL of the vLLM server that generated it (set by the scheduler; a group's rollouts share one)."""


@dataclass
class TrainingSample:
    """What the trainer packs: one token sequence with per-token training data, and its rollout's advantage.

    Position i is trained iff `completion_mask[i] == 1` (never i = 0); its loss term predicts token i from the
    prefix [0, i). Per-position arrays hold sampler data at trained positions and padding elsewhere.
    """

    input_ids: list[int]  # [L]
    completion_mask: list[int]  # [L] 1 = token is trained
    sampler_logprobs: list[float]  # [L] sampler logprob of token i (0.0 where not trained)
    advantage: float
    group_id: int
    model_version: int
    """Weight version when the group's first rollout was dispatched."""
    row_index: int = -1
    """Index of the prompt's row in the dataset."""
    rollout_id: str = ""
    reward: float = float("nan")
    """Total reward of the rollout (for reward_kept)."""
    sampler_top_ids: np.ndarray | None = None  # [L, k] int64, -1 = padding / not trained
    sampler_top_logprobs: np.ndarray | None = None  # [L, k] float32, -inf = padding
    sampling_mask: list[list[int] | None] | None = None  # [L] candidate ids per trained position, None elsewhere
    queued_at: float = 0.0
    """time.monotonic() when it entered the trainer queue."""
    group_size: int = 0
    """Training samples the whole group produced (the trainer tells a partially trained group from a full one)."""
    fork_index: int = 0
    """Index of this sample among its rollout's samples (multi-turn forks); (rollout_id, fork_index) names it."""

    @property
    def key(self) -> str:
        return f"{self.rollout_id}/{self.fork_index}"

    def __len__(self) -> int:
        return len(self.input_ids)

    @property
    def num_trained(self) -> int:
        return int(sum(self.completion_mask))


@dataclass
class RolloutGroup:
    """The `num_generations` rollouts of one prompt, scored together. Every list has one entry per rollout."""

    prompts: list[list[dict[str, Any]]]
    reward_kwargs: dict[str, list[Any]]
    """The prompt row's other dataset columns, passed to reward functions as keyword arguments."""
    completions: list[list[dict[str, Any]]]
    completions_ids: list[list[int]]
    completions_sequences: list[list[TrainingSample]]
    """Training samples built from each rollout (advantage filled in after compute_advantages)."""
    tool_call_counts: list[int]
    tool_failure_counts: list[int]
    model_version: int
    group_id: int
    row_index: int
    env_rewards: list[tuple[type, Any] | None]
    """(environment class, what its get_reward() returned) per rollout; checked and converted at scoring."""
    rollout_rewards: list[float | None]
    queued_at: float = 0.0
    rewards: np.ndarray | None = None
    """Total reward per rollout, NaN where no source scored it. Set before compute_advantages()."""
    rollouts: list[Rollout] = field(default_factory=list)
    nonfinite_rewards: dict[str, list[float]] = field(default_factory=dict)
    """NaN/±inf values per reward source, scored as None (set by score_group; counted and warned about)."""


@dataclass
class ConsumedGroup:
    """Put on the trainer queue for a prompt that yields no samples, so the trainer counts it toward the epoch and
    the resume point. reason: "filtered" (filter_prompt said no), "env_reset_failed" (an environment's reset()
    kept failing after `env_reset_retries` retries), or a scoring drop: "equal_rewards", "unscored" (every reward
    None/NaN), "no_samples" (no rollout produced a trainable token), "reward_error" (a reward function raised and
    reward_errors="drop")."""

    group_id: int
    reason: str
