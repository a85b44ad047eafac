"""Prompt accounting for epochs and exact resume: which prompt positions are consumed, and how.

A position is the index of a prompt draw (`dataset_start_index + group_id`; epochs continue the count). It is
consumed when every sample of its group is trained, or when its group is dropped (filtered by `filter_prompt`,
dropped at scoring, dropped as stale). A group with some samples trained and others not is *partial*: a checkpoint
saves the low-water mark (first position not consumed, so at or below every partial group), every consumed position
above it, the partial positions, and the untrained samples of the partial groups themselves ("carried",
`carry_to_json`). A resumed run skips every consumed and partial position and trains the carried samples first, so
every sample is trained exactly once across restarts (docs/reliability.md), and every position below the final mark
is either trained whole or recorded as dropped with its reason.
"""

from __future__ import annotations

from collections import Counter


class GroupCounter:
    """Distinct group ids seen, and the low-water mark: the first id not yet seen (ids below it are all seen)."""

    def __init__(self):
        self.count, self.low_water = 0, 0
        self.above: set[int] = set()

    def add(self, group_id: int) -> None:
        if group_id < self.low_water or group_id in self.above:
            return
        self.above.add(group_id)
        self.count += 1
        while self.low_water in self.above:
            self.above.discard(self.low_water)
            self.low_water += 1

    def __contains__(self, group_id: int) -> bool:
        return group_id < self.low_water or group_id in self.above


class PromptLedger:
    """Trainer-side bookkeeping over group ids of this run (group_id = position - start_index)."""

    def __init__(self, start_index: int = 0, skip_positions=()):
        self.start_index = start_index
        self.delivered = GroupCounter()  # a sample pulled, or a drop/filter marker received
        self.consumed = GroupCounter()  # trained (any sample), dropped or filtered
        self._trained: dict[int, int] = {}  # group id -> samples trained, while the group is incomplete
        self._sizes: dict[int, int] = {}
        self._dropped: set[int] = set()
        self._drops: list[tuple[int, str]] = []
        self.drop_counts: Counter[str] = Counter()
        for position in skip_positions:
            if position >= start_index:
                self.delivered.add(position - start_index)
                self.consumed.add(position - start_index)

    def delivered_group(self, group_id: int) -> None:
        self.delivered.add(group_id)

    def dropped(self, group_id: int, reason: str) -> None:
        """A group (or a sample of it) left without training: consumed, and recorded once."""
        self.delivered.add(group_id)
        self.consumed.add(group_id)
        self.drop_counts[reason] += 1
        if group_id not in self._dropped:
            self._dropped.add(group_id)
            self._drops.append((self.start_index + group_id, reason))

    def trained(self, samples) -> None:
        """After an optimizer step: these samples were trained; a group is consumed once all of them are."""
        for s in samples:
            if not s.group_size:  # unknown size (a sample built outside the scheduler): consumed at once
                self.consumed.add(s.group_id)
                continue
            done = self._trained.get(s.group_id, 0) + 1
            if done >= s.group_size:
                self._trained.pop(s.group_id, None)
                self._sizes.pop(s.group_id, None)
                self.consumed.add(s.group_id)
            else:
                self._trained[s.group_id], self._sizes[s.group_id] = done, s.group_size

    def resume_partial(self, group_id: int, trained_before: int, group_size: int) -> None:
        """A resumed run: `trained_before` of this group's samples were trained before the checkpoint."""
        self._trained[group_id], self._sizes[group_id] = trained_before, group_size

    def partial_groups(self) -> dict[int, tuple[int, int]]:
        """group id -> (samples trained, group size), for groups partly trained and not dropped."""
        return {g: (n, self._sizes[g]) for g, n in self._trained.items() if g not in self.consumed}

    def partial_positions(self) -> list[int]:
        """Positions with some but not all samples trained (and not dropped)."""
        return sorted(self.start_index + g for g in self.partial_groups())

    def drain_drops(self) -> list[tuple[int, str]]:
        drops, self._drops = self._drops, []
        return drops

    def state_dict(self) -> dict:
        return {"prompt_index": self.start_index + self.consumed.low_water,
                "consumed_above": sorted(self.start_index + g for g in self.consumed.above),
                "partial": self.partial_positions()}


def record_prompts(output_dir: str, step: int, samples, resumed: dict, drops) -> None:
    """Append which prompt positions (dataset_start_index + group_id) this step trained to trained_prompts.jsonl,
    and the groups dropped since the last step, with the reason, to dropped_prompts.jsonl: the audit trail for
    epochs and resume. `run` tells runs apart and `resumed_from` is the checkpoint step a run started from: records
    of the earlier run after that step were rolled back with the model. Each position is trained in one run only
    (a later run trains only samples carried from the earlier one), or recorded as dropped. `samples` names each
    trained sample: [position, rollout_id/fork_index, group size, carried]. `samples=None` records drops only."""
    import json
    from pathlib import Path

    run = {"step": step, "resumed_from": resumed["step"], "run": resumed["run_id"]}
    if samples is not None:
        positions = sorted({resumed["prompt_index"] + s.group_id for s in samples})
        keys = [[resumed["prompt_index"] + s.group_id, s.key, s.group_size, s.carried] for s in samples]
        with open(Path(output_dir) / "trained_prompts.jsonl", "a") as f:
            f.write(json.dumps(run | {"prompts": positions, "samples": keys}) + "\n")
    if drops:
        with open(Path(output_dir) / "dropped_prompts.jsonl", "a") as f:
            f.write(json.dumps(run | {"prompts": [[p, reason] for p, reason in drops]}) + "\n")


def resume_skips(state: dict) -> list[int]:
    """Positions a resumed run must neither draw again nor count as open: the consumed ones above the low-water
    mark, and partial groups whose untrained samples were not carried (a checkpoint that could not collect them)."""
    carried = {record["position"] for record in state.get("carried", [])}
    return sorted(set(state.get("consumed_above", [])) | (set(state.get("partial", [])) - carried))


def no_step_message(worker) -> str:
    drops = dict(worker.ledger.drop_counts) if worker is not None else "see rank 0"
    return (f"the run ended without a single optimizer step: every group was dropped ({drops}; equal_rewards = all "
            f"rollouts of a prompt scored the same, unscored = every reward None/NaN). Check the reward functions "
            f"with `python rollout.py sample`, or raise num_generations / num_train_epochs")


# ---- carried samples: the untrained rest of partial groups, saved with the checkpoint ----------------------------

_ARRAYS = {"sampler_top_ids": "int64", "sampler_top_logprobs": "float32"}


def carry_to_json(sample, position: int) -> dict:
    """A TrainingSample as JSON-safe fields, keyed by its prompt position instead of the run's group id."""
    import dataclasses

    out = {}
    for f in dataclasses.fields(sample):
        value = getattr(sample, f.name)
        out[f.name] = value.tolist() if hasattr(value, "tolist") else value
    return out | {"position": position}


def carry_from_json(record: dict, start_index: int):
    """The TrainingSample back, its group id relative to the resumed run's start (queued now)."""
    import time

    import numpy as np

    from grpo.samples import TrainingSample

    fields = {k: v for k, v in record.items() if k != "position"}
    for name, dtype in _ARRAYS.items():
        if fields.get(name) is not None:
            fields[name] = np.asarray(fields[name], dtype=dtype)
    return TrainingSample(**fields | {"group_id": record["position"] - start_index, "queued_at": time.monotonic(),
                                      "carried": True})
