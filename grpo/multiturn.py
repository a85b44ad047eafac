"""Multi-turn rollouts: folding a rollout's turns into training samples, and parsing tool calls.

`fold_turns` implements docs/design.md §9. Each turn re-renders the whole conversation, so a turn's prompt
may not start with the tokens accumulated so far (templates that drop earlier reasoning, whitespace
normalisation). A turn whose prompt extends the accumulated tokens is **appended** to the current sample; any other
turn **forks** a new sample that starts from its prompt, where earlier generated tokens are context only. So every
generated token is trained in exactly one sample; a sample with no trained token is dropped. Unlike TRL 1.16 there
is no "realign" mode that demotes trained tokens to context.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from grpo.samples import SAMPLER_NEG_INF, TrainingSample, TurnRecord



@dataclass
class FoldStats:
    """How a rollout's turns were reconciled: one drift entry per turn transition (0 for an append)."""

    transitions: int = 0
    forks: int = 0
    drift_tokens: list[int] = field(default_factory=list)


class _SampleBuilder:
    """Token ids with per-position training data, grown turn by turn."""

    def __init__(self) -> None:
        self.ids: list[int] = []
        self.mask: list[int] = []
        self.logprobs: list[float] = []
        self.top: list[dict[int, float] | None] = []
        self.sampling_mask: list[list[int] | None] = []

    def add_context(self, ids: list[int]) -> None:
        self.ids += ids
        self.mask += [0] * len(ids)
        self.logprobs += [0.0] * len(ids)
        self.top += [None] * len(ids)
        self.sampling_mask += [None] * len(ids)

    def add_output(self, turn: TurnRecord) -> None:
        n = len(turn.output_ids)
        mask = list(turn.output_mask) if turn.output_mask is not None else [1] * n
        if len(mask) != n:
            raise ValueError(f"output_mask has {len(mask)} entries for {n} output tokens")
        if any(mask) and len(turn.output_log_probs) != n:
            raise ValueError(f"a turn with trained tokens needs one sampler logprob per output token "
                             f"(got {len(turn.output_log_probs)} for {n}); return them from generate_one_turn")
        for j, token in enumerate(turn.output_ids):
            trained = mask[j] == 1 and len(self.ids) > 0  # position 0 has no prefix to predict it from
            self.ids.append(token)
            self.mask.append(1 if trained else 0)
            self.logprobs.append(float(turn.output_log_probs[j]) if trained else 0.0)
            top = turn.output_sampler_logprobs[j] if trained and turn.output_sampler_logprobs else None
            self.top.append(top)
            sm = turn.output_sampling_mask[j] if trained and turn.output_sampling_mask else None
            self.sampling_mask.append(list(sm) if sm is not None else None)

    def build(self, num_top: int | None) -> TrainingSample:
        sample = TrainingSample(input_ids=list(self.ids), completion_mask=list(self.mask),
                                sampler_logprobs=list(self.logprobs), advantage=0.0, group_id=-1, model_version=-1)
        if any(t is not None for t in self.top):
            k = num_top or max(len(t) for t in self.top if t is not None)
            top_ids = np.full((len(self.ids), k), -1, dtype=np.int64)  # [L, k]
            top_logprobs = np.full((len(self.ids), k), -np.inf, dtype=np.float32)  # [L, k]
            for i, entries in enumerate(self.top):
                if not entries:
                    continue
                ranked = sorted(entries.items(), key=lambda kv: -kv[1])[:k]
                for r, (token, lp) in enumerate(ranked):
                    top_ids[i, r] = int(token)
                    top_logprobs[i, r] = -np.inf if lp <= SAMPLER_NEG_INF else lp
            sample.sampler_top_ids, sample.sampler_top_logprobs = top_ids, top_logprobs
        if any(m is not None for m in self.sampling_mask):
            sample.sampling_mask = list(self.sampling_mask)
        return sample


def common_prefix_len(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def fold_turns(turns: list[TurnRecord], num_top: int | None = None) -> tuple[list[TrainingSample], FoldStats]:
    """Reconcile a rollout's turns into training samples (advantage, group and version are filled in later).

    `num_top` fixes the width k of `sampler_top_ids`/`sampler_top_logprobs` (default: the widest top-logprob dict).
    """
    stats = FoldStats()
    samples: list[TrainingSample] = []
    builder: _SampleBuilder | None = None
    for turn in turns:
        prompt = list(turn.prompt_ids)
        if builder is None:
            builder = _SampleBuilder()
            builder.add_context(prompt)
        else:
            stats.transitions += 1
            held = builder.ids
            if len(prompt) >= len(held) and prompt[: len(held)] == held:
                stats.drift_tokens.append(0)
                builder.add_context(prompt[len(held):])
            else:
                stats.forks += 1
                stats.drift_tokens.append(len(held) - common_prefix_len(held, prompt))
                samples.append(builder.build(num_top))
                builder = _SampleBuilder()
                builder.add_context(prompt)
        builder.add_output(turn)
    if builder is not None:
        samples.append(builder.build(num_top))
    return [s for s in samples if s.num_trained > 0], stats


# ---- tool calls (Qwen / Hermes style) -------------------------------------------------------------------------

_TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


@dataclass
class ToolCall:
    name: str
    arguments: dict[str, Any]
    error: str | None = None
    """Why the call could not be parsed (it then counts as a failed call)."""


def parse_tool_calls(text: str) -> tuple[str, list[ToolCall]]:
    """Split an assistant message into its content (text before the first call) and its `<tool_call>` blocks."""
    calls = []
    for block in _TOOL_CALL.findall(text):
        try:
            payload = json.loads(block)
            name = payload["name"]
            args = payload.get("arguments", {})
            if isinstance(args, str):
                args = json.loads(args)
            if not isinstance(name, str) or not isinstance(args, dict):
                raise ValueError("name must be a string and arguments an object")
            calls.append(ToolCall(name=name, arguments=args))
        except (ValueError, KeyError, TypeError) as exc:
            calls.append(ToolCall(name="", arguments={}, error=f"malformed tool call: {exc}"))
    start = text.find("<tool_call>")
    content = (text if start < 0 else text[:start]).strip()
    return content, calls
