"""What the trainer reads from the vLLM servers at start, and the weight sync built on it.

`server_facts` (rank 0, once): every server ready, serving `--model` (same name, or the same architecture and
shape), with the same max_model_len and dtype, logprobs that are the sampler's; the LoRA limits. `build_weight_sync`:
the sync channel to those servers (transfer, adapter or merged LoRA sync, dropped servers probed for a rejoin),
initialised on the loaded model.
"""

from __future__ import annotations

import logging

from grpo.config import AsyncGRPOConfig

log = logging.getLogger("train")


def server_facts(config: AsyncGRPOConfig) -> dict:
    """Rank 0 reads what the run needs from every server once (max_model_len, dtype), rejects a server whose
    logprobs are not the sampler's or whose limits differ from the first one's, and warns on mismatches."""
    from grpo.vllm_client import ServerFacts, VLLMControl

    facts, first, served_first = [], None, None
    for url in config.vllm_server_urls:
        with VLLMControl(url, timeout=config.vllm_server_timeout) as control:
            control.wait_ready(progress_every=config.progress_interval_s)
            if control.is_paused():  # a previous trainer died mid-sync; the cold sync rewrites every weight
                log.warning("the vLLM server at %s was left paused (a previous run stopped mid-sync?); the cold sync "
                            "resumes it", url)
            server_info = control.server_info()
            served = control.models()["data"][0]["id"]
            check_served_model(config, url, served, server_info)
            served_first = served_first or served  # the name requests carry (the server may spell --model otherwise)
            facts.append(ServerFacts.from_server_info(server_info, control.max_model_len()))
        facts[-1].check(url)
        first = first or server_info
        if (facts[-1].max_model_len, facts[-1].dtype) != (facts[0].max_model_len, facts[0].dtype):
            raise ValueError(f"the vLLM servers differ: {config.vllm_server_urls[0]} serves max_model_len="
                             f"{facts[0].max_model_len} dtype={facts[0].dtype}, {url} max_model_len="
                             f"{facts[-1].max_model_len} dtype={facts[-1].dtype}; start every server with the same "
                             f"--max-model-len and --dtype")
    facts = facts[0]
    if facts.dtype and config.dtype != "auto" and facts.dtype != config.dtype:
        log.warning("server dtype %s != trainer dtype %s: the train/inference mismatch will show as importance "
                    "ratios away from 1 (restart vllm serve with --dtype %s)", facts.dtype, config.dtype, config.dtype)
    if config.uses_truncated_sampling and not facts.return_sampling_mask:
        log.warning("top_k/top_p/min_p sampling without --return-sampling-mask: trainer log-probs stay normalised "
                    "over the full vocabulary, so importance ratios are biased by the kept mass")
    from grpo.lora import server_lora_facts

    return {"max_model_len": facts.max_model_len, "dtype": facts.dtype, "lora": server_lora_facts(first),
            "served_model": served_first}


MODEL_SHAPE_KEYS = ("architectures", "model_type", "vocab_size", "hidden_size", "num_hidden_layers",
                    "num_attention_heads", "num_key_value_heads", "intermediate_size")


def model_shape(config_dict: dict) -> dict:
    """What must agree between the trainer's model and the served one (the text config of a VLM)."""
    text = config_dict.get("text_config") or config_dict
    shape = {k: text.get(k) for k in MODEL_SHAPE_KEYS if k != "architectures"}
    return shape | {"architectures": config_dict.get("architectures")}


def check_served_model(config: AsyncGRPOConfig, url: str, served: str, server_info: dict) -> None:
    """The server serves `--model`: the same name or path, or a checkpoint of the same architecture and shape
    (architecture, vocabulary, hidden size, layers, heads). A different model is refused with both names (its
    first weight sync would fail with an opaque 500 and leave the server paused)."""
    import os

    from grpo.vllm_server import read_model_config

    model_cfg = (server_info.get("vllm_config") or {}).get("model_config") or {}
    server_model = str(model_cfg.get("model") or served)
    names = {config.model, os.path.abspath(config.model) if os.path.isdir(config.model) else config.model}
    if server_model in names or served in names:
        return
    ours, theirs = read_model_config(config.model), read_model_config(server_model)
    if ours is None or theirs is None:
        log.warning("the vLLM server at %s serves %r, not --model %r, and its config is not readable here: cannot "
                    "check that they are the same model (a different one fails the first weight sync)", url,
                    server_model, config.model)
        return
    mine, served_shape = model_shape(ours), model_shape(theirs)
    diff = {k: (mine[k], served_shape[k]) for k in mine if mine[k] != served_shape[k]}
    if diff:
        raise ValueError(f"the vLLM server at {url} serves {server_model!r}, which is not --model {config.model!r} "
                         f"(differs in {', '.join(f'{k}: {a} here vs {b} there' for k, (a, b) in diff.items())}); "
                         f"restart the server with `vllm serve {config.model}` or pass --model {server_model}")
    log.info("the vLLM server at %s serves %r: same architecture and shape as --model %r", url, server_model,
             config.model)


def sync_config(config: AsyncGRPOConfig):
    from grpo.weight_sync import WeightSyncConfig

    return WeightSyncConfig(mode=config.weight_transfer, timeout=config.vllm_server_timeout,
                            ipc_bucket_bytes=config.ipc_bucket_mb << 20,
                            phase_timeout=config.weight_sync_timeout, progress_every=config.progress_interval_s,
                            rejoin_interval_s=config.server_rejoin_interval_s,
                            rejoin_wait_s=config.server_rejoin_wait_s, keep_kv_cache=config.sync_keeps_kv_cache)


def rejoin_probe(config: AsyncGRPOConfig, facts: dict):
    """url -> None when a dropped server may rejoin (the start-up checks of `server_facts`), else why not."""
    import functools

    from grpo.rejoin import probe_server

    return functools.partial(probe_server, expected=facts, check_model=functools.partial(check_served_model, config))


def build_weight_sync(config: AsyncGRPOConfig, facts: dict, model):
    """The run's `WeightSync`, initialised on `model` (no weights sent yet), and its LoRA adapter store (None
    unless adapter sync)."""
    from grpo.lora import adapter_versions_for, choose_sync_mode
    from grpo.weight_sync import WeightSync

    adapter = adapter_versions_for(config, choose_sync_mode(config.lora_sync, model, facts["lora"],
                                                            config.max_staleness))
    # auto is decided by WeightSync.init from the servers (ipc / nccl / cpu_file, grpo/ipc_transfer.py) and logged
    sync = WeightSync(config.vllm_server_urls, sync_config(config), adapter=adapter)
    sync.rejoiner.probe = rejoin_probe(config, facts)  # dropped servers come back (docs/reliability.md)
    sync.init(model)
    return sync, adapter
