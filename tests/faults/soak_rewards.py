"""The soak's reward: `letters`, except that it raises for about one prompt in five (chosen by a hash of the prompt,
so a resumed run fails on the same prompts), like a remote judge that times out now and then. Registered in the
training subprocess only, as `--reward-funcs faults.soak_rewards:flaky_letters`."""

from __future__ import annotations

import json
import zlib

from grpo.rewards import letters_reward


def raises_for(prompt) -> bool:
    return zlib.crc32(json.dumps(prompt, sort_keys=True).encode()) % 5 == 0


def flaky_letters(completions, prompts=None, **kwargs):
    if prompts and raises_for(prompts[0]):
        raise TimeoutError("soak: the judge timed out (injected)")
    return letters_reward(completions, **kwargs)
