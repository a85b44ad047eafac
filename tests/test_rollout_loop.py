"""AsyncRolloutLoop against a real vLLM CPU server: sampled groups, scoring, curriculum hooks, tools, environments,
the adaptive concurrency cap and token-allowance backpressure. Pure scoring cases are checked by hand."""

from __future__ import annotations

import asyncio
import functools
import multiprocessing
import queue
import threading
import time
from dataclasses import dataclass

import numpy as np
import pytest

from grpo.config import AsyncGRPOConfig
from grpo.metrics import MetricsWindow
from grpo.rollout_loop import AsyncRolloutLoop, ConsumedGroup
from grpo.samples import Rollout, RolloutGroup, TurnRecord
from grpo.scoring import duplicate_count, group_metrics, is_kept, score_group

PROMPT = [{"role": "user", "content": "What is 3 + 4?"}]


def length_reward(completion_ids, **kwargs):
    return [float(len(ids) % 3) for ids in completion_ids]


def parity_reward(completion_ids, **kwargs):
    return [float(ids[0] % 2) if ids else 0.0 for ids in completion_ids]


def make_config(server, model_dir, **kw) -> AsyncGRPOConfig:
    base = dict(model=str(model_dir), vllm_server_base_url=server.base_url, num_generations=4,
                max_completion_length=12, temperature=1.0, max_concurrent_rollouts=16)
    return AsyncGRPOConfig(**(base | kw))


def make_loop(cls, config, dataset, reward_funcs, tokenizer, **kw):
    return cls(config, config.model, dataset, reward_funcs, tokenizer, [tokenizer.eos_token_id], **kw)


@pytest.fixture(scope="module")
def tokenizer(tiny_qwen3):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_qwen3)


def collect(loop, max_groups):
    groups = []
    loop.group_callback = lambda g, kept: groups.append((g, kept))
    asyncio.run(loop.run(max_groups=max_groups))
    return groups


# ---- scoring by hand -----------------------------------------------------------------------------------------


def fake_group(rewards_per_fn, outputs=None, env=None, rollout_rewards=None) -> RolloutGroup:
    n = len(rewards_per_fn[0]) if rewards_per_fn else len(outputs)
    outputs = outputs or [[10 + i, 2] for i in range(n)]
    rollouts = [Rollout(completion=[{"role": "assistant", "content": "x"}], completion_ids=list(o),
                        turns=[TurnRecord([1], list(o), [-1.0] * len(o))]) for o in outputs]
    return RolloutGroup(prompts=[PROMPT] * n, reward_kwargs={"answer": ["7"] * n},
                        completions=[r.completion for r in rollouts], completions_ids=[list(o) for o in outputs],
                        completions_sequences=[[] for _ in range(n)], tool_call_counts=[0] * n,
                        tool_failure_counts=[0] * n, model_version=1, group_id=0, row_index=0,
                        env_rewards=env or [None] * n, rollout_rewards=rollout_rewards or [None] * n,
                        rollouts=rollouts)


class Fixed:
    """Callable-class reward returning fixed values (None allowed)."""

    def __init__(self, values):
        self.values = values

    def __call__(self, prompts, completions, completion_ids, answer, **kw):
        assert answer == ["7"] * len(completions)  # dataset columns arrive as keyword arguments
        return list(self.values)


async def async_fixed(values, **kwargs):
    await asyncio.sleep(0.01)
    return list(values)


def test_rewards_sum_sources_and_none_becomes_unscorable():
    group = fake_group([[1, 2, 3, 4]])
    fns = [Fixed([1.0, None, 0.5, None]), functools.partial(async_fixed, [2.0, None, None, None])]
    sources = asyncio.run(score_group(group, fns))
    expected = np.array([3.0, np.nan, 0.5, np.nan])
    np.testing.assert_array_equal(group.rewards, expected)
    assert set(sources) == {"Fixed", "async_fixed"}
    adv = AsyncRolloutLoop(AsyncGRPOConfig(), "m", [], [], None, [2]).compute_advantages(group)
    mu, sigma = 1.75, np.sqrt(((3.0 - 1.75) ** 2 + (0.5 - 1.75) ** 2) / 2)  # population std over scored
    np.testing.assert_allclose(adv, [(3.0 - mu) / (sigma + 1e-8), 0.0, (0.5 - mu) / (sigma + 1e-8), 0.0])


def test_env_and_rollout_rewards_are_sources():
    class Env:
        pass

    group = fake_group([[0, 0, 0]], env=[(Env, 1.0), (Env, None), (Env, 0.0)], rollout_rewards=[None, 5.0, None])
    group.env_rewards[1] = (Env, float("nan"))
    sources = asyncio.run(score_group(group, [Fixed([None, None, None])]))
    assert set(sources) == {"Fixed", "Env", "rollout_reward"}
    np.testing.assert_array_equal(group.rewards, [1.0, 5.0, 0.0])


@pytest.mark.parametrize("rewards, kept", [
    ([1.0, 1.0, 1.0, 1.0], False),  # zero std
    ([1.0, np.nan, np.nan, np.nan], False),  # fewer than 2 scorable
    ([np.nan] * 4, False),
    ([1.0, 1.0, np.nan, 1.0], False),
    ([1.0, 1.0 + 1e-12, 1.0, 1.0], True),  # exact equality only
    ([0.0, 1.0, np.nan, 0.0], True)])
def test_drop_rule(rewards, kept):
    assert is_kept(np.array(rewards)) is kept


def test_group_metrics_by_hand():
    outputs = [[5, 6, 2], [5, 6, 2], [7, 8], [5, 6, 2]]  # rollouts 1 and 3 duplicate rollout 0; rollout 2 clipped
    group = fake_group([[0, 0, 0, 0]], outputs=outputs)
    group.rewards = np.array([1.0, 1.0, np.nan, 1.0])
    assert duplicate_count(group) == 2
    w = MetricsWindow()
    w.extend(group_metrics(group, {"f": group.rewards}, kept=False, eos_token_ids={2}))
    out = w.reduce()
    assert out["reward"] == 1.0 and out["reward_dropped"] == 1.0 and out["frac_reward_zero_std"] == 1.0
    assert out["completions/duplicate_frac"] == 0.5
    assert out["completions/clipped_ratio"] == 0.25
    assert out["completions/max_length"] == 3 and out["completions/min_length"] == 2
    assert out["completions/min_terminated_length"] == 3
    assert "rewards/f/mean" not in out  # per-source means are over trained samples only


# ---- against the server ------------------------------------------------------------------------------------


@pytest.mark.vllm
def test_groups_reproduce_under_the_tiny_model(vllm_server, tiny_qwen3, tokenizer):
    """Every trained token's sampler logprob and top-8 set match a float32 transformers forward at T = 1."""
    import torch
    from transformers import AutoModelForCausalLM

    config = make_config(vllm_server, tiny_qwen3)
    dataset = [{"prompt": PROMPT, "answer": "7"}, {"prompt": [{"role": "user", "content": "the sky is"}]}]
    samples_q = queue.Queue()
    loop = make_loop(AsyncRolloutLoop, config, dataset, [length_reward], tokenizer, rollout_buffer=samples_q)
    groups = sorted(collect(loop, max_groups=4), key=lambda gk: gk[0].group_id)  # scored in completion order
    assert [g.group_id for g, _ in groups] == [0, 1, 2, 3] and [g.row_index for g, _ in groups] == [0, 1, 0, 1]
    model = AutoModelForCausalLM.from_pretrained(tiny_qwen3, dtype=torch.float32).eval()
    checked = 0
    for group, _ in groups:
        for i, seq in enumerate(group.completions_sequences):
            (sample,) = seq
            prompt_ids = tokenizer.apply_chat_template(group.prompts[i], add_generation_prompt=True)["input_ids"]
            assert sample.input_ids[: len(prompt_ids)] == list(prompt_ids)
            assert sample.input_ids[len(prompt_ids):] == group.completions_ids[i]
            with torch.no_grad():
                logits = model(torch.tensor([sample.input_ids])).logits[0]  # [L, V]
            logprobs = torch.log_softmax(logits / config.temperature, -1)
            pos = [j for j, m in enumerate(sample.completion_mask) if m]
            ref = logprobs[torch.tensor(pos) - 1, torch.tensor([sample.input_ids[j] for j in pos])]
            np.testing.assert_allclose([sample.sampler_logprobs[j] for j in pos], ref.numpy(), atol=1e-4)
            for j in pos:
                top_ref = torch.topk(logprobs[j - 1], 8)
                assert set(sample.sampler_top_ids[j].tolist()) == set(top_ref.indices.tolist())
                np.testing.assert_allclose(np.sort(sample.sampler_top_logprobs[j]),
                                           np.sort(top_ref.values.numpy()), atol=1e-4)
            checked += len(pos)
    assert checked == sum(len(g.completions_ids[i]) for g, _ in groups for i in range(4))
    published = []
    while not samples_q.empty():
        published.append(samples_q.get())
    kept_ids = {g.group_id for g, kept in groups if kept}
    assert {s.group_id for s in published if not isinstance(s, ConsumedGroup)} == kept_ids
    assert {s.group_id for s in published if isinstance(s, ConsumedGroup)} == {g.group_id for g, k in groups} - kept_ids


@dataclass
class CurriculumConfig(AsyncGRPOConfig):
    pass_rate_cap: float = 0.9


class CurriculumRolloutLoop(AsyncRolloutLoop):
    """The spec's curriculum example, as written."""

    def filter_prompt(self, row_index, row, epoch):
        return self.pass_rates.get(row_index, 0.0) < self.config.pass_rate_cap

    async def setup(self):
        self.pass_rates = {}

    def compute_advantages(self, group):
        scored = group.rewards[~np.isnan(group.rewards)]
        if len(scored):
            self.pass_rates[group.row_index] = float(np.mean(scored > 0))
        return super().compute_advantages(group)


def always_pass_on_row0(completion_ids, row_id, **kwargs):
    return [1.0 if r == 0 else float(len(ids) % 2) for ids, r in zip(completion_ids, row_id)]


@pytest.mark.vllm
def test_curriculum_example_filters_solved_prompts(vllm_server, tiny_qwen3, tokenizer):
    config = CurriculumConfig(**vars(make_config(vllm_server, tiny_qwen3)), pass_rate_cap=0.9)
    dataset = [{"prompt": PROMPT, "row_id": 0}, {"prompt": PROMPT, "row_id": 1}]
    buffer = queue.Queue()
    # An allowance smaller than one group: one group at a time, so each filter decision sees the previous scores.
    allowance = multiprocessing.Value("d", 1.0)
    loop = make_loop(CurriculumRolloutLoop, config, dataset, [always_pass_on_row0], tokenizer, rollout_buffer=buffer,
                     token_allowance=allowance)
    groups = sorted(collect(loop, max_groups=6), key=lambda gk: gk[0].group_id)
    assert loop.pass_rates[0] == 1.0 and loop.pass_rates[1] < 0.9
    filtered = [m.group_id for m in list(buffer.queue) if isinstance(m, ConsumedGroup) and m.reason == "filtered"]
    assert [g.group_id for g, _ in groups] == [0, 1, 3, 5] and filtered == [2, 4]


class RejectAll(AsyncRolloutLoop):
    def filter_prompt(self, row_index, row, epoch):
        return False


@pytest.mark.vllm
def test_epoch_rejecting_every_prompt_raises(vllm_server, tiny_qwen3, tokenizer):
    loop = make_loop(RejectAll, make_config(vllm_server, tiny_qwen3), [{"prompt": PROMPT}] * 3, [], tokenizer)
    with pytest.raises(BaseException, match="rejected every prompt of epoch 0"):
        asyncio.run(loop.run())
