"""The start-up probe (grpo/model_check.py): passes, with its gaps logged, where the trainer reproduces the model's
own forward; stops the run with a named error where it does not, e.g. d08c9c3's head, which read no logit
transform (Gemma-2's final soft cap, Granite's logits_scaling), or attention that drops Gemma-2's score cap."""

from __future__ import annotations

import logging

import pytest
import torch
from test_logit_transforms import transform_models  # noqa: F401 - the session fixture, shared

import grpo.policy
import grpo.tree_attention as ta
from grpo.logit_transforms import attention_softcap
from grpo.kernels.logprobs import HeadTransform
from grpo.model import load_policy
from grpo.model_check import ModelCheckError, check_logprob_path, probe
from grpo.policy import PackedPolicy


def _policy(model) -> PackedPolicy:
    backend = ta.select_backend("auto", "cpu", softcap=attention_softcap(model) is not None)
    return PackedPolicy(model, backend, 0.7)


def _path(kind, tiny_models, transform_models):
    return str((transform_models if kind in transform_models else tiny_models)[kind])


@pytest.mark.parametrize("kind", ["qwen3", "gemma2", "granite"])
def test_probe_passes_and_logs_its_gaps(tiny_models, transform_models, kind, caplog):
    model = load_policy(_path(kind, tiny_models, transform_models))
    before = [p.requires_grad for p in model.parameters()]
    with caplog.at_level(logging.INFO, logger="grpo.model_check"):
        report = check_logprob_path(model, _policy(model))
    assert report.passed and report.logprob_gap < 1e-5
    assert set(report.grad_gaps) == {"embedding", "attention", "mlp", "norm", "head"}
    assert f"max |Δlogp| {report.logprob_gap:.1e}" in caplog.text and type(model).__name__ in caplog.text
    assert [p.requires_grad for p in model.parameters()] == before and all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize("kind", ["gemma2", "granite"])
def test_probe_stops_a_head_that_ignores_the_logit_transform(transform_models, kind, monkeypatch):
    """d08c9c3's behaviour: the trainer's reader sees no transform, the model's forward still applies it."""
    model = load_policy(str(transform_models[kind]))
    policy = _policy(model)
    monkeypatch.setattr(grpo.policy, "head_transform", lambda model: HeadTransform())
    with pytest.raises(ModelCheckError, match=rf"{type(model).__name__}'s own forward.*max \|Δlogp\|.*Do not train"):
        check_logprob_path(model, policy)


def test_probe_stops_attention_that_drops_the_score_cap(transform_models, monkeypatch):
    model = load_policy(str(transform_models["gemma2"]))
    capped = ta._capped_attention
    monkeypatch.setattr(ta, "_capped_attention", lambda q, k, v, mask, scaling, softcap: capped(q, k, v, mask,
                                                                                                 scaling, 1e9))
    with pytest.raises(ModelCheckError, match="Gemma2ForCausalLM"):
        check_logprob_path(model, _policy(model))


def test_probe_on_a_lora_policy_checks_the_adapters(tiny_qwen3):
    """LoRA: the frozen families are reported as such, the adapters' gradients are compared."""
    from grpo.lora import wrap_policy
    from peft import LoraConfig

    model = wrap_policy(load_policy(str(tiny_qwen3)), LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    report = probe(model, "sdpa", 0.7)
    assert report.passed and set(report.skipped) == {"embedding", "norm", "head"}
    assert set(report.grad_gaps) == {"attention", "mlp"}


def test_probe_tolerance_is_the_dtype_floor(tiny_qwen3):
    """bf16 weights are held to bf16's floor, and still pass on a model the trainer reproduces."""
    model = load_policy(str(tiny_qwen3), dtype="bfloat16")
    report = probe(model, "sdpa", 1.0)
    assert report.dtype == torch.bfloat16 and report.passed and report.tolerance[0] > 1e-3


def test_probe_checks_values_and_gradients_each(transform_models, monkeypatch):
    """A fault only in the values (a constant shift: same gradients) and one only in the gradients (the head's
    backward without the soft cap's slope: same values) are each stopped."""
    import grpo.kernels.logprobs as lp

    model = load_policy(str(transform_models["gemma2"]))
    real_head = grpo.policy.policy_token_logprobs
    with monkeypatch.context() as m:
        m.setattr(grpo.policy, "policy_token_logprobs",
                  lambda *a, **k: (lambda out: (out[0] + 0.01, *out[1:]))(real_head(*a, **k)))
        with pytest.raises(ModelCheckError, match=r"max \|Δlogp\| 1\.0e-02"):
            check_logprob_path(model, _policy(model))
    with monkeypatch.context() as m:
        m.setattr(lp, "_grad_raw", lambda logits, index, support, lse, grad, options: lp._chunk_grad_logits(
            logits, index, support, lse, grad, options.softcap[0] * options.softcap[1]))
        report = probe(model, "sdpa", 0.7)
        assert report.logprob_gap < 1e-5 and not report.passed


def test_probe_on_the_policy_build_policy_returns(tiny_qwen3, caplog):
    """As train.py calls it: after `build_policy` with bf16 compute copies beside fp32 masters (one process), the
    probe runs on the masters and leaves the policy trainable as it was."""
    from grpo.config import AsyncGRPOConfig
    from grpo.distributed import DistInfo
    from grpo.policy import build_policy
    from grpo.trie import pack_samples
    from test_train import random_samples

    config = AsyncGRPOConfig(model=str(tiny_qwen3), bf16=True, dtype="float32", compile_layers=False,
                             gradient_checkpointing="false")
    model, policy, *_ = build_policy(config, DistInfo(0, 1, 0, torch.device("cpu")), 2048)
    with caplog.at_level(logging.INFO, logger="grpo.model_check"):
        report = check_logprob_path(model, policy)
    assert report.passed and report.dtype == torch.float32 and "check passed" in caplog.text
    row = pack_samples(random_samples(0))
    (policy(row).policy_logprobs @ row.advantages).backward()
    assert all(p.grad is not None for p in model.parameters())
