"""Whole runs of `train.py` against the real server, killed, stopped or starved, with the prompt audit over
`trained_prompts.jsonl`, `dropped_prompts.jsonl` and the checkpoints: no prompt lost, none trained twice."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import REPO

from .harness import Silent, audit, within
from .proxy import wait_until

PY = sys.executable
ENV = os.environ | {"PYTHONPATH": f"{REPO}:{REPO / 'tests'}"}


def constant_reward(completion_ids, **kwargs):
    return [1.0] * len(completion_ids)


def train_cmd(server_url: str, out: Path, *extra: str) -> list[str]:
    return [PY, str(REPO / "train.py"), "--model", str(REPO / ".tiny" / "qwen3"), "--dataset", "builtin:letters",
            "--reward-funcs", "letters", "--vllm-server-base-url", server_url, "--num-generations", "4",
            "--max-completion-length", "8", "--learning-rate", "1e-3", "--output-dir", str(out),
            "--rollout-worker-timeout", "120", "--vllm-server-timeout", "120", *extra]


def start(cmd, log: Path) -> subprocess.Popen:
    return subprocess.Popen(cmd, cwd=REPO, env=ENV, stdout=open(log, "w"), stderr=subprocess.STDOUT,
                            start_new_session=True)


def run(cmd, timeout: float = 600) -> subprocess.CompletedProcess:
    return within(timeout, subprocess.run, cmd, capture_output=True, text=True, cwd=REPO, env=ENV)


def worker_pids(pid: int) -> list[int]:
    """The live descendants of `pid` but multiprocessing's resource tracker. A child that exits while it is listed
    (a zombie or gone by the time its command line is read) is not one of them."""
    import psutil

    pids = []
    for child in psutil.Process(pid).children(recursive=True):
        try:
            if "resource_tracker" not in " ".join(child.cmdline()):
                pids.append(child.pid)
        except (psutil.ZombieProcess, psutil.NoSuchProcess):
            continue
    return pids


def gone(pids) -> bool:
    import psutil

    return all(not psutil.pid_exists(p) or psutil.Process(p).status() == "zombie" for p in pids)


def records(out: Path, name: str) -> list[dict]:
    path = out / name
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


@pytest.mark.vllm
def test_kill_mid_checkpoint_and_resume_trains_each_prompt_exactly_once(faults_server, tmp_path):
    """Acceptance: a run with stale drops (max_staleness 1) and groups split across steps (token_budget 48) is
    SIGKILLed while writing a checkpoint and resumed from `latest`. Every prompt below the final resume point is
    trained in exactly one run or recorded as dropped; the orphaned worker exits by itself."""
    out = tmp_path / "run"
    flags = ("--max-staleness", "1", "--token-budget", "48", "--save-steps", "2")
    proc = start(train_cmd(faults_server.base_url, out, "--max-steps", "40", *flags), tmp_path / "run1.log")
    try:
        wait_until(lambda: (out / "checkpoint-2").exists() or proc.poll() is not None, 400, "checkpoint-2",
                   interval=0.005)
        children = worker_pids(proc.pid)
        wait_until(lambda: list(out.glob("checkpoint-*.tmp")) or proc.poll() is not None, 300,
                   "a checkpoint being written", interval=0.002)
        os.kill(proc.pid, signal.SIGKILL)  # the trainer only: its worker must notice by itself
        mid_save = bool(list(out.glob("checkpoint-*.tmp")))
        proc.wait()
        wait_until(lambda: gone(children), 20, "the orphaned rollout worker to exit")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert mid_save, (tmp_path / "run1.log").read_text()[-3000:]
    killed_at = max(int(p.name.split("-")[1]) for p in out.glob("checkpoint-[0-9]*") if not p.name.endswith(".tmp"))
    resumed = run(train_cmd(faults_server.base_url, out, "--max-steps", str(killed_at + 4), *flags,
                            "--resume-from-checkpoint", "latest"))
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    final = json.loads((out / f"checkpoint-{killed_at + 4}" / "rollout_state.json").read_text())
    result = audit(out, final["prompt_index"])
    assert result["lost"] == [] and result["twice"] == [], result
    drops = [reason for r in records(out, "dropped_prompts.jsonl") for _, reason in r["prompts"]]
    steps_of: dict[int, set[int]] = {}
    for r in records(out, "trained_prompts.jsonl"):
        for p in r["prompts"]:
            steps_of.setdefault(p, set()).add(r["step"])
    split = sorted(p for p, s in steps_of.items() if len(s) > 1)
    print(f"drops {drops}; positions trained over several steps {split}")
    assert "stale" in drops, drops  # the scenario really had stale drops ...
    assert split  # ... and groups split across steps
    state = json.loads((out / f"checkpoint-{killed_at}" / "rollout_state.json").read_text())
    assert {"prompt_index", "consumed_above", "partial"} <= state.keys()


@pytest.mark.vllm
def test_epoch_run_with_accumulation_trains_the_last_micro_batches_and_logs_the_last_window(faults_server, tmp_path):
    """7 prompts, 1 epoch, 2 micro-batches per step, a log every 3 steps: the last step's lone micro-batch is
    trained (it used to be dropped), the last partial window logged, zero counters present, nothing lost."""
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": [{"role": "user", "content": f"Write {w} words."}]}) + "\n"
                            for w in ("two", "three", "four", "five", "six", "seven", "eight")))
    out = tmp_path / "run"
    cmd = train_cmd(faults_server.base_url, out, "--num-train-epochs", "1", "--save-strategy", "no",
                    "--gradient-accumulation-steps", "2", "--token-budget", "64", "--logging-steps", "3")
    cmd[cmd.index("builtin:letters")] = str(data)
    proc = run(cmd)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = audit(out, 7)
    assert result["lost"] == [] and result["twice"] == [], result
    steps = [r["step"] for r in records(out, "trained_prompts.jsonl")]
    rows = records(out, "metrics.jsonl")
    assert rows and rows[-1]["step"] == steps[-1]  # the last window is logged even when partial
    assert all(r.get("sample/dropped_stale_count") is not None for r in rows)  # zero counters are logged as 0
    assert (out / f"checkpoint-{steps[-1]}").exists()


@pytest.mark.vllm
def test_sigterm_stops_the_run_and_its_worker(faults_server, tmp_path):
    out = tmp_path / "run"
    proc = start(train_cmd(faults_server.base_url, out, "--max-steps", "500", "--save-strategy", "no"),
                 tmp_path / "run.log")
    try:
        wait_until(lambda: (out / "trained_prompts.jsonl").exists() or proc.poll() is not None, 400, "a step")
        children = worker_pids(proc.pid)
        proc.send_signal(signal.SIGTERM)
        within(60, proc.wait)
        assert proc.returncode != 0
        wait_until(lambda: gone(children), 10, "the rollout worker to stop with the trainer")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


@pytest.mark.vllm
def test_every_group_dropped_ends_with_a_named_error_not_an_empty_run(faults_server, tmp_path):
    """All rewards equal in an epoch run: it used to return step 0 and save nothing, silently."""
    out = tmp_path / "run"
    cmd = train_cmd(faults_server.base_url, out, "--num-train-epochs", "1", "--save-strategy", "no")
    cmd[cmd.index("letters", cmd.index("--reward-funcs"))] = "faults.test_run_faults:constant_reward"
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": [{"role": "user", "content": f"Say {i}."}]}) + "\n"
                            for i in range(5)))
    cmd[cmd.index("builtin:letters")] = str(data)
    proc = run(cmd)
    if proc.returncode == 0 or "without a single optimizer step" not in proc.stderr:
        raise Silent(proc.stdout[-2000:] + proc.stderr[-3000:])
    assert "equal_rewards" in proc.stderr and "rollout.py sample" in proc.stderr
    assert audit(out, 5)["lost"] == []


@pytest.mark.vllm
@pytest.mark.parametrize("fault", ["rank0_sync_fails", "rank1_killed"])
def test_one_of_two_torchrun_ranks_failing_ends_the_whole_run(faults_server, proxy, tmp_path, fault):
    """2 CPU ranks. Rank 0's weight sync fails (the server vanishes behind the proxy), or rank 1 is SIGKILLed: the
    other rank must not sit in a collective for vllm_server_timeout (it used to wait 1,800 s); torchrun ends the
    run with the named error, and no worker is left behind."""
    out = tmp_path / "run"
    torchrun = [PY, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    cmd = torchrun + train_cmd(proxy.base_url, out, "--max-steps", "500", "--save-strategy", "no",
                               "--server-rejoin-wait-s", "0")[1:]  # no wait for the vanished server to come back
    cmd[cmd.index("--vllm-server-timeout") + 1] = "600"
    proc = start(cmd, tmp_path / "run.log")
    try:
        wait_until(lambda: (out / "trained_prompts.jsonl").exists() or proc.poll() is not None, 500, "a step")
        children = worker_pids(proc.pid)
        start_t = time.monotonic()
        if fault == "rank0_sync_fails":
            proxy.down()
        else:
            import psutil

            ranks = [c for c in psutil.Process(proc.pid).children() if "train.py" in " ".join(c.cmdline())]
            max(ranks, key=lambda c: c.pid).kill()  # rank 1 is started second
        within(180, proc.wait)
        elapsed = time.monotonic() - start_t
        wait_until(lambda: gone(children), 30, "every rank and worker to exit")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    log = (tmp_path / "run.log").read_text()
    assert proc.returncode != 0 and elapsed < 120, log[-3000:]
    if fault == "rank0_sync_fails":
        assert "WeightSyncError" in log and proxy.base_url in log, log[-3000:]
