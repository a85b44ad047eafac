"""The dispatcher over several vLLM servers, without servers: group affinity, one concurrency cap per server,
re-dispatch when a server dies (or the trainer drops it), the named error when none is left, and the weight
sync's drop-or-raise rule. The generation clients and control planes are stand-ins that record what reached them;
the scheduler, the pool and `WeightSync` under test are the real ones. Real two-server runs: test_servers.py."""

from __future__ import annotations

import asyncio
import multiprocessing
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from grpo.config import AsyncGRPOConfig
from grpo.nccl_broadcast import nccl_rank_offsets
from grpo.rollout_loop import AsyncRolloutLoop
from grpo.samples import TurnRecord
from grpo.server_pool import NoServerLeftError, ServerPool
from grpo.shared_state import LoopOptions, SharedState
from grpo.vllm_client import ServerMetrics, ServerUnreachableError
from grpo.weight_sync import WeightSync, WeightSyncConfig, WeightSyncError

PROMPTS = [{"prompt": [{"role": "user", "content": f"What is {i} + {i}?"}]} for i in range(6)]


def index_reward(completion_ids, **kwargs):
    return [float(i) for i in range(len(completion_ids))]  # never equal: every group is kept


class StandInServer:
    """A generation client that answers after a short sleep, counts its concurrent requests, and can die after
    `die_after` requests: every later request raises ServerUnreachableError, as VLLMClient does for a refused port
    (the requests already running finish, so a group can lose its server half-way)."""

    def __init__(self, url: str, kv_max_concurrency: float = 0.0, die_after: int | None = None):
        self.base_url, self.kv_max_concurrency, self.die_after = url, kv_max_concurrency, die_after
        self.retry_count = self.metrics_error_count = 0
        self.requests = self.inflight = self.peak = 0
        self.dead = False

    async def metrics(self):
        return None if self.dead else ServerMetrics(0.1, self.inflight, 0, 0.0, self.kv_max_concurrency)

    async def generate(self, prompt_ids, **kwargs) -> TurnRecord:
        self.requests += 1
        doomed = self.die_after is not None and self.requests > self.die_after
        self.dead = self.dead or doomed
        self.inflight += 1
        self.peak = max(self.peak, self.inflight)
        try:
            await asyncio.sleep(0.01)
            if doomed:
                raise ServerUnreachableError(self.base_url, f"vLLM server at {self.base_url} unreachable (test)")
            return TurnRecord(list(prompt_ids), [5 + self.requests % 7, 2], [-1.0, -0.5], finish_reason="stop")
        finally:
            self.inflight -= 1

    async def close(self):
        pass


def run_loop(tokenizer, servers, groups: int, alive_flags=None, **config):
    cfg = AsyncGRPOConfig(**({"model": "tiny", "num_generations": 4, "max_completion_length": 4,
                              "max_concurrent_rollouts": 8} | config))
    seen = []
    loop = AsyncRolloutLoop(cfg, "tiny", PROMPTS, [index_reward], tokenizer, [tokenizer.eos_token_id],
                            SharedState(servers_alive=alive_flags),
                            LoopOptions(client=list(servers), group_callback=lambda g, adv, kept: seen.append(g)))
    asyncio.run(loop.run(max_groups=groups))
    return loop, seen


@pytest.fixture(scope="module")
def tokenizer(tiny_qwen3):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_qwen3)


def test_every_group_stays_on_one_server_and_both_servers_get_groups(tokenizer):
    servers = [StandInServer("http://a"), StandInServer("http://b")]
    _, groups = run_loop(tokenizer, servers, groups=12)
    assert sorted(g.group_id for g in groups) == list(range(12))
    homes = [{r.server for r in g.rollouts} for g in groups]
    assert all(len(h) == 1 for h in homes), homes
    assert {h.pop() for h in homes} == {"http://a", "http://b"}
    assert sum(s.requests for s in servers) == 12 * 4


def test_idle_servers_take_groups_in_turn_and_a_busy_one_is_passed_over():
    pool = ServerPool(["http://a", "http://b"], [None, None], max_concurrent=8)
    assert [pool.pick().index for _ in range(4)] == [0, 1, 0, 1]  # all idle: the fewest groups placed first
    pool.servers[0].cap.inflight = 1
    assert pool.pick().index == 1


def test_each_server_keeps_under_its_own_cap(tokenizer):
    """Caps start from each server's own kv_cache_max_concurrency (2 and 5); G=4 never fits in 2 at once."""
    servers = [StandInServer("http://a", kv_max_concurrency=2), StandInServer("http://b", kv_max_concurrency=5)]
    loop, groups = run_loop(tokenizer, servers, groups=16)
    assert [s.cap.initial_limit for s in loop.pool.servers] == [2, 5]
    assert servers[0].peak <= 2 and servers[1].peak <= 5, (servers[0].peak, servers[1].peak)
    assert servers[1].peak > 2  # the larger cap was used, not the smaller one everywhere
    assert len(groups) == 16


def test_a_dead_server_rollouts_move_to_the_survivor_and_nothing_is_lost(tokenizer):
    servers = [StandInServer("http://a"), StandInServer("http://b", die_after=6)]
    loop, groups = run_loop(tokenizer, servers, groups=10)
    assert sorted(g.group_id for g in groups) == list(range(10))  # every group completed: nothing lost
    assert all(len(g.rollouts) == 4 for g in groups)
    assert not loop.pool.servers[1].alive and loop.pool.servers[0].alive
    moved = [g for g in groups if len({r.server for r in g.rollouts}) > 1]
    assert moved, "the group half-way on b when it died should have finished on a"
    for g in moved:  # a group that lost its server finished its remaining rollouts on the survivor
        assert {r.server for r in g.rollouts} == {"http://a", "http://b"}
    late = [g for g in groups if g.group_id >= 6]
    assert all({r.server for r in g.rollouts} == {"http://a"} for g in late)


def test_no_server_left_is_a_named_error(tokenizer):
    servers = [StandInServer("http://a", die_after=2), StandInServer("http://b", die_after=2)]
    with pytest.raises(NoServerLeftError, match="no vLLM server left") as info:
        run_loop(tokenizer, servers, groups=6, server_rejoin_wait_s=0.5)
    assert "restart" in str(info.value) and "server_rejoin_wait_s" in str(info.value)
    assert "restart" in str(info.value) and "http://a" in str(info.value) and "http://b" in str(info.value)


def test_a_server_the_trainer_dropped_gets_no_rollout(tokenizer):
    flags = multiprocessing.get_context("spawn").Array("b", [1, 0])
    servers = [StandInServer("http://a"), StandInServer("http://b")]
    loop, groups = run_loop(tokenizer, servers, groups=4, alive_flags=flags)
    assert servers[1].requests == 0 and len(groups) == 4
    assert not loop.pool.servers[1].alive


def test_one_nccl_group_spans_all_servers_workers():
    # trainer = rank 0; server 0 (TP 2) = ranks 1-2; server 1 (DP 2 x TP 2) = ranks 3-6
    assert nccl_rank_offsets([2, 4]) == ([1, 3], 7)
    assert nccl_rank_offsets([1]) == ([1], 2)


# ---- the weight sync over several servers -----------------------------------------------------------------------


class StandInControl:
    """The control-plane calls a sync makes, recorded; `fail_on` names the call that raises."""

    def __init__(self, fail_on: str | None = None):
        self.fail_on, self.calls, self.loaded = fail_on, [], None

    def _call(self, name):
        self.calls.append(name)
        if name == self.fail_on:
            raise ConnectionError(f"{name}: connection refused (test)")

    def pause(self, mode="keep", clear_cache=True):
        self._call("pause")

    def resume(self):
        self._call("resume")

    def start_weight_update(self):
        self._call("start")

    def update_weights(self, info, timeout=None):
        self._call("update")
        self.loaded = load_file(info["path"])

    def finish_weight_update(self, weight_version=None):
        self._call(f"finish:{weight_version}")

    def close(self):
        pass


def make_sync(controls):
    model = torch.nn.Sequential(torch.nn.Linear(3, 2))
    sync = WeightSync([f"http://s{i}" for i in range(len(controls))], WeightSyncConfig(mode="cpu_file",
                                                                                      server_dtype="float32"))
    sync.controls = controls
    sync.plan = __import__("grpo.send_plan", fromlist=["build_plan"]).build_plan(model, torch.float32)
    return sync, model


@pytest.mark.parametrize("fail_on", ["pause", "update", "resume"])
def test_a_server_failing_its_sync_is_dropped_and_the_others_get_the_version(fail_on):
    controls = [StandInControl(), StandInControl(fail_on), StandInControl()]
    sync, model = make_sync(controls)
    sync.sync(model, 3)
    assert list(sync.alive_flags) == [1, 0, 1]
    for c in (controls[0], controls[2]):
        assert c.calls == ["pause", "start", "update", "finish:3", "resume"]
        torch.testing.assert_close(c.loaded["0.weight"], model[0].weight.detach())
    sync.sync(model, 4)  # the dropped server is left out of the next sync
    assert controls[1].calls.count("pause") == 1 and controls[0].calls[-2] == "finish:4"


def test_the_last_server_failing_its_sync_raises():
    controls = [StandInControl(), StandInControl("update")]
    sync, model = make_sync(controls)
    sync.alive_flags[0] = 0  # the rollout worker found server 0 dead
    with pytest.raises(WeightSyncError, match="(?s)http://s1.*restart"):
        sync.sync(model, 2)
    assert controls[0].calls == [] and list(sync.alive_flags) == [0, 1]


class StandInLoraControl(StandInControl):
    def __init__(self, fail_on: str | None = None):
        super().__init__(fail_on)
        self.adapters: dict[str, str] = {}

    def load_lora_adapter(self, name, path):
        self._call("load")
        self.adapters[name] = path

    def unload_lora_adapter(self, name):
        self._call("unload")
        self.adapters.pop(name)


def test_adapter_sync_reaches_every_server_and_drops_a_failing_one(tiny_qwen3, tmp_path):
    from test_lora import peft_model

    from grpo.lora import AdapterVersions

    model = peft_model(tiny_qwen3, seed=0)
    controls = [StandInLoraControl(), StandInLoraControl("load"), StandInLoraControl()]
    sync = WeightSync(["http://s0", "http://s1", "http://s2"], WeightSyncConfig(mode="cpu_file"),
                      adapter=AdapterVersions(tmp_path, "pol", keep=2))
    sync.controls = controls
    for version in (1, 2, 3):
        sync.sync(model, version)
    assert list(sync.alive_flags) == [1, 0, 1]
    for c in (controls[0], controls[2]):  # the window of 2 versions on every server that is left
        assert sorted(c.adapters) == ["pol-v2", "pol-v3"]
        assert (Path(c.adapters["pol-v3"]) / "adapter_model.safetensors").exists()
    assert controls[1].adapters == {}


def test_one_url_or_several_on_the_cli_and_in_python():
    import tyro

    def parse(*args):
        return tyro.cli(AsyncGRPOConfig, args=list(args)).vllm_server_urls

    assert parse() == ("http://localhost:8000",)
    assert parse("--vllm-server-base-url", "http://a:8000/") == ("http://a:8000",)
    assert parse("--vllm-server-base-url", "http://a:8000", "http://b:8001") == ("http://a:8000", "http://b:8001")
    assert AsyncGRPOConfig(vllm_server_base_url=["http://a", "http://b"]).vllm_server_urls == ("http://a", "http://b")
    with pytest.raises(ValueError, match="'loss:typo' is not a server URL.*loss:dapo"):  # tyro read it as a URL
        parse("--vllm-server-base-url", "http://a:8000", "loss:typo")
    with pytest.raises(ValueError, match="distinct"):
        AsyncGRPOConfig(vllm_server_base_url=("http://a", "http://a/")).vllm_server_urls
