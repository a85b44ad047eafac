"""A two-server run whose second server goes silent in a sync, then vanishes, and comes back each time: the real
trainer, worker and vLLM server, with the two "servers" being two fault proxies in front of the shared fault-suite
server (so no second server has to start on the 2-core machine; the sync and the rollouts see two URLs). A server
restarted for real, alone, is the soak's case (test_soak.py)."""

from __future__ import annotations

import json
import os
import signal

import pytest

from .harness import audit, within
from .proxy import FaultProxy, wait_until
from .test_run_faults import records, start, train_cmd


def count(log, needle: str) -> int:
    return log.read_text().count(needle) if log.exists() else 0


@pytest.mark.vllm
def test_a_silent_then_vanished_server_is_dropped_at_the_deadline_and_rejoins_each_time(faults_server, tmp_path):
    a, b = FaultProxy(faults_server.base_url), FaultProxy(faults_server.base_url)
    out, log = tmp_path / "run", tmp_path / "run.log"
    cmd = train_cmd(a.base_url, out, "--max-steps", "24", "--save-steps", "24", "--weight-sync-timeout", "5",
                    "--server-rejoin-interval-s", "2", "--progress-interval-s", "2")
    cmd[cmd.index("--vllm-server-base-url") + 2:cmd.index("--vllm-server-base-url") + 2] = [b.base_url]
    proc = start(cmd, log)
    dropped, rejoined = f"dropping vLLM server {b.base_url}", f"vLLM server {b.base_url} rejoined the run"
    try:
        wait_until(lambda: len(records(out, "metrics.jsonl")) >= 2 or proc.poll() is not None, 400, "step 2")
        b.add("/pause", "stall", 1)  # SIGSTOP-like: B's pause never answers
        wait_until(lambda: count(log, dropped) >= 1 or proc.poll() is not None, 120, "B dropped at the deadline")
        b.clear()
        wait_until(lambda: count(log, rejoined) >= 1 or proc.poll() is not None, 120, "B's first rejoin")
        dead = f"({b.base_url}) is dead"
        deaths = count(log, dropped) + count(log, dead)
        b.down()  # B vanishes (every connection reset)
        wait_until(lambda: count(log, dropped) + count(log, dead) > deaths or proc.poll() is not None, 180,
                   "B dropped again")
        b.up()
        wait_until(lambda: count(log, rejoined) >= 2 or proc.poll() is not None, 180, "B's second rejoin")
        within(400, proc.wait)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        a.close()
        b.close()
    text = log.read_text()
    assert proc.returncode == 0, text[-5000:]
    assert f"still waiting for {b.base_url} to finish the pause phase of weight sync version" in text, text[-5000:]
    assert "weight_sync_timeout" in text and count(log, rejoined) >= 2
    rows = records(out, "metrics.jsonl")
    alive = [r["rollout/servers_alive"] for r in rows if r.get("rollout/servers_alive") is not None]
    assert alive and alive[-1] == 2, alive  # back to two after the second rejoin
    back = max(i for i, r in enumerate(rows) if r.get("rollout/servers_alive") == 1) if 1 in alive else 0
    assert sum(r.get("rollout/server1_rollouts_count") or 0 for r in rows[back + 1:]) > 0  # B took rollouts again
    final = json.loads((out / "checkpoint-24" / "rollout_state.json").read_text())
    result = audit(out, final["prompt_index"])
    assert result["lost"] == [] and result["twice"] == [], result
