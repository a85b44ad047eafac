"""Weight-sync faults against the real server: every failure of /pause, the transfer or /resume is a
`WeightSyncError` naming the URL and the fix, within the configured timeout; the next sync recovers."""

from __future__ import annotations

import os
import signal
import time

import pytest

from grpo.weight_sync import WeightSync, WeightSyncConfig, WeightSyncError

from .harness import named_error, within


@pytest.fixture(scope="module")
def model(tiny_qwen3):
    from grpo.model import load_policy

    return load_policy(str(tiny_qwen3), gradient_checkpointing=False)


@pytest.fixture
def sync(proxy, model):
    ws = WeightSync(proxy.base_url, WeightSyncConfig(mode="cpu_file", timeout=5.0))
    within(120, ws.init, model)
    yield ws
    ws.close()


@pytest.mark.vllm
@pytest.mark.parametrize("route", ["/pause", "/resume"])
def test_pause_or_resume_failure_is_a_named_sync_error_then_recovers(proxy, sync, model, route):
    """These calls used to sit outside the WeightSyncError wrapper: a raw httpx error with no URL and no fix."""
    proxy.add(route, "reset", 1)
    named_error(30, sync.sync, proxy.base_url, route, "restart", expected=WeightSyncError, model=model, version=1)
    assert "perf/weight_sync_s" in within(60, sync.sync, model, 2)  # the next sync pauses, sends and resumes


@pytest.mark.vllm
def test_server_sigstopped_around_a_sync_is_named_within_the_timeout(faults_server, sync, model):
    os.killpg(faults_server.proc.pid, signal.SIGSTOP)
    try:
        start = time.monotonic()
        named_error(30, sync.sync, "/pause", "ReadTimeout", expected=WeightSyncError, model=model, version=1)
        assert time.monotonic() - start < 15  # the configured 5 s timeout, not 1,800 s
    finally:
        os.killpg(faults_server.proc.pid, signal.SIGCONT)
    assert "perf/weight_sync_s" in within(60, sync.sync, model, 2)
