"""Checkpoints round-trip exactly (model, optimizer, scheduler), also for models whose in-memory layout differs
from the checkpoint's (transformers fuses MoE experts at load), and an interrupted save never looks complete."""

from __future__ import annotations

import json

import pytest
import torch

from grpo import checkpoint as ckpt
from grpo.model import load_policy, load_tokenizer


def _trained_step(model):
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (s + 1))
    ids = torch.arange(4, 20)[None]
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad()
    return optimizer, scheduler


@pytest.mark.parametrize("kind", ["qwen3", "qwen3_moe"])
def test_save_then_load_restores_everything(tiny_models, tmp_path, kind):
    model = load_policy(str(tiny_models[kind]), gradient_checkpointing=False)
    optimizer, scheduler = _trained_step(model)
    path = ckpt.save_checkpoint(tmp_path, 7, model, load_tokenizer(str(tiny_models[kind])), optimizer, scheduler,
                                {"prompt_index": 12, "model_version": 3})
    assert path == tmp_path / "checkpoint-7" and ckpt.resolve_checkpoint("latest", tmp_path) == path

    fresh = load_policy(str(tiny_models[kind]), gradient_checkpointing=False)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-3)
    fresh_sched = torch.optim.lr_scheduler.LambdaLR(fresh_opt, lambda s: 1.0 / (s + 1))
    state = ckpt.load_checkpoint(path, fresh, fresh_opt, fresh_sched)
    assert state == {"prompt_index": 12, "model_version": 3, "step": 7}
    for (name, p), q in zip(model.named_parameters(), fresh.parameters()):
        torch.testing.assert_close(q, p, rtol=0, atol=0, msg=name)
        a, b = optimizer.state[p], fresh_opt.state[q]
        torch.testing.assert_close(b["exp_avg"], a["exp_avg"], rtol=0, atol=0, msg=name)
        torch.testing.assert_close(b["exp_avg_sq"], a["exp_avg_sq"], rtol=0, atol=0, msg=name)
    assert fresh_sched.state_dict()["last_epoch"] == scheduler.state_dict()["last_epoch"] == 1
    # the saved model directory is an ordinary from_pretrained checkpoint
    reloaded = load_policy(str(path), gradient_checkpointing=False)
    for (name, p), q in zip(model.named_parameters(), reloaded.parameters()):
        torch.testing.assert_close(q, p, rtol=0, atol=0, msg=name)


def test_interrupted_save_is_ignored(tiny_qwen3, tmp_path):
    (tmp_path / "checkpoint-9.tmp").mkdir()
    (tmp_path / "checkpoint-9.tmp" / "rollout_state.json").write_text(json.dumps({"prompt_index": 1}))
    assert ckpt.resolve_checkpoint("latest", tmp_path) is None
    with pytest.raises(FileNotFoundError, match="not a complete checkpoint"):
        ckpt.resolve_checkpoint(str(tmp_path / "checkpoint-3"), tmp_path)
