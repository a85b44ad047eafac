"""Chaos soak: one CPU training run against a real vLLM server while a schedule of faults keeps arriving: 5xx
bursts and latency spikes through the fault proxy, the server SIGKILLed and restarted in place (same URL), the
trainer SIGKILLed and resumed from its latest checkpoint, and a reward function that raises for about one prompt in
five (`--reward-errors drop`). It ends with an audit from the prompt ledger and the checkpoints, printed as one line
after the fault-suite line: every prompt trained exactly once (at sample granularity) or recorded as dropped with
its reason, no progress-reported wait longer than its deadline, and the final checkpoint == what the server serves.

The short soak runs in CI (about 5 min on 2 cores, most of it the server's restart); the long one (>= 300 steps)
runs only with `-m slow` and GRPO_LONG_SOAK=1:

    GRPO_LONG_SOAK=1 python -m pytest -q -m slow tests/faults/test_soak.py -k long
"""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time
from collections import Counter
from datetime import datetime
from pathlib import Path

import pytest

from conftest import REPO

from .harness import SOAK_LINES, Hang, audit, audit_samples
from .proxy import FaultProxy, wait_until
from .test_run_faults import records, start, train_cmd

INTERVAL_S, REJOIN_WAIT_S, SYNC_TIMEOUT_S, WORKER_TIMEOUT_S = 5, 300, 60, 120
DEADLINES = {"to come back": REJOIN_WAIT_S, "phase of weight sync": SYNC_TIMEOUT_S,
             # the trainer waits for samples while the server restarts: the client's retries, then the rejoin wait
             "samples from the rollout worker": REJOIN_WAIT_S + WORKER_TIMEOUT_S,
             "vLLM server": REJOIN_WAIT_S}
PROGRESS = re.compile(r"still waiting for (.*?) since \S+ \((\d+) s\)")
STAMP = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) ")

SHORT = [(2, "5xx"), (3, "latency"), (5, "server_kill"), (9, "trainer_kill"), (12, "5xx")]


def long_schedule(steps: int) -> list[tuple[int, str]]:
    plan = []
    for at in range(10, steps - 10, 10):
        plan.append((at, ["5xx", "latency", "reward", "5xx", "latency"][(at // 10) % 5]))
        if at % 70 == 0:
            plan.append((at + 3, "server_kill"))
        if at % 100 == 50:
            plan.append((at + 6, "trainer_kill"))
    return [p for p in plan if p[1] != "reward"]  # reward errors arrive by themselves (one prompt in five)


class SoakServer:
    """A CPU vLLM server on a fixed port, so a restart comes back at the same URL."""

    def __init__(self, model_dir: Path, tmp: Path):
        from grpo.vllm_server import ServeConfig, free_port

        self.cfg = ServeConfig(model=str(model_dir), port=free_port(), max_model_len=512, dtype="float32", cpu=True,
                               weight_transfer_backend="cpu_file")
        self.tmp, self.restarts, self.up_at = tmp, 0, []
        self.process = self._launch()
        self.restarting: threading.Thread | None = None

    def _launch(self):
        from grpo.vllm_server import launch

        process = launch(self.cfg, log_path=self.tmp / f"vllm_{self.restarts}.log", timeout=400)
        self.up_at.append(time.time())
        return process

    @property
    def base_url(self) -> str:
        return self.process.base_url

    def kill_and_restart(self) -> None:
        os.killpg(self.process.proc.pid, signal.SIGKILL)
        self.process.proc.wait()
        self.restarts += 1

        def restart():
            self.process = self._launch()

        self.restarting = threading.Thread(target=restart, daemon=True)
        self.restarting.start()

    def stop(self) -> None:
        if self.restarting is not None:
            self.restarting.join(400)
        self.process.stop(timeout=5)  # a restarted server can sit out the whole SIGTERM grace (30 s) at the end


@pytest.fixture(scope="module")
def soak_server(tiny_qwen3, tmp_path_factory):
    server = SoakServer(tiny_qwen3, tmp_path_factory.mktemp("soak_vllm"))
    yield server
    server.stop()


def soak_cmd(url: str, out: Path, steps: int, *extra: str) -> list[str]:
    return train_cmd(url, out, "--max-steps", str(steps), "--save-steps", "3", *extra,
                     "--reward-funcs", "faults.soak_rewards:flaky_letters", "--reward-errors", "drop",
                     "--server-rejoin-interval-s", str(INTERVAL_S), "--server-rejoin-wait-s", str(REJOIN_WAIT_S),
                     "--weight-sync-timeout", str(SYNC_TIMEOUT_S), "--progress-interval-s", "5",
                     "--rollout-worker-timeout", str(WORKER_TIMEOUT_S))


def current_step(out: Path) -> int:
    return max((r["step"] for r in records(out, "metrics.jsonl")), default=0)


def run_soak(server: SoakServer, tmp: Path, steps: int, schedule: list[tuple[int, str]], budget_s: float,
             extra: tuple[str, ...] = ()):
    """Drive the run through the schedule; (output dir, logs, fault counts)."""
    out, logs, done = tmp / "run", [], Counter()
    proxy = FaultProxy(server.base_url)
    cmd = soak_cmd(proxy.base_url, out, steps, *extra)
    logs.append(tmp / "trainer_0.log")
    proc = start(cmd, logs[-1])
    pending, deadline = sorted(schedule), time.monotonic() + budget_s
    try:
        while proc.poll() is None or proc.returncode != 0:
            if proc.poll() is not None:
                raise AssertionError(f"run {len(logs) - 1} failed:\n{logs[-1].read_text()[-5000:]}")
            if time.monotonic() > deadline:
                raise Hang(f"the soak did not finish {steps} steps within {budget_s:.0f} s (at step "
                           f"{current_step(out)}; logs {logs})")
            if pending and current_step(out) >= pending[0][0]:
                action = pending.pop(0)[1]
                if action == "5xx":
                    for route in ("/v1/completions", "/inference/"):
                        proxy.add(route, "503", 3)
                elif action == "latency":
                    proxy.add("/v1/completions", "delay", 6, delay_s=2.0)
                elif action == "server_kill":
                    server.kill_and_restart()
                elif action == "trainer_kill":
                    if server.restarting is not None:
                        server.restarting.join(400)
                    wait_until(lambda: any(out.glob("checkpoint-[0-9]*")), 300, "a first checkpoint")
                    os.kill(proc.pid, signal.SIGKILL)  # the trainer only: its worker must notice by itself
                    proc.wait()
                    logs.append(tmp / f"trainer_{len(logs)}.log")
                    proc = start(cmd + ["--resume-from-checkpoint", "latest"], logs[-1])
                done[action] += 1
            time.sleep(0.5)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proxy.close()
    if server.restarting is not None:
        server.restarting.join(400)
    return out, logs, done


def longest_waits(logs: list[Path]) -> dict[str, int]:
    """Longest progress-reported wait per kind of wait, over every run's log."""
    longest: dict[str, int] = {}
    for log in logs:
        for what, seconds in PROGRESS.findall(log.read_text()):
            kind = next((k for k in DEADLINES if k in what), what)
            longest[kind] = max(longest.get(kind, 0), int(seconds))
    return longest


def rejoin_delays(logs: list[Path], up_at: list[float]) -> list[float]:
    """Seconds from each restarted server's /health to the trainer's 'rejoined the run' line."""
    stamps = []
    for log in logs:
        for line in log.read_text().splitlines():
            if "rejoined the run" in line and (m := STAMP.match(line)):
                stamps.append(datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp())
    return [min(s for s in stamps if s >= up) - up for up in up_at[1:] if any(s >= up for s in stamps)]


def final_model_matches_server(out: Path, steps: int, server: SoakServer) -> float:
    from .test_server_faults import checkpoint_logprobs, server_logprobs

    expected = checkpoint_logprobs(out / f"checkpoint-{steps}")
    served = server_logprobs(server.base_url, server.cfg.model)
    return float((served - expected).abs().max())


def soak(server: SoakServer, tmp: Path, steps: int, schedule, budget_s: float, label: str,
         extra: tuple[str, ...] = ()) -> None:
    started = time.monotonic()
    out, logs, done = run_soak(server, tmp, steps, schedule, budget_s, extra)
    final = json.loads((out / f"checkpoint-{steps}" / "rollout_state.json").read_text())
    prompts = audit(out, final["prompt_index"])
    samples = audit_samples(out, final["prompt_index"])
    reasons = Counter(reason for r in records(out, "dropped_prompts.jsonl") for _, reason in r["prompts"])
    waits = longest_waits(logs)
    over = {k: s for k, s in waits.items() if s > DEADLINES.get(k, 0)}
    delays = rejoin_delays(logs, server.up_at)
    gap = final_model_matches_server(out, steps, server)
    text = "\n".join(log.read_text() for log in logs)
    line = (f"soak ({label}): steps {steps}, {time.monotonic() - started:.0f} s, faults {dict(done)}, reward errors "
            f"dropped {reasons['reward_error']}; prompts trained {len(prompts['trained'])} (samples "
            f"{samples['trained']}, of them carried across a resume {samples['carried']}), dropped {len(prompts['dropped'])} {dict(reasons)}, lost {len(prompts['lost'])}, "
            f"twice {len(prompts['twice'])}, samples lost {len(samples['lost'])}, samples twice "
            f"{len(samples['twice'])}; longest waits {waits} (over deadline: {len(over)}); rejoin after restart "
            f"{[round(d) for d in delays]} s (interval {INTERVAL_S} s); final model == served: "
            f"{'yes' if gap < 1e-4 else 'NO'} (max |dlogp| {gap:.1e})")
    SOAK_LINES.append(line)
    print(line)
    assert prompts["lost"] == [] and prompts["twice"] == [], prompts
    assert samples["lost"] == [] and samples["twice"] == [], samples
    assert not over, waits
    assert reasons["reward_error"] > 0 and "reward_error" in text  # the flaky judge was met and counted
    if done["server_kill"]:
        assert "rejoined the run" in text and len(delays) == done["server_kill"], text[-4000:]
    assert gap < 1e-4, gap


@pytest.mark.vllm
def test_short_soak(soak_server, tmp_path):
    soak(soak_server, tmp_path, 15, SHORT, budget_s=600, label="short")


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("GRPO_LONG_SOAK") != "1", reason="long soak: set GRPO_LONG_SOAK=1 (and -m slow)")
def test_long_soak(soak_server, tmp_path):
    steps = int(os.environ.get("GRPO_LONG_SOAK_STEPS", "300"))
    # At the short soak's lr 1e-3 the task is solved by step ~100; then nearly every group has equal rewards, is
    # dropped, and a step takes 50-110 s. A lower lr and equal-reward groups kept hold the step rate for 300 steps.
    soak(soak_server, tmp_path, steps, long_schedule(steps), budget_s=6 * 3600, label="long",
         extra=("--learning-rate", "2e-4", "--no-drop-equal-reward-groups"))
