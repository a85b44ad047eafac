"""`AsyncRolloutLoop`: the hooks that say what a rollout is. Subclass it and override only the hooks that change.

Each prompt goes through `filter_prompt` -> `num_generations` x `generate_one` (which calls `generate_one_turn`
per sampling request) -> scoring (reward functions + environment `get_reward` + `Rollout.reward`, summed) ->
`compute_advantages` -> training samples pushed to the trainer's queue. The subclass must be importable (module
level) because the loop is built in a spawned process. When a rollout starts, how groups are scored and queued,
and the worker's background tasks live in `grpo/scheduler.py`; tools and environments in `grpo/tools.py`.

A dataset prompt longer than the server's max_model_len stops the run with `PromptTooLongError` (the spec: the
server rejects it and the run stops with its error); a conversation that tool results grow past it ends there.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from grpo.advantages import AdvantageGroup, estimate_advantages
from grpo.evaluation import sampling_override_var
from grpo.multiturn import parse_tool_calls
from grpo.samples import ConsumedGroup, Rollout, RolloutGroup, TurnRecord
from grpo.scheduler import RolloutScheduler, model_version_var

__all__ = ["AsyncRolloutLoop", "ConsumedGroup"]
_model_version = model_version_var  # the name tests and older subclasses import


class AsyncRolloutLoop(RolloutScheduler):
    """The hooks a user overrides: filter_prompt, setup, close, generate_one_turn, generate_one,
    compute_advantages. Everything else (constructor, `run`) is the scheduler's."""

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
        version = model_version_var.get()
        adapter = f"{self.lora_name}-v{version}" if self.lora_name and version > 0 else None
        num_logprobs = cfg.num_sampler_logprobs  # what the loss declared it needs (SamplerNeeds)
        override = sampling_override_var.get() or {}  # greedy eval rollouts (grpo/evaluation.py)
        await self._check_completion_length()  # warns once when max_completion_length >= max_model_len
        turn = await self.client.generate(
            prompt_ids, max_tokens=cfg.max_completion_length, temperature=override.get("temperature", cfg.temperature),
            top_p=cfg.top_p,
            top_k=cfg.top_k, min_p=cfg.min_p, repetition_penalty=cfg.repetition_penalty, num_logprobs=num_logprobs,
            use_generate_endpoint=cfg.uses_truncated_sampling and not override, model=adapter)
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
            except PromptTooLongError as exc:
                if not turns:  # the prompt itself is too long: stop the run with the server's limit (spec)
                    exc.add_note(f"prompt (group {group_id}): {_preview(prompt)}")
                    raise
                self._push("tools/context_full_count", 1)
                break  # tool results filled max_model_len: the conversation ends here, its turns are trained
            except AdapterNotLoadedError:
                break  # the LoRA version of this group left the staleness window
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
        """Advantages [G] by the configured estimator (grpo/advantages.py), which sees the group's rewards,
        completion lengths, trained tokens, turns and prompt id (`advantage_group`); NaN rewards get 0."""
        cfg = self.config
        return estimate_advantages(cfg.advantage, advantage_group(group), None, cfg.max_completion_length,
                                   cfg.overlong_buffer_length, cfg.overlong_penalty_factor)


def advantage_group(group: RolloutGroup) -> AdvantageGroup:
    """What an estimator sees of a scored group: per rollout its total reward, generated tokens (all turns),
    trained tokens (over its training samples), sampling requests; and the prompt's dataset row."""
    return AdvantageGroup.of(group.rewards, [len(r.completion_ids) for r in group.rollouts],
                             [sum(s.num_trained for s in seq) for seq in group.completions_sequences],
                             [len(r.turns) for r in group.rollouts], group.row_index)


def _preview(prompt: list[dict[str, Any]], limit: int = 200) -> str:
    text = " | ".join(f"{m.get('role')}: {m.get('content')}" for m in prompt)
    return text if len(text) <= limit else text[:limit] + f"... ({len(text)} characters)"
