"""TokenBudgetBatcher: samples -> micro-batches of one prefix-trie row per rank (docs/design.md §8).

A row's size is counted as the trie would store it: unique tokens (a token already on a trie path of the row is
free) and loss terms, both capped by `token_budget`. A sample's nodes shared with the row are its longest
(token, next token) key prefix in common with any sample already there, so the count needs no trie, only a
vectorised longest-common-prefix against the row's samples.

Placement [spec rule; tie-breaks inferred]: (1) a row holding the sample's group, if it fits (least-loaded such
row); (2) otherwise an empty row, or the least-loaded fitting row whose new load does not raise the current
maximum row load (the slowest rank sets the micro-batch time); (3) otherwise close the micro-batch and start
fresh rows. Load = sum over new nodes of (depth + 1), the causal-attention cost proxy. Empty rows are filled
first, so a closed micro-batch never has an empty row; at the end of data `flush` pads missing rows with a
zero-weight dummy (no trained token), because a rank forwarding nothing would desynchronise FSDP collectives.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field

import numpy as np

from grpo.samples import TrainingSample

logger = logging.getLogger(__name__)

DUMMY_ROLLOUT_ID = "dummy"


def _end_marked(sample: TrainingSample) -> np.ndarray:
    """Tokens plus an end marker: sample s has a node at depth d shared with t iff s'[:d+2] == t'[:d+2]."""
    return np.append(sample.ids_array(), -1)


def _lcp(a: np.ndarray, b: np.ndarray) -> int:
    m = min(len(a), len(b))
    diff = a[:m] != b[:m]
    first = int(diff.argmax())
    return first if diff[first] else m


@dataclass
class _Row:
    samples: list[TrainingSample] = field(default_factory=list)
    marked: list[np.ndarray] = field(default_factory=list)
    groups: set[int] = field(default_factory=set)
    unique_tokens: int = 0
    loss_terms: int = 0
    load: int = 0

    def shared_nodes(self, marked: np.ndarray) -> int:
        """Nodes of the sample already in this row's trie (its longest shared key prefix)."""
        best = 0
        for other in self.marked:
            if other[0] == marked[0]:
                best = max(best, _lcp(marked, other) - 1)
        return best

    def add(self, sample: TrainingSample, marked: np.ndarray, shared: int) -> None:
        length = len(sample)
        self.samples.append(sample)
        self.marked.append(marked)
        self.groups.add(sample.group_id)
        self.unique_tokens += length - shared
        self.loss_terms += sample.num_loss_terms
        self.load += _new_load(shared, length)


def _new_load(shared: int, length: int) -> int:
    """sum_{d=shared}^{length-1} (d + 1): attention cost of the new nodes."""
    return (length * (length + 1) - shared * (shared + 1)) // 2


@dataclass(frozen=True)
class MicroBatchStats:
    """Per-micro-batch packing statistics (spec metric names in `as_metrics`)."""

    row_tokens: tuple[int, ...]  # unique (forwarded) tokens per row
    row_loads: tuple[int, ...]
    row_samples: tuple[int, ...]
    raw_tokens: int
    token_budget: int

    @property
    def row_imbalance(self) -> float:
        return max(self.row_loads) / max(np.mean(self.row_loads), 1e-9)

    @property
    def row_fill_frac(self) -> float:
        return sum(self.row_tokens) / (self.token_budget * len(self.row_tokens))

    @property
    def samples_per_row(self) -> float:
        return float(np.mean(self.row_samples))

    @property
    def packing_ratio(self) -> float:
        return self.raw_tokens / max(sum(self.row_tokens), 1)

    def as_metrics(self) -> dict[str, float]:
        return {"batch/row_imbalance": self.row_imbalance, "batch/row_fill_frac": self.row_fill_frac,
                "batch/samples_per_row": self.samples_per_row, "batch/packing_ratio": self.packing_ratio,
                "batch/row_tokens_mean": float(np.mean(self.row_tokens)),
                "batch/row_tokens_max": float(max(self.row_tokens))}


class TokenBudgetBatcher:
    """Streams samples into micro-batches of `num_ranks` rows, each within `token_budget`.

    `add(sample)` returns a closed micro-batch (one sample list per rank) or None; `flush()` returns the last
    one. `last_stats` describes the most recently returned micro-batch; `dropped_oversize_count` counts samples
    dropped for exceeding the budget.
    """

    def __init__(self, token_budget: int, num_ranks: int):
        if token_budget < 1 or num_ranks < 1:
            raise ValueError(f"token_budget ({token_budget}) and num_ranks ({num_ranks}) must be >= 1")
        self.token_budget = token_budget
        self.num_ranks = num_ranks
        self.dropped_oversize_count = 0
        self.last_stats: MicroBatchStats | None = None
        self._rows = [_Row() for _ in range(num_ranks)]

    def _fits(self, row: _Row, sample: TrainingSample, shared: int) -> bool:
        if not row.samples:
            return True
        return (row.unique_tokens + len(sample) - shared <= self.token_budget
                and row.loss_terms + sample.num_loss_terms <= self.token_budget)

    def _choose(self, sample: TrainingSample, marked: np.ndarray) -> tuple[int, int] | None:
        """(row index, shared nodes) per the placement rules, or None when the micro-batch must close."""
        shared = [row.shared_nodes(marked) if row.samples else 0 for row in self._rows]
        fitting = [i for i, row in enumerate(self._rows) if self._fits(row, sample, shared[i])]
        same_group = [i for i in fitting if sample.group_id in self._rows[i].groups]
        if same_group:
            best = min(same_group, key=lambda i: self._rows[i].load)
            return best, shared[best]
        empty = [i for i in fitting if not self._rows[i].samples]
        if empty:
            return empty[0], 0
        max_load = max(row.load for row in self._rows)
        # The load rule balances ranks; with a single rank there is nothing to balance, so fill up to the budget.
        ok = [i for i in fitting
              if self.num_ranks == 1 or self._rows[i].load + _new_load(shared[i], len(sample)) <= max_load]
        if ok:
            best = min(ok, key=lambda i: self._rows[i].load)
            return best, shared[best]
        return None

    def add(self, sample: TrainingSample) -> list[list[TrainingSample]] | None:
        if len(sample) > self.token_budget or sample.num_loss_terms > self.token_budget:
            self.dropped_oversize_count += 1
            logger.warning("dropping a sample of %d tokens: longer than token_budget=%d (raise token_budget)",
                           len(sample), self.token_budget)
            return None
        marked = _end_marked(sample)
        choice = self._choose(sample, marked)
        closed = None
        if choice is None:
            closed = self._close()
            choice = (0, 0)
        index, shared = choice
        self._rows[index].add(sample, marked, shared)
        return closed

    def pending(self) -> list[TrainingSample]:
        """Samples in the open micro-batch (pulled, not trained yet)."""
        return [s for row in self._rows for s in row.samples]

    def flush(self) -> list[list[TrainingSample]] | None:
        """Close the open micro-batch; empty rows get a zero-weight dummy. None when nothing is open."""
        filled = [row for row in self._rows if row.samples]
        if not filled:
            return None
        template = filled[0].samples[0]
        for row in self._rows:
            if not row.samples:
                row.add(dummy_sample(template), _end_marked(dummy_sample(template)), 0)
        return self._close()

    def _close(self) -> list[list[TrainingSample]]:
        rows = self._rows
        self.last_stats = MicroBatchStats(
            row_tokens=tuple(r.unique_tokens for r in rows), row_loads=tuple(r.load for r in rows),
            row_samples=tuple(len(r.samples) for r in rows),
            raw_tokens=sum(len(s) for r in rows for s in r.samples), token_budget=self.token_budget)
        self._rows = [_Row() for _ in range(self.num_ranks)]
        return [r.samples for r in rows]


def dummy_sample(template: TrainingSample) -> TrainingSample:
    """One token of `template` with nothing trained and advantage 0: a row that forwards but adds no loss term.
    Its group_id is -1 and rollout_id "dummy" so metrics can skip it."""
    return dataclasses.replace(
        template, input_ids=list(template.input_ids[:1]), completion_mask=[0], sampler_logprobs=[0.0],
        advantage=0.0, group_id=-1, rollout_id=DUMMY_ROLLOUT_ID, reward=float("nan"),
        sampler_top_ids=None, sampler_top_logprobs=None, sampling_mask=None)
