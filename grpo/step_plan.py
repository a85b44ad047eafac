"""One optimizer step's micro-batches, decided on global rank 0 and broadcast: rank 0 alone pulls samples from the
rollout worker into the token-budget batcher, every rank receives the same `StepPlan` and trains its own row.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class StepPlan:
    """What rank 0 decided for one micro-batch, broadcast to every rank."""

    rows: list  # one list[TrainingSample] per rank
    trained_tokens: int  # loss terms over all rows (the `token` normaliser)
    stats: dict = field(default_factory=dict)  # batch/* metrics of this micro-batch

    @property
    def trained_sequences(self) -> int:
        """Samples with at least one loss term over all rows (the `sequence` / `constant` normalisers)."""
        return sum(1 for row in self.rows for s in row if s.num_trained > 0)


def plan_micro_batch(worker, batcher, stop_groups: int | None) -> StepPlan | None:
    """Rank 0: pull samples into the batcher until it closes a micro-batch. None when the epochs are consumed."""
    while True:
        if stop_groups is not None and worker.delivered.low_water >= stop_groups:  # every group of the epochs
            rows = batcher.flush()
            if rows is None:
                return None
            rows, _ = worker.recheck_staleness(rows)
            if any(s.group_id >= 0 for row in rows for s in row):
                break
            continue
        sample = worker.get(timeout=1.0)
        if sample is None or (stop_groups is not None and sample.group_id >= stop_groups):
            continue  # groups past the last epoch are generated while the run winds down, never trained
        oversize = batcher.dropped_oversize_count
        rows = batcher.add(sample)
        if batcher.dropped_oversize_count > oversize:  # longer than token_budget: logged by the batcher, booked here
            worker.ledger.dropped(sample.group_id, "oversize")
        if rows is not None:
            # the batch-closing sample starts the next batch and may wait there across a weight sync
            rows, _ = worker.recheck_staleness(rows)
            if any(s.group_id >= 0 for row in rows for s in row):
                break
    stats = batcher.last_stats.as_metrics()
    stats["batch/dropped_oversize_count"] = batcher.dropped_oversize_count
    batcher.dropped_oversize_count = 0
    return StepPlan(rows, sum(s.num_trained for row in rows for s in row), stats)


def plan_step(worker, batcher, stop_groups, grad_accum: int, info) -> list[StepPlan]:
    """Up to `grad_accum` micro-batch plans, decided on rank 0 and broadcast; fewer (or none) at the end of data."""
    from grpo.distributed import broadcast_object

    plans = []
    for _ in range(grad_accum):
        plan = broadcast_object(plan_micro_batch(worker, batcher, stop_groups) if info.is_main else None, info)
        if plan is None:
            break
        plans.append(plan)
    return plans
