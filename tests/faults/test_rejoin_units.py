"""Servers that come back, and sync phases that never answer, without real servers: the real `ServerPool`,
scheduler and `WeightSync` against stand-in generation clients and control planes (tests/test_server_pool.py) that
die, hang or come back on cue. The same faults against a real vLLM server: test_soak.py (a restart in place, the
rejoin, and the final model == what the server serves)."""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import threading
import time

import pytest
import torch
from test_server_pool import PROMPTS, StandInControl, StandInServer, index_reward, make_sync, run_loop

from grpo.config import AsyncGRPOConfig
from grpo.rollout_loop import AsyncRolloutLoop
from grpo.server_pool import NoServerLeftError
from grpo.shared_state import LoopOptions, SharedState
from grpo.weight_sync import WeightSyncConfig, WeightSyncError

from .harness import named_error, within


@pytest.fixture(scope="module")
def tokenizer(tiny_qwen3):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_qwen3)


def flags(*values):
    return multiprocessing.get_context("spawn").Array("b", list(values))


def come_back(server: StandInServer) -> None:
    server.dead, server.die_after = False, None


def test_a_dead_server_whose_flag_is_set_again_takes_groups_again(tokenizer):
    """Server b dies after 6 requests; once the 'trainer' sets its flag again (after a cold sync), later groups
    are placed on it again, and every group completes."""
    alive = flags(1, 1)
    servers = [StandInServer("http://a"), StandInServer("http://b", die_after=6)]
    done, requests_at_revival = [], []

    def on_group(group, advantages, kept):
        done.append(group.group_id)
        if servers[1].dead and not alive[1]:  # the worker marked it dead: the trainer brings it back
            come_back(servers[1])
            requests_at_revival.append(servers[1].requests)
            alive[1] = 1

    cfg = AsyncGRPOConfig(model="tiny", num_generations=4, max_completion_length=4, max_concurrent_rollouts=8)
    loop = AsyncRolloutLoop(cfg, "tiny", PROMPTS, [index_reward], tokenizer, [tokenizer.eos_token_id],
                            SharedState(servers_alive=alive), LoopOptions(client=servers, group_callback=on_group))
    within(60, asyncio.run, loop.run(max_groups=20))
    assert sorted(done) == list(range(20)) and requests_at_revival
    assert loop.pool.servers[1].alive and alive[1] == 1
    assert servers[1].requests > requests_at_revival[0], "the revived server took no rollout"


def test_the_only_server_dying_waits_for_it_to_come_back(tokenizer):
    """One server, restarted in place: the worker does not stop; it waits (bounded) until the flag is set again,
    then every group completes, the ones whose rollouts died with the server included."""
    alive = flags(1)
    server = StandInServer("http://only", die_after=5)

    def trainer_brings_it_back():  # as the trainer does: only a server the worker has marked dead is probed again
        while not (server.dead and not alive[0]):
            time.sleep(0.01)
        come_back(server)
        alive[0] = 1

    threading.Thread(target=trainer_brings_it_back, daemon=True).start()
    loop, groups = within(60, run_loop, tokenizer, [server], groups=4, alive_flags=alive,
                          server_rejoin_wait_s=30)
    assert sorted(g.group_id for g in groups) == [0, 1, 2, 3] and all(len(g.rollouts) == 4 for g in groups)
    assert loop.pool.servers[0].alive


def test_the_only_server_never_coming_back_is_named_after_the_wait(tokenizer):
    server = StandInServer("http://only", die_after=3)
    named_error(60, run_loop, "no vLLM server left", "http://only", "server_rejoin_wait_s",
                expected=NoServerLeftError, tokenizer=tokenizer, servers=[server], groups=4,
                server_rejoin_wait_s=1.0)


# ---- the trainer side: WeightSync -------------------------------------------------------------------------------


def rejoining_sync(controls, probe, **config):
    sync, model = make_sync(controls)
    sync.config = WeightSyncConfig(**({"mode": "cpu_file", "server_dtype": "float32", "rejoin_interval_s": 0.05}
                                      | config))
    sync.rejoiner.interval_s = sync.config.rejoin_interval_s
    sync.rejoiner.probe = probe
    return sync, model


def test_a_dropped_server_that_answers_again_gets_the_next_version_then_its_flag():
    controls = [StandInControl(), StandInControl("pause")]
    answers = {"http://s1": "ConnectError: refused"}
    sync, model = rejoining_sync(controls, lambda url: answers.get(url))
    sync.sync(model, 3)
    assert list(sync.alive_flags) == [1, 0]
    time.sleep(0.06)
    sync.sync(model, 4)  # still refused: probed, stays out
    assert list(sync.alive_flags) == [1, 0] and controls[1].calls == ["pause"]
    controls[1].fail_on, answers["http://s1"] = None, None  # restarted
    time.sleep(0.06)
    with torch.no_grad():
        model[0].weight.add_(1.0)
    sync.sync(model, 5)
    assert list(sync.alive_flags) == [1, 1]
    assert controls[1].calls[1:] == ["pause", "start", "update", "finish:5", "resume"]
    torch.testing.assert_close(controls[1].loaded["0.weight"], model[0].weight.detach())


def test_a_server_serving_another_model_is_not_let_back():
    controls = [StandInControl(), StandInControl("update")]
    sync, model = rejoining_sync(controls, lambda url: "serves 'other-model', not --model 'tiny'")
    sync.sync(model, 1)
    controls[1].fail_on = None
    time.sleep(0.06)
    sync.sync(model, 2)
    assert list(sync.alive_flags) == [1, 0] and "pause" not in controls[1].calls[3:]


def test_the_last_server_failing_a_sync_is_waited_for_and_cold_synced_alone():
    controls = [StandInControl("update")]
    probes = []

    def probe(url):
        probes.append(url)
        if len(probes) < 3:
            return "ConnectError: refused"
        controls[0].fail_on = None
        return None

    sync, model = rejoining_sync(controls, probe, rejoin_wait_s=30.0)
    within(30, sync.sync, model, 7)
    assert list(sync.alive_flags) == [1] and len(probes) == 3
    assert controls[0].calls[-4:] == ["start", "update", "finish:7", "resume"]
    torch.testing.assert_close(controls[0].loaded["0.weight"], model[0].weight.detach())


def test_the_last_server_never_coming_back_ends_the_sync_after_the_wait():
    controls = [StandInControl("pause")]
    sync, model = rejoining_sync(controls, lambda url: "ConnectError: refused", rejoin_wait_s=0.5)
    named_error(30, sync.sync, "http://s0", "server_rejoin_wait_s", "resume-from-checkpoint",
                expected=WeightSyncError, model=model, version=2)


class HangingControl(StandInControl):
    """A server that stops answering (SIGSTOP) in one phase: the call blocks until released."""

    def __init__(self, hang_on: str):
        super().__init__()
        self.hang_on, self.release = hang_on, threading.Event()

    def _call(self, name):
        super()._call(name)
        if name.split(":")[0] == self.hang_on:
            self.release.wait(60)


@pytest.mark.parametrize("phase", ["pause", "start", "update", "finish", "resume"])
def test_a_server_silent_in_a_phase_is_named_with_progress_lines_and_dropped_at_the_deadline(phase, caplog):
    hung = HangingControl(phase)
    controls = [StandInControl(), hung]
    sync, model = rejoining_sync(controls, None, phase_timeout=1.5, progress_every=0.4)
    try:
        with caplog.at_level(logging.WARNING):
            within(30, sync.sync, model, 3)
    finally:
        hung.release.set()
    assert list(sync.alive_flags) == [1, 0]
    assert controls[0].calls == ["pause", "start", "update", "finish:3", "resume"]
    label = {"update": "transfer"}.get(phase, phase)
    progress = [r.getMessage() for r in caplog.records if "still waiting for http://s1" in r.getMessage()]
    assert progress and all(f"{label} phase of weight sync version 3" in m for m in progress), progress
    dropped = [r.getMessage() for r in caplog.records if "dropping vLLM server http://s1" in r.getMessage()]
    assert dropped and "weight_sync_timeout" in dropped[0], dropped


def test_the_only_server_silent_in_a_sync_is_a_named_error_at_the_deadline():
    hung = HangingControl("pause")
    sync, model = rejoining_sync([hung], None, phase_timeout=1.0, progress_every=0.3)
    try:
        named_error(30, sync.sync, "http://s0", "pause phase", "weight_sync_timeout", expected=WeightSyncError,
                    model=model, version=1)
    finally:
        hung.release.set()
