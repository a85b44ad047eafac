"""Synthetic rollout groups for the benchmarks and the GPU step checks: what the rollout worker would deliver, at a
chosen prompt/completion length, with or without a shared prompt per group. Shared by scripts/bench_step.py and
scripts/bench_check.py (which bench_step calls), so neither imports the other for it."""

from __future__ import annotations

import random


def synthetic_groups(vocab: int, shared: bool, top_k: int, group_size=8, prompt_len=1068, completion_len=256,
                     seed=0):
    """Endless groups as the rollout worker delivers them (one advantage per rollout, the sampler's top-k ids and
    log-probs at trained positions when the loss asks for them)."""
    import numpy as np

    from grpo.samples import TrainingSample

    rng, np_rng, group_id = random.Random(seed), np.random.default_rng(seed), 0
    length = prompt_len + completion_len
    while True:
        prompt = [rng.randrange(10, vocab) for _ in range(prompt_len)]
        for _ in range(group_size):
            p = prompt if shared else [rng.randrange(10, vocab) for _ in range(prompt_len)]
            ids = p + [rng.randrange(10, vocab) for _ in range(completion_len)]
            top_ids = top_logp = None
            if top_k:
                top_ids = np.full((length, top_k), -1, dtype=np.int64)
                top_ids[prompt_len:] = np_rng.integers(10, vocab, (completion_len, top_k))
                top_logp = np.full((length, top_k), -np.inf, dtype=np.float32)
                top_logp[prompt_len:] = np.sort(np_rng.uniform(-8, -0.1, (completion_len, top_k)))[:, ::-1]
            yield TrainingSample(ids, [0] * prompt_len + [1] * completion_len, [-1.0] * length,
                                 rng.uniform(-1, 1), group_id, 0, sampler_top_ids=top_ids,
                                 sampler_top_logprobs=top_logp)
        group_id += 1
