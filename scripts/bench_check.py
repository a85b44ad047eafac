"""`bench_step.py --check`: the trainer's tree-packed log-probs against per-sample forwards of the same checkpoint,
next to the error a plain bf16 forward makes (the bf16 floor), so a fast path's error is read against a measured
tolerance. Also what tests/test_gpu_step.py checks on tiny models."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def check_packed_vs_unpacked(model_dir: Path, info, overrides: dict, seed: int = 0) -> dict:
    """The fast path's tree-packed log-probs (`build_policy`, no grad) against per-sample forwards of an fp32
    eager copy of the same checkpoint (transformers' torch GDN path even where fla is installed; 4 rollouts sharing
    a 300-token prompt, 60-token completions), next to the error an eager bf16 per-sample forward makes against the
    same fp32 reference: bf16 tolerance, measured."""
    import torch
    from bench_groups import synthetic_groups

    from grpo.config import AsyncGRPOConfig
    from grpo.kernels.gdn import transformers_torch_reference
    from grpo.model import load_policy
    from grpo.policy import build_policy
    from grpo.trie import pack_samples

    config = dataclasses.replace(AsyncGRPOConfig(model=str(model_dir), token_budget=2048), **overrides)
    _, policy, *_ = build_policy(config, info, 2048)
    ref = load_policy(str(model_dir), "float32").to(info.device)
    vocab = ref.config.get_text_config().vocab_size
    samples = [s for s, _ in zip(synthetic_groups(vocab, True, 0, group_size=4, prompt_len=300, completion_len=60,
                                                  seed=seed), range(4))]
    row = pack_samples(samples).to(info.device)

    def per_sample(model) -> torch.Tensor:
        refs = []
        for s in samples:
            ids = torch.tensor(s.input_ids, device=info.device)[None]
            logits = model(input_ids=ids, use_cache=False).logits[0].float() / config.temperature
            pos = torch.tensor([i for i, m in enumerate(s.completion_mask) if m and i > 0], device=info.device)
            refs.append(torch.log_softmax(logits[pos - 1], -1).gather(-1, ids[0, pos][:, None])[:, 0])
        return torch.cat(refs)

    with torch.no_grad(), transformers_torch_reference(ref):  # the reference never reaches an installed FLA
        packed = policy(row).policy_logprobs.float()[torch.argsort(row.sample_id, stable=True)]
        fp32 = per_sample(ref)
        bf16 = per_sample(ref.to(torch.bfloat16)) if info.device.type == "cuda" else fp32
    diff, bf16_diff = (packed - fp32).abs(), (bf16 - fp32).abs()
    return {"max_abs_diff": float(diff.max()), "mean_abs_diff": float(diff.mean()), "terms": int(diff.numel()),
            "eager_bf16_max_abs_diff": float(bf16_diff.max()), "eager_bf16_mean_abs_diff": float(bf16_diff.mean())}
