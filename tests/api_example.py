"""A user's script for the Python API (run by test_train.py in a subprocess): a custom reward function, an
in-memory dataset and the spec's curriculum rollout loop, all passed to `train.main`."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass

import numpy as np

from grpo.config import AsyncGRPOConfig
from grpo.rollout_loop import AsyncRolloutLoop


def short_reward(completion_ids, **kwargs):
    """Odd first token scores 1 (a coin flip for a random policy, so groups carry signal from the start)."""
    return [float(ids[0] % 2) if ids else 0.0 for ids in completion_ids]


@dataclass
class CurriculumConfig(AsyncGRPOConfig):
    pass_rate_cap: float = 0.9


class CurriculumRolloutLoop(AsyncRolloutLoop):  # the spec's example, unchanged but for the names
    def filter_prompt(self, row_index, row, epoch):
        return self.pass_rates.get(row_index, 0.0) < self.config.pass_rate_cap

    async def setup(self):
        self.pass_rates = {}

    def compute_advantages(self, group):
        scored = group.rewards[~np.isnan(group.rewards)]
        if len(scored):
            self.pass_rates[group.row_index] = float(np.mean(scored > 0))
        return super().compute_advantages(group)


if __name__ == "__main__":
    import train

    server_url, model, out = sys.argv[1:4]
    dataset = [{"prompt": [{"role": "user", "content": f"Count to {i}."}], "level": i} for i in range(6)]
    config = CurriculumConfig(model=model, vllm_server_base_url=server_url, num_generations=4,
                              max_completion_length=8, learning_rate=1e-3, max_steps=3, output_dir=out,
                              save_strategy="no", rollout_worker_timeout=120)
    result = train.main(config, reward_funcs=[short_reward], train_dataset=dataset,
                        loop_cls=CurriculumRolloutLoop)
    print("RESULT " + json.dumps(result))
