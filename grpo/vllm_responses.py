"""Parsing vLLM's generation answers (`/v1/completions`, `/inference/v1/generate` choices) into token ids, the
sampler's logprobs, its top-k candidates and sampling masks. Requests are sent by `VLLMClient` (vllm_client.py).
"""

from __future__ import annotations

import math

from grpo.samples import SAMPLER_NEG_INF


def _logprob(value: float | None) -> float:
    return -math.inf if value is None or value <= SAMPLER_NEG_INF else float(value)


def _token_id(key: str) -> int:
    """`"token_id:<id>"` keys exist only with `return_tokens_as_token_ids`; decoded strings would collide."""
    prefix, _, ident = key.rpartition(":")
    if prefix != "token_id":
        raise ValueError(f"top_logprobs key {key!r} is not 'token_id:<id>'; send return_tokens_as_token_ids=true")
    return int(ident)


def parse_completion_choice(choice: dict, num_logprobs: int) -> tuple[list[int], list[float], list[dict] | None]:
    """Generated ids, sampled-token logprobs and top-k candidates of a `/v1/completions` choice.

    Each `top_logprobs[j]` holds the sampled token plus the top k: k+1 keys when the sample is outside the top k,
    k when it is inside [vLLM 0.32]. So the sampled entry is dropped exactly when there are k+1 keys.
    """
    output_ids = [int(t) for t in choice["token_ids"]]
    logprobs = choice["logprobs"]
    sampled_logprobs = [_logprob(v) for v in logprobs["token_logprobs"]]
    if num_logprobs == 0:
        return output_ids, sampled_logprobs, None
    sampler_top: list[dict[int, float]] = []
    for sampled_id, entries in zip(output_ids, logprobs["top_logprobs"]):
        candidates = {_token_id(k): _logprob(v) for k, v in entries.items()}
        if len(candidates) > num_logprobs:
            candidates.pop(sampled_id)
        sampler_top.append(candidates)
    return output_ids, sampled_logprobs, sampler_top


def parse_generate_choice(choice: dict, num_logprobs: int) -> tuple[list[int], list[float], list[dict] | None,
                                                                     list[list[int]] | None]:
    """Ids, sampled logprobs, top-k candidates and sampling masks of an `/inference/v1/generate` choice.

    `top_logprobs` lists the sampled token first, then candidates by rank, truncated to the requested count; the
    request asked for k+1, so the entries of rank <= k are exactly the top k [vLLM 0.32].
    """
    output_ids = [int(t) for t in choice["token_ids"]]
    content = choice["logprobs"]["content"]
    sampled_logprobs = [_logprob(entry["logprob"]) for entry in content]
    sampler_top = None
    if num_logprobs > 0:
        sampler_top = [{int(c["token_id"]): _logprob(c["logprob"]) for c in entry["top_logprobs"]
                        if c.get("rank") is not None and c["rank"] <= num_logprobs} for entry in content]
    masks = choice.get("sampling_mask")
    if masks is not None:
        masks = [[int(t) for t in mask] for mask in masks]
        check_sampling_mask(output_ids, masks)
    return output_ids, sampled_logprobs, sampler_top, masks


def check_sampling_mask(output_ids: list[int], masks: list[list[int]]) -> None:
    if len(masks) != len(output_ids):
        raise ValueError(f"sampling_mask has {len(masks)} entries for {len(output_ids)} generated tokens")
    for j, (token, mask) in enumerate(zip(output_ids, masks)):
        if token not in mask:
            raise ValueError(f"sampled token {token} at position {j} is outside its sampling_mask {mask[:16]}; "
                             f"the server's mask does not describe its sampler (vLLM bug or mismatched flags)")
