"""Tool faults inside a rollout: a malformed call, an unknown tool, a raising tool, and a tool called with the
wrong arguments. Each is the policy's problem: the error goes back to the model as the tool message, is counted,
and the rollout goes on to be scored. The model's turns are scripted (a random tiny model never emits tool calls);
the loop, the tool runner and the scoring are the real ones, polling the real server's `/metrics`."""

from __future__ import annotations

import asyncio
import json
import queue

import pytest

from grpo.config import AsyncGRPOConfig
from grpo.metrics import MetricsWindow
from grpo.rollout_loop import AsyncRolloutLoop
from grpo.samples import TurnRecord
from grpo.shared_state import LoopOptions, SharedState

from .harness import within

PROMPT = [{"role": "user", "content": "What is 3 x 4?"}]


def multiply(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: First factor.
        b: Second factor.
    """
    return a * b


def flaky_lookup(key: str) -> str:
    """Look a key up.

    Args:
        key: What to look up.
    """
    raise ConnectionError(f"lookup service down for {key!r}")


def length_reward(completion_ids, **kwargs):
    return [float(len(ids)) for ids in completion_ids]


CALLS = {
    "malformed": ("<tool_call>\n{\"name\": \"multiply\", \"arguments\": {a: 3}\n</tool_call>", "malformed tool call",
                  "tools/malformed_call_count"),
    "unknown_tool": ("<tool_call>\n" + json.dumps({"name": "divide", "arguments": {"a": 1}}) + "\n</tool_call>",
                     "unknown tool 'divide'", "tools/unknown_name_count"),
    "raising_tool": ("<tool_call>\n" + json.dumps({"name": "flaky_lookup", "arguments": {"key": "x"}})
                     + "\n</tool_call>", "ConnectionError: lookup service down", "tools/flaky_lookup/failure_count"),
    "wrong_arguments": ("<tool_call>\n" + json.dumps({"name": "multiply", "arguments": {"x": 3}}) + "\n</tool_call>",
                        "TypeError", "tools/multiply/failure_count"),
}


class Scripted(AsyncRolloutLoop):
    first_turn = ""
    metrics_poll_s = 0.2

    async def generate_one_turn(self, prompt_ids):
        text = self.first_turn if "<tool_response>" not in self.tokenizer.decode(prompt_ids) else "It is 12."
        ids = self.tokenizer.encode(text, add_special_tokens=False) + [self.tokenizer.eos_token_id]
        return TurnRecord(list(prompt_ids), ids, [-1.0] * len(ids), finish_reason="stop")


@pytest.mark.vllm
@pytest.mark.parametrize("case", sorted(CALLS))
def test_tool_faults_go_back_to_the_model_and_are_counted(faults_server, tiny_qwen3, case):
    from transformers import AutoTokenizer

    text, message, counter = CALLS[case]
    tokenizer = AutoTokenizer.from_pretrained(tiny_qwen3)
    config = AsyncGRPOConfig(model=str(tiny_qwen3), vllm_server_base_url=faults_server.base_url, num_generations=2)
    loop_cls = type("Loop", (Scripted,), {"first_turn": text})
    metrics, groups = queue.Queue(), []
    loop = loop_cls(config, config.model, [{"prompt": PROMPT}], [length_reward], tokenizer,
                    [tokenizer.eos_token_id], SharedState(metrics=metrics),
                    LoopOptions(tools=(multiply, flaky_lookup), group_callback=lambda g, adv, kept: groups.append(g)))
    within(60, asyncio.run, loop.run(max_groups=1))
    w = MetricsWindow()
    while not metrics.empty():
        w.extend(metrics.get())
    out = w.reduce()
    assert len(groups) == 1 and len(groups[0].rollouts) == 2
    tool_messages = [m for r in groups[0].rollouts for m in r.completion if m["role"] == "tool"]
    assert len(tool_messages) == 2 and all(message in m["content"] for m in tool_messages)
    assert out[counter] == 2 and out["tools/failure_frequency"] == 1.0
