"""The spec's PEFT example through the Python API (run by test_lora.py in a subprocess against an --enable-lora
server): `train.main(..., peft_config=LoraConfig(r=32, lora_alpha=64, target_modules="all-linear"))`."""

from __future__ import annotations

import json
import sys

from api_example import short_reward

from grpo.config import AsyncGRPOConfig

if __name__ == "__main__":
    from peft import LoraConfig

    import train

    server_url, model, out = sys.argv[1:4]
    dataset = [{"prompt": [{"role": "user", "content": f"Count to {i}."}]} for i in range(8)]
    config = AsyncGRPOConfig(model=model, vllm_server_base_url=server_url, num_generations=4,
                             max_completion_length=8, learning_rate=5e-3, max_steps=3, max_staleness=2,
                             output_dir=out, save_strategy="no", rollout_worker_timeout=120)
    result = train.main(config, reward_funcs=[short_reward], train_dataset=dataset,
                        peft_config=LoraConfig(r=32, lora_alpha=64, target_modules="all-linear"))
    print("RESULT " + json.dumps(result))
