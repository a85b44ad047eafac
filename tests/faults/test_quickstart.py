"""The spec's quick start shape through the real rollout worker: the default `accuracy` reward (math-verify in a
helper process) scoring math rows with a `solution` column, against the real server."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import REPO

from .test_run_faults import PY, records, run, worker_pids

PROMPTS = [f"What is {a} + {b}? Answer with a number." for a in range(6) for b in range(6)]


def greedy_answer_rows(server_url: str, model: Path) -> list[dict]:
    """Rows the random tiny model can sometimes solve: `solution` is the number its greedy first token spells.

    Sampled at temperature 0.05, the greedy token comes up in about half of one prompt's completions, so groups
    of 8 have mixed accuracy rewards (GRPO signal) and the task is learnable (produce that number)."""
    import httpx
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    served = httpx.get(f"{server_url}/v1/models").json()["data"][0]["id"]
    rows = []
    for prompt in PROMPTS:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                            tokenize=True)
        ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        body = {"model": served, "prompt": ids, "max_tokens": 1, "temperature": 0.0, "return_token_ids": True}
        choice = httpx.post(f"{server_url}/v1/completions", json=body, timeout=60).json()["choices"][0]
        text = tokenizer.decode(choice["token_ids"]).strip()
        if text.isdigit():
            rows.append({"prompt": [{"role": "user", "content": prompt}], "solution": text})
    assert len(rows) >= 8, f"only {len(rows)} prompts have a numeric greedy token; the tiny model changed?"
    return rows


@pytest.mark.vllm
def test_quick_start_accuracy_reward_trains_in_the_rollout_worker(faults_server, tiny_qwen3, tmp_path):
    """debefe5: the first scored group ended the run with 'daemonic processes are not allowed to have children'
    (math-verify's process pool inside the daemonic worker). The default reward (no --reward-funcs) must score
    in the worker, groups must carry signal, and >= 5 steps train; no verifier process outlives the run."""
    import psutil

    from .test_nan_server import nan_then_clean_sync

    nan_then_clean_sync(faults_server.base_url, tiny_qwen3, nan=False)  # earlier tests trained the shared server
    rows = greedy_answer_rows(faults_server.base_url, tiny_qwen3)
    data = tmp_path / "math.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "run"
    cmd = [PY, str(REPO / "train.py"), "--model", str(tiny_qwen3), "--dataset", str(data),
           "--vllm-server-base-url", faults_server.base_url, "--max-steps", "5", "--max-completion-length", "1",
           "--temperature", "0.05", "--learning-rate", "1e-6", "--output-dir", str(out),
           "--rollout-worker-timeout", "120", "--vllm-server-timeout", "120"]
    before = {p.pid for p in psutil.process_iter()}
    result = run(cmd, timeout=500)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    metrics = records(out, "metrics.jsonl")
    assert metrics and metrics[-1]["step"] == 5
    accuracy = [m[k] for m in metrics for k in m if k.startswith("rewards/accuracy_reward") and k.endswith("/mean")]
    assert accuracy and max(accuracy) > 0, f"accuracy never scored a correct answer: {metrics[-1]}"
    assert "daemonic" not in result.stderr
    leftovers = [p for p in psutil.process_iter(["pid", "cmdline"]) if p.pid not in before
                 and "spawn_main" in " ".join(p.info["cmdline"] or []) and "resource_tracker" not in
                 " ".join(p.info["cmdline"] or [])]
    assert not [p for p in leftovers if p.is_running() and p.status() != psutil.STATUS_ZOMBIE], \
        f"processes left behind by the run: {[p.info for p in leftovers]}"


def accuracy_then_stall(completions, solution, **kwargs):
    """`accuracy` (so its verifier process exists), then a stall: the trainer is killed while the worker scores."""
    import time

    from grpo.rewards import accuracy_reward

    rewards = accuracy_reward(completions, solution=solution)
    time.sleep(600)
    return rewards


@pytest.mark.vllm
def test_killed_trainer_leaves_no_worker_or_verifier_behind(faults_server, tiny_qwen3, tmp_path):
    """The worker is no longer a daemon: SIGKILL of the trainer must still take the worker and its math-verify
    process down (parent watchdogs), within seconds."""
    import os
    import signal

    from .proxy import wait_until
    from .test_run_faults import gone, start

    data = tmp_path / "math.jsonl"
    rows = [{"prompt": [{"role": "user", "content": p}], "solution": "1"} for p in PROMPTS]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "run"
    cmd = [PY, str(REPO / "train.py"), "--model", str(tiny_qwen3), "--dataset", str(data),
           "--reward-funcs", "faults.test_quickstart:accuracy_then_stall",
           "--vllm-server-base-url", faults_server.base_url, "--max-steps", "5", "--max-completion-length", "2",
           "--output-dir", str(out), "--rollout-worker-timeout", "600"]
    proc = start(cmd, tmp_path / "run.log")
    try:
        def verifier_started():
            return proc.poll() is not None or len(worker_pids(proc.pid)) >= 2  # worker + its verifier
        wait_until(verifier_started, 300, "the worker's math-verify process")
        assert proc.poll() is None, (tmp_path / "run.log").read_text()[-4000:]
        children = worker_pids(proc.pid)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        wait_until(lambda: gone(children), 30, "the orphaned worker and verifier to exit")
    finally:
        if proc.poll() is None:
            proc.kill()
