"""Two real vLLM CPU servers behind one trainer (one module-scoped pair, started in parallel, stopped at the end;
the second runs vLLM's own data parallelism, `--data-parallel-size 2`): every weight version reaches both servers
and both engines of the second, rollouts are spread with group affinity, and SIGKILLing one server mid-run leaves
the run training on the other with no prompt lost or trained twice. The kill runs last: it ends the pair."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from conftest import REPO, start_server

from .harness import audit, within
from .proxy import wait_until
from .test_run_faults import ENV, PY, records, start

IDS = [1, 77, 300, 12, 500, 42, 2, 1, 9, 600]


def start_dp_server(model_dir: Path, tmp: Path):
    """conftest's CPU server with 2 data-parallel engines behind one API server; its seven processes start slowly
    on a loaded 2-core machine (90 s alone, past 240 s beside other servers), hence the longer deadline."""
    from grpo.vllm_server import ServeConfig, free_port, launch

    cfg = ServeConfig(model=str(model_dir), port=free_port(), max_model_len=512, dtype="float32", cpu=True,
                      weight_transfer_backend="cpu_file",
                      extra_args=("--data-parallel-size", "2", "--api-server-count", "1"))
    return launch(cfg, log_path=tmp / f"vllm_dp_{cfg.port}.log", timeout=600)


@pytest.fixture(scope="module")
def server_pair(tiny_qwen3, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("server_pair")
    with ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(start_server, tiny_qwen3, tmp), pool.submit(start_dp_server, tiny_qwen3, tmp)]
        servers = [f.result() if f.exception() is None else None for f in futures]
    if None in servers:  # stop the one that started, then raise the other's error
        for server in servers:
            if server is not None:
                server.stop()
        next(f.result() for f in futures if f.exception() is not None)
    yield servers
    for server in servers:
        server.stop()


def two_server_cmd(servers, out: Path, *extra: str) -> list[str]:
    return [PY, str(REPO / "train.py"), "--model", str(REPO / ".tiny" / "qwen3"), "--dataset", "builtin:letters",
            "--reward-funcs", "letters", "--vllm-server-base-url", *[s.base_url for s in servers],
            "--num-generations", "4", "--max-completion-length", "8", "--learning-rate", "1e-3",
            "--output-dir", str(out), "--rollout-worker-timeout", "120", "--vllm-server-timeout", "120", *extra]


def server_logprobs(url: str, model: str) -> torch.Tensor:
    import httpx

    body = httpx.post(f"{url}/v1/completions", timeout=60, json={
        "model": model, "prompt": IDS, "max_tokens": 1, "temperature": 1.0, "prompt_logprobs": 0}).json()
    entries = body["choices"][0]["prompt_logprobs"][1:]
    return torch.tensor([entries[i][str(t)]["logprob"] for i, t in enumerate(IDS[1:])])


def engine_requests(url: str) -> list[float]:
    """Finished requests per engine (data-parallel rank) of a server, from its /metrics."""
    import httpx

    from grpo.vllm_metrics import iter_prometheus

    done: dict[str, float] = {}
    for name, labels, value in iter_prometheus(httpx.get(f"{url}/metrics", timeout=30).text):
        if name == "vllm:request_success_total":
            done[labels["engine"]] = done.get(labels["engine"], 0.0) + value
    return [done[k] for k in sorted(done)]


def checkpoint_logprobs(path: Path) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        logp = model(input_ids=torch.tensor([IDS])).logits[0].log_softmax(-1)
    return logp[:-1].gather(-1, torch.tensor(IDS[1:])[:, None])[:, 0]


def server_counts(rows: list[dict], n: int) -> list[float]:
    return [sum(r.get(f"rollout/server{i}_rollouts_count") or 0 for r in rows) for i in range(n)]


@pytest.mark.vllm
def test_two_servers_train_and_both_serve_the_last_version(server_pair, tiny_qwen3, tmp_path):
    out = tmp_path / "run"
    before = [server_logprobs(s.base_url, str(tiny_qwen3)) for s in server_pair]
    proc = within(600, subprocess.run, two_server_cmd(server_pair, out, "--max-steps", "4", "--save-steps", "4"),
                  capture_output=True, text=True, cwd=REPO, env=ENV)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    rows = records(out, "metrics.jsonl")
    counts = server_counts(rows, 2)
    assert all(c > 0 for c in counts), counts  # rollouts were spread over both servers
    assert all(r.get("rollout/servers_alive") in (None, 2) for r in rows)
    expected = checkpoint_logprobs(out / "checkpoint-4")  # the last sync pushed exactly these weights ...
    engines_before = engine_requests(server_pair[1].base_url)
    for server, old in zip(server_pair, before):  # ... to both servers, and to both engines of the second one
        with ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(lambda _: server_logprobs(server.base_url, str(tiny_qwen3)), range(16)))
        for after in answers:
            torch.testing.assert_close(after, expected, atol=1e-4, rtol=0, msg=lambda m: f"{server.base_url}: {m}")
        assert (answers[0] - old).abs().max() > 1e-3
    served = [b - a for a, b in zip(engines_before, engine_requests(server_pair[1].base_url))]
    assert len(served) == 2 and min(served) > 0, served  # both data-parallel engines answered the check


@pytest.mark.vllm
def test_the_weight_transfer_world_size_counts_every_data_parallel_worker(server_pair):
    from grpo.vllm_client import VLLMControl

    with VLLMControl(server_pair[1].base_url, timeout=60) as control:
        parallel = control.server_info()["vllm_config"]["parallel_config"]
        assert parallel["data_parallel_size"] == 2
        assert control.world_size() == 2 * parallel["tensor_parallel_size"] * parallel["pipeline_parallel_size"]


@pytest.mark.vllm
def test_real_servers_keep_each_group_on_one_server(server_pair, tiny_qwen3):
    from transformers import AutoTokenizer

    from grpo.config import AsyncGRPOConfig
    from grpo.rollout_loop import AsyncRolloutLoop
    from grpo.shared_state import LoopOptions

    tokenizer = AutoTokenizer.from_pretrained(tiny_qwen3)
    config = AsyncGRPOConfig(model=str(tiny_qwen3), vllm_server_base_url=tuple(s.base_url for s in server_pair),
                             num_generations=4, max_completion_length=8)
    prompts = [{"prompt": [{"role": "user", "content": f"Count to {i}."}]} for i in range(8)]
    groups = []
    loop = AsyncRolloutLoop(config, str(tiny_qwen3), prompts, [lambda completion_ids, **kw: [0.0] * 4], tokenizer,
                            [tokenizer.eos_token_id], None,
                            LoopOptions(group_callback=lambda g, adv, kept: groups.append(g)))
    asyncio.run(loop.run(max_groups=8))
    homes = [{r.server for r in g.rollouts} for g in groups]
    assert len(groups) == 8 and all(len(h) == 1 for h in homes), homes
    assert {h.pop() for h in homes} == {s.base_url for s in server_pair}


@pytest.mark.vllm
def test_a_server_answering_5xx_to_everything_is_dropped_and_its_rollouts_rerun(server_pair, tiny_qwen3):
    """Server 1 stays up but answers 503 to every generation request (through the fault proxy): after the client's
    retries it is marked dead like an unreachable one, its rollouts run again on server 0, and every group ends.
    (It used to stop the run: only refused connections and exhausted transport retries marked a server dead.)"""
    from transformers import AutoTokenizer

    from grpo.config import AsyncGRPOConfig
    from grpo.rollout_loop import AsyncRolloutLoop
    from grpo.shared_state import LoopOptions

    from .proxy import FaultProxy

    proxy = FaultProxy(server_pair[1].base_url)
    for route in ("/v1/completions", "/inference/v1/generate"):  # both generation routes, forever
        proxy.add(route, "503")
    try:
        tokenizer = AutoTokenizer.from_pretrained(tiny_qwen3)
        urls = (server_pair[0].base_url, proxy.base_url)
        config = AsyncGRPOConfig(model=str(tiny_qwen3), vllm_server_base_url=urls, num_generations=4,
                                 max_completion_length=8)
        prompts = [{"prompt": [{"role": "user", "content": f"Count to {i}."}]} for i in range(6)]
        groups = []
        loop = AsyncRolloutLoop(config, str(tiny_qwen3), prompts, [lambda completion_ids, **kw: [0.0] * 4],
                                tokenizer, [tokenizer.eos_token_id], None,
                                LoopOptions(group_callback=lambda g, adv, kept: groups.append(g)))
        within(300, asyncio.run, loop.run(max_groups=6))
    finally:
        proxy.close()
    generation_hits = proxy.hits.get("/v1/completions", 0) + proxy.hits.get("/inference/v1/generate", 0)
    assert generation_hits >= 6, proxy.hits  # rollouts went there, and were retried
    assert len(groups) == 6 and all(r.server == urls[0] for g in groups for r in g.rollouts)
    assert [s.url for s in loop.pool.alive] == [urls[0]]


@pytest.mark.vllm
def test_a_server_killed_mid_run_leaves_the_run_training_on_the_other(server_pair, tmp_path):
    """SIGKILL server 1's process group after step 2: its rollouts move to server 0, the weight sync drops it, the
    run reaches max_steps, and every prompt below the final low-water mark is trained once or dropped."""
    out, log = tmp_path / "run", tmp_path / "run.log"
    proc = start(two_server_cmd(server_pair, out, "--max-steps", "10", "--save-steps", "10"), log)
    try:
        wait_until(lambda: len(records(out, "metrics.jsonl")) >= 2 or proc.poll() is not None, 400, "step 2")
        killed_after = len(records(out, "metrics.jsonl"))
        os.killpg(server_pair[1].proc.pid, signal.SIGKILL)
        within(400, proc.wait)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    text = log.read_text()
    assert proc.returncode == 0, text[-5000:]
    assert server_pair[1].base_url in text and "is dead" in text, text[-3000:]  # the warning names the server
    rows = records(out, "metrics.jsonl")
    assert rows[-1]["step"] == 10
    alive = [r["rollout/servers_alive"] for r in rows if r.get("rollout/servers_alive") is not None]  # 5 s polls
    assert alive and alive[-1] == 1, alive
    assert server_counts(rows[killed_after + 1:], 2)[0] > 0  # training went on with server 0's rollouts
    final = json.loads((out / "checkpoint-10" / "rollout_state.json").read_text())
    result = audit(out, final["prompt_index"])
    assert result["lost"] == [] and result["twice"] == [], result
