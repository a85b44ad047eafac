"""Flow control inside the rollout worker's event loop: when may a new rollout start.

Two limits, both read by the scheduler and never by the hooks: `TokenAllowance` (staleness backpressure in tokens,
fed by the trainer through a shared counter) and `ConcurrencyCap` (rollouts in flight, steered by the server's
KV-cache gauges).
"""

from __future__ import annotations

import math


class ConcurrencyCap:
    """Live cap on rollouts in flight to one server, steered by its KV-cache gauges (docs/design.md §4)."""

    def __init__(self, max_concurrent: int):
        self.max_concurrent = max_concurrent
        self.limit = max_concurrent  # no /metrics: the user's limit
        self.initial_limit = max_concurrent
        self.inflight = 0
        self.finished_since_increase = 0
        self._changed = None
        self.closed = False

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

    def close(self) -> None:
        """Its server died: wake every waiter (they see the server dead and go elsewhere)."""
        self.closed = True
        self._notify()

    def _notify(self) -> None:
        if self._changed is not None:
            self._changed.set()

    async def acquire(self) -> None:
        import asyncio

        if self._changed is None:
            self._changed = asyncio.Event()
        while not self.closed and self.inflight >= min(self.limit, self.max_concurrent):
            self._changed.clear()
            await self._changed.wait()
        self.inflight += 1

    def release(self) -> None:
        self.inflight -= 1
        self.finished_since_increase += 1
        self._notify()


class TokenAllowance:
    """Staleness backpressure in tokens (docs/design.md §3).

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
