"""Committed loss traces: 10 optimizer steps of the real batcher -> packer -> policy -> loss -> AdamW path on
synthetic samples and the tiny Qwen3, per registered loss. Any change that moves a loss's numbers fails here.

After an intended change, regenerate and commit the trace (and say why in the commit):

    python tests/test_loss_trace.py            # rewrites tests/data/loss_traces.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
TRACES = REPO / "tests" / "data" / "loss_traces.json"
STEPS = 10
TOP_K = 4
TOKEN_BUDGET = 192


def synthetic_samples(rng: np.random.Generator, group_id: int, group_size: int = 4, vocab: int = 1024) -> list:
    """One group: a shared prompt, random completions, sampler logprobs near the tiny model's (~ -log 1024)."""
    from grpo.samples import TrainingSample

    prompt = rng.integers(4, vocab, rng.integers(4, 9)).tolist()
    rewards = rng.random(group_size)
    advantages = (rewards - rewards.mean()) / (rewards.std() + 1e-8)
    out = []
    for advantage in advantages:
        completion = rng.integers(4, vocab, rng.integers(3, 9)).tolist()
        n = len(prompt) + len(completion)
        mask = np.array([0] * len(prompt) + [1] * len(completion))
        top_ids = np.stack([rng.choice(vocab, TOP_K, replace=False) for _ in range(n)])  # [L, K]
        top_lps = np.sort(rng.normal(-6.0, 0.5, (n, TOP_K)), axis=1)[:, ::-1].astype(np.float32)
        out.append(TrainingSample(
            input_ids=prompt + completion, completion_mask=mask.tolist(),
            sampler_logprobs=(rng.normal(-6.93, 0.4, n) * mask).tolist(), advantage=float(advantage),
            group_id=group_id, model_version=0, sampler_top_ids=np.where(mask[:, None] == 1, top_ids, -1),
            sampler_top_logprobs=np.where(mask[:, None] == 1, top_lps, -np.inf).astype(np.float32)))
    return out


def run_trace(name: str, model_dir: Path) -> dict[str, list[float]]:
    """(loss, grad norm) of STEPS optimizer steps with loss `name`, from a fixed seed."""
    import contextlib

    from grpo.batcher import TokenBudgetBatcher
    from grpo.config import AsyncGRPOConfig
    from grpo.losses import get_loss
    from grpo.model import load_policy, trainable_parameters
    from grpo.policy import PackedPolicy, build_optimizer
    from grpo.step import train_micro_batch
    from grpo.step_metrics import resolve_metrics
    from grpo.step_plan import StepPlan

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # fixed reduction order
    try:
        torch.manual_seed(0)
        rng = np.random.default_rng(0)
        fn, options = get_loss(name)
        policy = PackedPolicy(load_policy(str(model_dir), gradient_checkpointing=False), "sdpa", temperature=1.0)
        params = trainable_parameters(policy)
        optimizer, _ = build_optimizer(params, AsyncGRPOConfig(learning_rate=1e-3))
        batcher = TokenBudgetBatcher(TOKEN_BUDGET, 1)
        trace, group = {"loss": [], "grad_norm": []}, 0
        for _ in range(STEPS):
            rows = None
            while rows is None:
                for sample in synthetic_samples(rng, group):
                    rows = rows or batcher.add(sample)
                group += 1
            plan = StepPlan(rows, sum(s.num_trained for row in rows for s in row))
            metrics = resolve_metrics([train_micro_batch(policy, rows[0], plan, fn, options, 1, 1,
                                                         contextlib.nullcontext, max_completion_length=8)])[0]
            grad_norm = torch.nn.utils.clip_grad_norm_(params, 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            trace["loss"].append(metrics["loss"])
            trace["grad_norm"].append(float(grad_norm))
        return trace
    finally:
        torch.set_num_threads(threads)


def _names() -> list[str]:
    from grpo.losses import registered_losses

    return sorted(registered_losses())


@pytest.mark.parametrize("name", _names())
def test_loss_trace_is_unchanged(name, tiny_qwen3):
    committed = json.loads(TRACES.read_text())
    regenerate = (f"regenerate it with `PYTHONPATH=. python tests/test_loss_trace.py {name}` (with the plug-in module "
                  f"in $GRPO_PLUGIN_MODULES for a loss outside grpo/) and commit tests/data/loss_traces.json")
    assert name in committed, f"no committed trace for {name!r}: {regenerate}"
    got = run_trace(name, tiny_qwen3)
    for key in ("loss", "grad_norm"):
        np.testing.assert_allclose(got[key], committed[name][key], rtol=1e-4, atol=1e-6,
                                   err_msg=f"{name}: {key} moved from the committed trace; if the change is intended, "
                                           f"{regenerate}, and say why in the commit")
    assert any(abs(v) > 0 for v in got["grad_norm"]), "the trace must exercise the gradient"


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    sys.path.insert(0, str(REPO / "scripts"))
    from make_tiny_model import make

    model = make(REPO / ".tiny")["qwen3"]
    names = sys.argv[1:] or _names()
    traces = json.loads(TRACES.read_text()) if TRACES.exists() else {}
    for loss_name in names:
        traces[loss_name] = run_trace(loss_name, model)
        print(loss_name, " ".join(f"{v:.5g}" for v in traces[loss_name]["loss"]))
    TRACES.parent.mkdir(parents=True, exist_ok=True)
    TRACES.write_text(json.dumps(traces, indent=1, sort_keys=True) + "\n")
