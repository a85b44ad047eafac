"""AsyncRolloutLoop against a real vLLM CPU server: sampled groups, scoring, curriculum hooks, tools, environments,
the adaptive concurrency cap and token-allowance backpressure. Pure scoring cases are checked by hand."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import multiprocessing
import queue
import threading
import time

import numpy as np
import pytest

from api_example import CurriculumConfig, CurriculumRolloutLoop  # the spec's curriculum example, as written
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
    """`kw`: `SharedState` fields (samples, metrics, model_version, ...) and `LoopOptions` fields (tools, ...)."""
    from grpo.shared_state import LoopOptions, SharedState

    shared = {k: kw.pop(k) for k in list(kw) if k in SharedState.__dataclass_fields__}
    return cls(config, config.model, dataset, reward_funcs, tokenizer, [tokenizer.eos_token_id],
               SharedState(**shared), LoopOptions(**kw))


@pytest.fixture(scope="module")
def tokenizer(tiny_qwen3):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_qwen3)


def collect(loop, max_groups):
    groups = []
    loop.group_callback = lambda g, advantages, kept: groups.append((g, kept))
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


def test_nonfinite_rewards_are_unscored_and_counted_by_source():
    """NaN / +inf / -inf from any source are scored as None and listed per source; None is not counted."""
    class Env:
        pass

    group = fake_group([[0, 0, 0, 0]], env=[(Env, np.inf), (Env, 1), (Env, None), (Env, np.float32(2.0))],
                       rollout_rewards=[None, float("nan"), None, None])
    sources = asyncio.run(score_group(group, [Fixed([-np.inf, 1.0, None, True])]))
    np.testing.assert_array_equal(group.rewards, [np.nan, 2.0, np.nan, 3.0])
    np.testing.assert_array_equal(sources["Fixed"], [np.nan, 1.0, np.nan, 1.0])
    assert group.nonfinite_rewards.keys() == {"Fixed", "Env", "rollout_reward"}  # NaN != NaN: compared by key
    assert group.nonfinite_rewards["Fixed"] == [-np.inf] and group.nonfinite_rewards["Env"] == [np.inf]
    w = MetricsWindow()
    w.extend(group_metrics(group, sources, kept=True, eos_token_ids={2}))
    out = w.reduce()
    assert out["rewards/nonfinite_count"] == 3 and out["rewards/Env/nonfinite_count"] == 1


def scalar_reward(completions, **kwargs):
    return 1.0


@pytest.mark.parametrize("fn, needle", [
    (Fixed(["1.0", 1.0, 1.0, 1.0]), "reward function 'Fixed' returned '1.0' (str) for completion 0"),
    (Fixed([1.0, {"score": 1}, 1.0, 1.0]), "reward function 'Fixed' returned {'score': 1} (dict) for completion 1"),
    (scalar_reward, "reward function 'scalar_reward' returned 1.0 (float) for 4 completions")])
def test_non_number_rewards_are_a_type_error_naming_the_function(fn, needle):
    with pytest.raises(TypeError, match="make it return") as info:
        asyncio.run(score_group(fake_group([[0, 0, 0, 0]]), [fn]))
    assert needle in str(info.value)


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
    loop = make_loop(AsyncRolloutLoop, config, dataset, [length_reward], tokenizer, samples=samples_q)
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
                ids = sample.sampler_top_ids[j].tolist()
                # the top-8 set up to ties at the 8th place: every id the sampler names is distinct and at least as
                # likely under the reference as its 8th-best token (float noise may swap two near-equal tokens)
                assert len(set(ids)) == 8
                assert logprobs[j - 1][ids].min().item() >= top_ref.values[-1].item() - 1e-4, (ids, top_ref)
                np.testing.assert_allclose(np.sort(sample.sampler_top_logprobs[j]),
                                           np.sort(top_ref.values.numpy()), atol=1e-4)
                np.testing.assert_allclose(sample.sampler_top_logprobs[j], logprobs[j - 1][ids].numpy(), atol=1e-4)
            checked += len(pos)
    assert checked == sum(len(g.completions_ids[i]) for g, _ in groups for i in range(4))
    published = []
    while not samples_q.empty():
        published.append(samples_q.get())
    kept_ids = {g.group_id for g, kept in groups if kept}
    assert {s.group_id for s in published if not isinstance(s, ConsumedGroup)} == kept_ids
    assert {s.group_id for s in published if isinstance(s, ConsumedGroup)} == {g.group_id for g, k in groups} - kept_ids


def always_pass_on_row0(completion_ids, row_id, **kwargs):
    return [1.0 if r == 0 else float(len(ids) % 2) for ids, r in zip(completion_ids, row_id)]


@pytest.mark.vllm
def test_curriculum_example_filters_solved_prompts(vllm_server, tiny_qwen3, tokenizer):
    config = CurriculumConfig(**vars(make_config(vllm_server, tiny_qwen3)), pass_rate_cap=0.9)
    dataset = [{"prompt": PROMPT, "row_id": 0}, {"prompt": PROMPT, "row_id": 1}]
    buffer = queue.Queue()
    # An allowance smaller than one group: one group at a time, so each filter decision sees the previous scores.
    allowance = multiprocessing.Value("d", 1.0)
    loop = make_loop(CurriculumRolloutLoop, config, dataset, [always_pass_on_row0], tokenizer, samples=buffer,
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


# ---- tools and environments (scripted turns through the real chat template) -------------------------------


def multiply(a: int, b: int) -> int:
    """
    Multiplies two integers.

    Args:
        a: The first integer.
        b: The second integer.
    """
    return a * b


async def async_add(a: int, b: int) -> int:
    """
    Adds two integers.

    Args:
        a: The first integer.
        b: The second integer.
    """
    await asyncio.sleep(0.01)
    return a + b


def call_text(name, **args):
    import json

    return f'\n<tool_call>\n{{"name": "{name}", "arguments": {json.dumps(args)}}}\n</tool_call>'


class ScriptedLoop(AsyncRolloutLoop):
    """generate_one_turn replaced by a script keyed on how many tool responses the prompt already holds."""

    script: tuple[str, ...] = ()

    async def generate_one_turn(self, prompt_ids):
        done = self.tokenizer.decode(prompt_ids).count("<tool_response>")
        text = self.script[min(done // max(self.calls_per_turn, 1), len(self.script) - 1)]
        ids = self.tokenizer.encode(text, add_special_tokens=False) + [self.tokenizer.eos_token_id]
        return TurnRecord(list(prompt_ids), ids, [-1.0] * len(ids), finish_reason="stop")

    calls_per_turn = 1


class ToolScript(ScriptedLoop):
    script = (call_text("multiply", a=3, b=4) + call_text("async_add", a=1, b=2) + call_text("nope", x=1),
              "The answer is 12.")
    calls_per_turn = 3


def run_scripted(loop, max_groups):
    metrics = queue.Queue()
    loop.shared = dataclasses.replace(loop.shared, metrics=metrics)
    groups = collect(loop, max_groups)
    w = MetricsWindow()
    while not metrics.empty():
        w.extend(metrics.get())
    return groups, w.reduce()


@pytest.mark.vllm
def test_tool_loop_runs_sync_and_async_tools(vllm_server, tiny_qwen3, tokenizer):
    config = make_config(vllm_server, tiny_qwen3, num_generations=2)
    loop = make_loop(ToolScript, config, [{"prompt": PROMPT}], [parity_reward], tokenizer, tools=[multiply, async_add])
    groups, out = run_scripted(loop, 1)
    (group, _), = groups
    rollout = group.rollouts[0]
    assert len(rollout.turns) == 2 and rollout.tool_call_count == 3 and rollout.tool_failure_count == 1
    tool_msgs = [m["content"] for m in rollout.completion if m["role"] == "tool"]
    assert tool_msgs[:2] == ["12", "3"] and "unknown tool 'nope'" in tool_msgs[2]
    assert rollout.completion[-1] == {"role": "assistant", "content": "The answer is 12."}
    # the tool schema reached the template, and the second prompt holds the tool results
    assert '"name": "multiply"' in tokenizer.decode(rollout.turns[0].prompt_ids)
    assert "<tool_response>\n12\n</tool_response>" in tokenizer.decode(rollout.turns[1].prompt_ids)
    trained = sum(s.num_trained for s in group.completions_sequences[0])
    assert trained == sum(len(t.output_ids) for t in rollout.turns)  # every generated token trained once
    assert out["tools/unknown_name_count"] == 2 and out["tools/multiply/call_count"] == 2
    assert out["tools/failure_frequency"] == pytest.approx(2 / 6) and out["tools/call_frequency"] == 3
    assert out["tools/parallel_calls_mean"] == 3 and out["tools/loop_exhausted_frac"] == 0.0


class AlwaysCalls(ScriptedLoop):
    script = (call_text("multiply", a=2, b=2),)


@pytest.mark.vllm
def test_max_tool_calling_iterations_stops_the_loop(vllm_server, tiny_qwen3, tokenizer):
    config = make_config(vllm_server, tiny_qwen3, num_generations=2, max_tool_calling_iterations=2)
    loop = make_loop(AlwaysCalls, config, [{"prompt": PROMPT}], [parity_reward], tokenizer, tools=[multiply])
    groups, out = run_scripted(loop, 1)
    rollout = groups[0][0].rollouts[0]
    assert len(rollout.turns) == 3 and rollout.tool_call_count == 2
    assert out["tools/loop_exhausted_frac"] == 1.0


class IncrementEnv:
    """The spec's dataset-driven environment."""

    instances = 0

    def __init__(self):
        IncrementEnv.instances += 1

    def reset(self, target, **kwargs) -> None:
        self.counter = 0
        self.target = target

    def get_reward(self) -> float:
        return float(self.counter == self.target)

    def increment(self, step: int) -> int:
        """
        Increment the internal counter.

        Args:
            step: Value to add to the counter.
        """
        self.counter += step
        return self.counter


class SelfSampledEnv:
    def reset(self, **kwargs) -> str:
        self.done = False
        return "Increment the counter by 2."

    async def get_reward(self) -> float:
        return 0.5

    def increment(self, step: int) -> int:
        """
        Increment.

        Args:
            step: Value to add.
        """
        return step


class IncrementByTwo(ScriptedLoop):
    script = (call_text("increment", step=2), "done")


@pytest.mark.vllm
def test_environments_reset_expose_tools_and_reward(vllm_server, tiny_qwen3, tokenizer):
    config = make_config(vllm_server, tiny_qwen3, num_generations=2, max_concurrent_rollouts=2)
    dataset = [{"prompt": PROMPT, "target": 2, "environment": "inc"}, {"prompt": PROMPT, "target": 3,
                                                                       "environment": "inc"},
               {"environment": "self"}]
    factory = {"inc": IncrementEnv, "self": SelfSampledEnv}
    loop = make_loop(IncrementByTwo, config, dataset, [], tokenizer, environment_factory=factory)
    groups, out = run_scripted(loop, 3)
    by_row = {g.row_index: g for g, _ in groups}
    np.testing.assert_array_equal(by_row[0].rewards, [1.0, 1.0])
    np.testing.assert_array_equal(by_row[1].rewards, [0.0, 0.0])
    np.testing.assert_array_equal(by_row[2].rewards, [0.5, 0.5])
    assert by_row[2].prompts[0] == [{"role": "user", "content": "Increment the counter by 2."}]
    assert by_row[0].env_rewards[0][0] is IncrementEnv
    assert IncrementEnv.instances <= 2  # instances are reused across groups, not rebuilt per rollout
    assert out["env/reset_s"] >= 0 and out["env/reward_s"] >= 0
    assert '"name": "increment"' in tokenizer.decode(by_row[0].rollouts[0].turns[0].prompt_ids)
    assert "reset" not in tokenizer.decode(by_row[0].rollouts[0].turns[0].prompt_ids)


# ---- flow control --------------------------------------------------------------------------------------------


@pytest.mark.vllm
def test_backpressure_keeps_queued_and_inflight_tokens_within_the_allowance(vllm_server, tiny_qwen3, tokenizer):
    config = make_config(vllm_server, tiny_qwen3, num_generations=4, max_completion_length=16)
    prompt_len = len(tokenizer.apply_chat_template(PROMPT, add_generation_prompt=True)["input_ids"])
    group_tokens_max = 4 * (prompt_len + 16)  # every sample is prompt + at most 16 generated tokens
    allowance_tokens = 2.5 * group_tokens_max
    queued, allowance = multiprocessing.Value("q", 0), multiprocessing.Value("d", allowance_tokens)
    buffer, metrics = queue.Queue(), queue.Queue()
    loop = make_loop(AsyncRolloutLoop, config, [{"prompt": PROMPT}] * 8, [length_reward], tokenizer,
                     samples=buffer, metrics=metrics, token_allowance=allowance, queued_tokens=queued)
    peak, done = [0.0], threading.Event()

    def observe():
        while not done.is_set():
            # actual queued tokens + an upper bound on the tokens of groups still generating or scoring
            peak[0] = max(peak[0], queued.value + loop.allowance.inflight_groups * group_tokens_max)
            time.sleep(0.005)

    def slow_trainer():
        while not done.is_set():
            try:
                item = buffer.get(timeout=0.1)
            except queue.Empty:
                continue
            if not isinstance(item, ConsumedGroup):
                time.sleep(0.1)
                with queued.get_lock():
                    queued.value -= len(item)

    threads = [threading.Thread(target=observe), threading.Thread(target=slow_trainer)]
    for t in threads:
        t.start()
    try:
        asyncio.run(loop.run(max_groups=8))
    finally:
        done.set()
        for t in threads:
            t.join()
    w = MetricsWindow()
    while not metrics.empty():
        w.extend(metrics.get())
    out = w.reduce()
    assert 0 < peak[0] <= allowance_tokens
    assert out["rollout/backpressure_s"] > 0


class FastPoll(AsyncRolloutLoop):
    metrics_poll_s = 0.25


@pytest.fixture(scope="module")
def small_kv_server(tiny_qwen3, tmp_path_factory):
    """16 KV blocks of 128 tokens (kv_cache_max_concurrency = 4 at max_model_len 512), prefix caching off so
    rollouts of a group do not share prompt blocks (docs/design.md §15)."""
    from conftest import start_server

    server = start_server(tiny_qwen3, tmp_path_factory.mktemp("vllm_small_kv"), kv_cache_bytes=2097152,
                          extra_args=("--no-enable-prefix-caching",))
    yield server
    server.stop()


def wait_until(predicate, timeout: float, what):
    """Poll `predicate` every 50 ms until it is true; fail naming `what` (a callable gives the state seen) after
    `timeout` seconds. A deadline against hangs, not a timed assertion."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out after {timeout:.0f} s: {what() if callable(what) else what}"
        time.sleep(0.05)


def server_gauges(server):
    import httpx

    from grpo.vllm_metrics import parse_metrics

    return parse_metrics(httpx.get(f"{server.base_url}/metrics", timeout=30).text)


def fill_and_freeze_kv_cache(server, model, prompt_ids, pool, timeout: float = 180):
    """Hold the server's KV cache full: 40 requests of 3 KV blocks each (5 fill the 15 usable blocks, the rest
    queue behind them, so the cache stays full while they drain), then `/pause?mode=keep&clear_cache=false`, which
    freezes the running requests holding their blocks. Done when the paused server's own gauge reads > 0.8; else
    resume, let it run on, pause again (new requests once these finished). While paused the gauge cannot move, so
    every /metrics poll of the loop then reads the same full cache. (Polls of a running, busy server read a lagging
    gauge: the old version of this test, which hoped a poll would land on a full cache, failed in full sessions.)
    Returns the requests' futures; they finish after /resume."""
    import httpx

    body = {"model": model, "prompt": prompt_ids, "max_tokens": 100, "ignore_eos": True, "temperature": 1.0}
    futures, deadline = [], time.monotonic() + timeout
    while True:
        if all(f.done() for f in futures):
            futures = [pool.submit(httpx.post, f"{server.base_url}/v1/completions", json=body, timeout=600)
                       for _ in range(40)]
        httpx.post(f"{server.base_url}/pause", params={"mode": "keep", "clear_cache": "false"}, timeout=60)
        gauges = server_gauges(server)
        if gauges.kv_cache_usage > 0.8:
            return futures
        httpx.post(f"{server.base_url}/resume", timeout=60)
        assert time.monotonic() < deadline, f"no full KV cache to freeze within {timeout:.0f} s: {gauges}"


@pytest.mark.vllm
@pytest.mark.slow
def test_concurrency_cap_shrinks_under_load_and_grows_when_idle(small_kv_server, tiny_qwen3, tokenizer):
    """Driven by the server's own KV gauge: a cache held full (paused with its requests frozen in it) must shrink
    the loop's cap at its next polls; once resumed and drained, the cap must grow back as rollouts finish."""
    import httpx
    from concurrent.futures import ThreadPoolExecutor

    # ~268-token prompts + at most 110 generated tokens: every request holds 3 of the 16 KV blocks (vLLM keeps one
    # back: 15 usable), so 5 requests fill the cache and the loop's 4 rollouts alone never exceed 12/15 = 0.8.
    # Prefix caching is off, so nothing is shared.
    content = " ".join(["the word of", "and to in"][i % 2] for i in range(84))
    prompt = [{"role": "user", "content": content}]
    prompt_ids = tokenizer.apply_chat_template(prompt, add_generation_prompt=True)["input_ids"]
    assert 256 < len(prompt_ids) < 384 - 110
    config = make_config(small_kv_server, tiny_qwen3, num_generations=4, max_completion_length=110,
                         max_concurrent_rollouts=16)
    metrics, stop = queue.Queue(), threading.Event()
    loop = make_loop(FastPoll, config, [{"prompt": prompt}] * 8, [length_reward], tokenizer, metrics=metrics,
                     stop=stop)
    seen = {"rollout/concurrency_cap": [], "rollout/vllm_kv_cache_usage_frac": [], "rollout/vllm_queued_requests": []}

    def drain():
        while not metrics.empty():
            for name, value in metrics.get():
                if name in seen:
                    seen[name].append(round(value, 2))
        return seen

    def grew_back():
        caps = drain()["rollout/concurrency_cap"]
        return bool(caps) and max(caps[caps.index(min(caps)):]) > min(caps)

    with ThreadPoolExecutor(max_workers=48) as pool:
        frozen = fill_and_freeze_kv_cache(small_kv_server, str(tiny_qwen3), prompt_ids, pool)
        runner = pool.submit(asyncio.run, loop.run())
        try:
            # paused with a full cache: every poll reads usage > 0.8, so the cap must fall below its start
            wait_until(lambda: runner.done() or (loop.cap is not None and loop.cap.limit < loop.cap.initial_limit),
                       120, lambda: f"the cap to shrink; polls saw {drain()}")
            httpx.post(f"{small_kv_server.base_url}/resume", timeout=60)
            for f in frozen:
                assert f.result().status_code == 200
            # resumed: the frozen requests finished, the loop's rollouts finish one by one with the cache mostly
            # free and nothing queued, so the cap must rise above its low
            wait_until(lambda: runner.done() or grew_back(), 300, lambda: f"the cap to grow back; polls saw {drain()}")
        finally:
            stop.set()
            httpx.post(f"{small_kv_server.base_url}/resume", timeout=60)
            runner.result(timeout=300)  # raises the loop's own failure, if any
    drain()
    caps, usage = seen["rollout/concurrency_cap"], seen["rollout/vllm_kv_cache_usage_frac"]
    assert loop.cap.initial_limit == 4  # kv_cache_max_concurrency = 2048 KV tokens / max_model_len 512
    assert max(usage) > 0.8 and min(caps) < 4, seen  # the loop itself read the full cache and shrank
    assert max(caps[caps.index(min(caps)):]) > min(caps), seen  # grew back once the cache had room


@pytest.mark.vllm
def test_rollout_sample_command_prints_summary(vllm_server, tiny_qwen3, tmp_path):
    import json
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    out = tmp_path / "groups.jsonl"
    cmd = [sys.executable, "rollout.py", "sample", "--model", str(tiny_qwen3), "--vllm-server-base-url",
           vllm_server.base_url, "--dataset", "builtin:letters", "--reward-funcs", "letters", "--num-generations", "4",
           "--max-completion-length", "16", "--num-prompts", "3", "--output", str(out)]
    result = subprocess.run(cmd, cwd=repo, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "groups 3" in result.stdout and "reward mean" in result.stdout and "tokens/s" in result.stdout
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert sorted(r["group_id"] for r in records) == [0, 1, 2]
    assert all(len(r["rewards"]) == 4 and len(r["completion_ids"]) == 4 for r in records)


def index_reward(completion_ids, **kwargs):
    return [float(i) for i in range(len(completion_ids))]


class VersionBump(ScriptedLoop):
    """Every sampling request advances the shared version, as weight syncs would during generation."""

    script = ("answer",)

    async def generate_one_turn(self, prompt_ids):
        await asyncio.sleep(0.01)
        self.shared.model_version.value += 1
        return await super().generate_one_turn(prompt_ids)


@pytest.mark.vllm
def test_group_version_is_read_at_first_dispatch_and_resume_skips_ahead(vllm_server, tiny_qwen3, tokenizer):
    config = make_config(vllm_server, tiny_qwen3, num_generations=3, max_concurrent_rollouts=2)
    version = multiprocessing.Value("q", 7)
    buffer = queue.Queue()
    loop = make_loop(VersionBump, config, [{"prompt": PROMPT}] * 2, [index_reward], tokenizer,
                     samples=buffer, model_version=version, dataset_start_index=3)
    groups = sorted(collect(loop, max_groups=3), key=lambda gk: gk[0].group_id)
    assert [g.row_index for g, _ in groups] == [1, 0, 1]  # prompt 3 of a 2-row dataset: epoch 1, row 1
    assert groups[0][0].model_version == 7  # read when its first rollout was dispatched, before any bump
    # the third rollout of group 0 waited for a slot while versions advanced; the group keeps version 7
    assert all(later[0].model_version > 7 for later in groups[1:])
    samples = [s for s in buffer.queue if not isinstance(s, ConsumedGroup)]
    assert len(samples) == 9
    for group, kept in groups:
        assert all(s.model_version == group.model_version for s in samples if s.group_id == group.group_id)


class ContextFills(ScriptedLoop):
    """The second turn's prompt (tool results included) no longer fits max_model_len."""

    script = (call_text("multiply", a=3, b=4), "done")

    async def generate_one_turn(self, prompt_ids):
        from grpo.vllm_client import PromptTooLongError

        if "<tool_response>" in self.tokenizer.decode(prompt_ids):
            raise PromptTooLongError(len(prompt_ids), len(prompt_ids))
        return await super().generate_one_turn(prompt_ids)


class PromptTooLong(ScriptedLoop):
    async def generate_one_turn(self, prompt_ids):
        from grpo.vllm_client import PromptTooLongError

        raise PromptTooLongError(len(prompt_ids), 8)


def test_prompt_too_long_stops_the_run_but_a_full_conversation_just_ends(tiny_qwen3, tokenizer):
    """The spec: a prompt the server cannot take stops the run with its error (it used to be swallowed); tool
    results filling max_model_len end that conversation, counted, and its turns are trained."""
    from grpo.vllm_client import PromptTooLongError

    config = AsyncGRPOConfig(model=str(tiny_qwen3), vllm_server_base_url="http://127.0.0.1:9", num_generations=2)
    loop = make_loop(ContextFills, config, [{"prompt": PROMPT}], [parity_reward], tokenizer, tools=[multiply])
    groups, out = run_scripted(loop, 1)
    assert len(groups) == 1 and out["tools/context_full_count"] == 2
    assert all(len(r.turns) == 1 for r in groups[0][0].rollouts)
    loop = make_loop(PromptTooLong, config, [{"prompt": PROMPT}], [parity_reward], tokenizer)
    with pytest.raises(PromptTooLongError, match="max-model-len") as info:
        asyncio.run(loop.run(max_groups=1))
    assert "What is 3 + 4?" in "".join(info.value.__notes__)


def test_drop_reasons():
    from grpo.scoring import drop_reason

    assert drop_reason(np.array([1.0, 0.0]), 2) is None
    assert drop_reason(np.array([1.0, 1.0]), 2) == "equal_rewards"
    assert drop_reason(np.array([np.nan, np.nan]), 2) == "unscored"
    assert drop_reason(np.array([1.0, 0.0]), 0) == "no_samples"
