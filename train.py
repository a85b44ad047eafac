"""Trainer entry point: `torchrun --nproc-per-node 4 train.py --model Qwen/Qwen3.5-2B` (or plain `python`).

Recipe: parse the config -> load model and tokenizer -> cold weight sync -> spawn the rollout worker (rank 0) ->
loop: pull samples, pack them as prefix tries (one row per rank), forward/backward with tree attention, step,
push weights to vLLM every `weight_sync_steps`, log, checkpoint.

Python API: `train.main(config, reward_funcs=[fn], train_dataset=ds, tools=[...], environment_factory=Env,
loop_cls=MyLoop, peft_config=LoraConfig(...), eval_dataset=held_out)`; every argument left None is taken from the
config (registry names, `pkg.module:name`, the `lora_*` fields, `eval_dataset`).
"""

from __future__ import annotations

import logging
import math
import time

from grpo.config import DEFAULT_DATASET, AsyncGRPOConfig
from grpo.step_metrics import StepTimer, log_window, resolve_metrics, step_summary  # noqa: F401 (re-exported)
from grpo.step_plan import StepPlan  # the micro-batch plan train_micro_batch consumes (also imported from here)

log = logging.getLogger("train")


# ------------------------------------------------------------------------------------------ building the pieces

def resolve_inputs(config: AsyncGRPOConfig, reward_funcs, train_dataset, tools, environment_factory, loop_cls):
    """CLI names / import paths -> objects, for everything the Python caller did not pass."""
    from grpo.imports import resolve_import
    from grpo.rollout_worker import check_picklable

    from grpo.data import load_prompts, validate_prompts
    from grpo.rewards import check_reward_columns, resolve_reward
    from grpo.tools import check_environment_names, check_tools, environment_gives_reward

    if config.num_generations < 2:  # else it starts, and every group is dropped for equal rewards
        raise ValueError(f"--num-generations {config.num_generations}: GRPO needs >= 2 generations per prompt to "
                         f"compute group advantages (each rollout is scored against its group's mean); set "
                         f"--num-generations 2 or more (default 8)")
    if config.env_reset_retries < 0:
        raise ValueError(f"--env-reset-retries {config.env_reset_retries}: pass 0 (drop the prompt at the first "
                         f"failing reset()) or more")

    if tools is None:
        tools = [resolve_import(path) for path in config.tools]
    if environment_factory is None and config.environment_factory:
        environment_factory = resolve_import(config.environment_factory)
    if reward_funcs is None:
        names = config.reward_funcs if config.reward_funcs is not None else (
            () if environment_factory is not None else ("accuracy",))
        reward_funcs = [resolve_reward(name) for name in names]
    elif callable(reward_funcs):
        reward_funcs = [reward_funcs]
    if loop_cls is None and config.loop_cls:
        loop_cls = resolve_import(config.loop_cls)
    dataset_name = config.dataset if config.dataset is not None else (
        None if environment_factory else DEFAULT_DATASET)
    if train_dataset is None and dataset_name is not None:
        train_dataset = load_prompts(dataset_name, config.dataset_split, require_prompt=environment_factory is None)
    else:  # the Python API's dataset gets the same checks as a loaded one
        validate_prompts(train_dataset, "train_dataset", require_prompt=environment_factory is None)
    if train_dataset is None and config.max_steps <= 0:
        raise ValueError("without a dataset the environment owns the data: set --max-steps to bound the run")
    if not reward_funcs and not environment_gives_reward(environment_factory) and loop_cls is None:
        raise ValueError("nothing scores the rollouts: pass reward functions (--reward-funcs NAME or "
                         "reward_funcs=[fn]) or an environment_factory whose class defines get_reward()")
    if train_dataset is not None:
        from grpo.data import dataset_columns

        check_reward_columns(reward_funcs, dataset_columns(train_dataset) - {"prompt"})
    check_tools(tools, environment_factory)
    check_environment_names(environment_factory, train_dataset)
    check_picklable(reward_funcs, tools, environment_factory, loop_cls)  # they cross into the spawned worker
    return list(reward_funcs), train_dataset, list(tools), environment_factory, loop_cls


def check_model_path(model: str) -> None:
    """A `--model` that is a filesystem path must exist (named before anything contacts the server)."""
    from pathlib import Path

    looks_like_path = model.startswith(("/", ".", "~")) or model.count("/") > 1
    if looks_like_path and not Path(model).expanduser().exists():
        raise FileNotFoundError(f"--model {model!r} is a path that does not exist; pass a local save_pretrained "
                                f"directory or a Hub id like Qwen/Qwen3-0.6B")


def check_not_reimported() -> None:
    """Under the spawn start method the rollout worker re-imports the script that called train.main; without an
    `if __name__ == "__main__":` guard it would load the model again and push a cold sync to the live server."""
    import multiprocessing

    if multiprocessing.parent_process() is not None:
        raise RuntimeError("train.main was called while a child process imported your script (the rollout worker "
                           "is spawned): put the call under `if __name__ == \"__main__\":`")


def build_optimizer(params, config: AsyncGRPOConfig):
    import torch

    fused = torch.cuda.is_available()
    optimizer = torch.optim.AdamW(params, lr=config.learning_rate, betas=(config.adam_beta1, config.adam_beta2),
                                  eps=config.adam_epsilon, weight_decay=config.weight_decay, fused=fused)
    if config.lr_scheduler_type != "constant" and config.max_steps <= 0:
        raise ValueError(f"lr_scheduler_type={config.lr_scheduler_type!r} decays over max_steps, which is unknown "
                         "when training by epochs: set --max-steps too")

    def factor(step: int) -> float:
        if config.warmup_steps and step < config.warmup_steps:
            return (step + 1) / config.warmup_steps
        if config.lr_scheduler_type == "constant":
            return 1.0
        progress = min(1.0, (step - config.warmup_steps) / max(1, config.max_steps - config.warmup_steps))
        return 1.0 - progress if config.lr_scheduler_type == "linear" else 0.5 * (1 + math.cos(math.pi * progress))

    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


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
                            rejoin_wait_s=config.server_rejoin_wait_s)


def rejoin_probe(config: AsyncGRPOConfig, facts: dict):
    """url -> None when a dropped server may rejoin (the start-up checks of `server_facts`), else why not."""
    import functools

    from grpo.rejoin import probe_server

    return functools.partial(probe_server, expected=facts, check_model=functools.partial(check_served_model, config))


def build_policy(config: AsyncGRPOConfig, info, token_budget: int, peft_config=None):
    """(model, policy, optimizer, scheduler, autocast): the training side of the run, built the same way for
    train.py and scripts/bench_step.py. `model` is the PEFT model when `peft_config` (or `--lora-r`) is given.

    Precision: fp32 master weights (`--dtype float32`) with bf16 compute on CUDA go through FSDP2's mixed
    precision also on one GPU (grpo/distributed.py says why), so no autocast is needed; autocast remains only
    for a bf16 request the sharding cannot serve (bf16 on fp16 weights)."""
    import contextlib

    import torch

    from grpo.distributed import hsdp_replicas, shard_model
    from grpo.gdn import patch_gdn_layers
    from grpo.lora import packed_forward_module, peft_config_from_run, wrap_policy
    from grpo.memory import checkpointing_fraction, probe_samples
    from grpo.model import (aux_loss_coef, compile_layer_regions, load_policy, set_gradient_checkpointing,
                            trainable_parameters)
    from grpo.policy import PackedPolicy
    from grpo.tree_attention import select_backend
    from grpo.trie import pack_samples

    model = load_policy(config.model, config.dtype, config.trust_remote_code, False,
                        config.router_aux_loss_coef).to(info.device)
    if (peft_config := peft_config or peft_config_from_run(config)) is not None:
        model = wrap_policy(model, peft_config)
    patch_gdn_layers(model, config.gdn_kernel)
    bf16 = config.bf16 if config.bf16 is not None else info.device.type == "cuda"
    mixed_precision = bf16 and config.dtype == "float32"
    compile_layers = config.compile_layers if config.compile_layers is not None else info.device.type == "cuda"
    if compile_layers:
        log.info("torch.compile: %d decoder regions (norms, MLPs, rotary) and the log-prob head's softmax passes",
                 compile_layer_regions(model))
    cuda = info.device.type == "cuda"  # keep the head's forward logits for its backward: <= 4 GiB, counted by the probe
    policy = PackedPolicy(packed_forward_module(model), select_backend(config.attn_backend, info.device),
                          config.temperature, aux_coef=aux_loss_coef(model, config.router_aux_loss_coef),
                          keep_logits_bytes=(4 << 30) if cuda else 0, fused_head=compile_layers)
    policy = shard_model(policy, info, mixed_precision=mixed_precision,
                         replicas=hsdp_replicas(config.hsdp_replicas, info))
    autocast = ((lambda: torch.autocast(info.device.type, dtype=torch.bfloat16))
                if bf16 and not mixed_precision and config.dtype != "bfloat16" else contextlib.nullcontext)

    def run_probe():  # one worst-case micro-batch through the real policy; its gradients are dropped
        row = pack_samples(probe_samples(token_budget, model.config.get_text_config().vocab_size)).to(info.device)
        with autocast():
            out = policy(row)
        out.policy_logprobs.float().sum().backward()
        for p in policy.parameters():
            p.grad = None

    fraction = checkpointing_fraction(config.gradient_checkpointing, policy, model, info, token_budget, run_probe)
    set_gradient_checkpointing(packed_forward_module(model), fraction)
    optimizer, scheduler = build_optimizer(trainable_parameters(policy), config)
    return model, policy, optimizer, scheduler, autocast


class NonFiniteStepError(RuntimeError):
    """Too many steps in a row had a non-finite loss or gradient norm."""


def step_is_finite(grad_norm, losses) -> bool:
    """True when the gradient norm and every micro-batch loss are finite on every rank (one tiny all-reduce: the
    ranks must agree, or one would step while another skips)."""
    import torch

    if hasattr(grad_norm, "full_tensor"):  # FSDP2: clip_grad_norm_ returns a (replicated) DTensor
        grad_norm = grad_norm.full_tensor()
    flag = torch.isfinite(grad_norm.detach().float()).all()
    for loss in losses:
        flag = flag & torch.isfinite(loss.float()).all()
    flag = flag.to(torch.int32).reshape(1)
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MIN)
    return bool(flag.item())


def optimizer_step(policy, optimizer, scheduler, max_grad_norm: float | None, losses=()) -> tuple:
    """Clip, step, zero: (grad_norm before clipping, seconds, stepped). A non-finite loss or gradient norm skips
    the optimizer and the scheduler (their state and the weights stay as they were) and drops the gradients."""
    import torch

    from grpo.model import trainable_parameters

    params = trainable_parameters(policy)
    timer = StepTimer(params[0].device)
    grad_norm = torch.nn.utils.clip_grad_norm_(params, max_grad_norm or 1e30)
    stepped = step_is_finite(grad_norm, losses)
    if stepped:
        optimizer.step()
        scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    timer.mark()
    return grad_norm, timer.seconds()[0], stepped  # waits for the step's GPU work: the end of a step is a sync point


def check_nonfinite(stepped: bool, step: int, micro: list[dict], grad_norm: float, in_a_row: int,
                    limit: int) -> int:
    """Count skipped steps in a row; warn on each, raise NonFiniteStepError at `limit` (0 = never)."""
    if stepped:
        return 0
    in_a_row += 1
    losses = [m.get("loss") for m in micro]
    log.warning("step %d skipped: loss %s, grad norm %s are not finite (no optimizer step, no weight sync; %d in a "
                "row)", step, losses, grad_norm, in_a_row)
    if limit and in_a_row >= limit:
        raise NonFiniteStepError(
            f"{in_a_row} steps in a row had a non-finite loss or gradient norm (last: loss {losses}, grad norm "
            f"{grad_norm}); nothing was synced to the servers. Check the reward functions for NaN/inf, lower "
            f"--learning-rate, or use --dtype float32 (max_nonfinite_steps_in_a_row={limit})")
    return in_a_row


# ------------------------------------------------------------------------------------------ one micro-batch

def train_micro_batch(policy, samples, plan: StepPlan, loss_fn, loss_options, world: int, grad_accum: int,
                      autocast, max_completion_length: int = 1) -> dict:
    """Pack this rank's samples, forward/backward, return the loss metrics. The normaliser is global over ranks.

    Nothing here waits for the GPU: the metrics stay tensors and the timings CUDA events (resolve_metrics reads
    them once per step, after the optimizer), so the host packs the next micro-batch while this one runs."""
    import torch

    from grpo.trie import pack_samples

    device = next(policy.parameters()).device
    row = pack_samples(samples).to(device)
    timer = StepTimer(device)
    with autocast():
        out = policy(row)
    timer.mark()
    metrics: dict = {}
    if row.num_loss_terms == 0:  # a zero-weight dummy row: forward/backward anyway to keep FSDP collectives aligned
        loss = out.policy_logprobs.sum() * 0.0
    else:
        loss, metrics = normalized_row_loss(out, row, samples, plan, loss_fn, loss_options, world, grad_accum,
                                            max_completion_length)
        metrics = {k: torch.as_tensor(v).detach() for k, v in metrics.items()} | {"entropy": out.entropy.mean()}
    if out.aux_loss is not None:  # router_aux_loss_coef x aux_loss / GA (docs/losses.md)
        loss = loss + policy_module(policy).aux_coef * out.aux_loss / grad_accum
        metrics["aux_loss"] = out.aux_loss.detach()
    loss.backward()
    timer.mark()
    return metrics | {"loss": loss.detach() * grad_accum, "_timer": timer, "_forwarded": row.num_tokens,
                      "_attended_keys": row.attention_cost, "_head_tokens": row.num_loss_terms}


# ==================================== LOSS REGION: what a loss sees and how its terms are normalised ===============
def normalized_row_loss(out, row, samples, plan: StepPlan, loss_fn, loss_options, world: int, grad_accum: int,
                        max_completion_length: int):
    """(this rank's share of the micro-batch loss, loss metrics): build LossInputs, call the loss, normalise.

    The loss sees the row's sequence/group structure and the micro-batch's global counts; `normalized_loss`
    divides by the count its normaliser names (tokens, sequences, sequences x max_completion_length) over W ranks
    and GA steps, so FSDP's gradient mean and the accumulation sum give the step's loss (docs/losses.md).
    """
    import torch

    from grpo.losses import LossInputs, normalized_loss

    device = row.sample_id.device
    group_of_sample = torch.tensor([s.group_id for s in samples], dtype=torch.long, device=device)  # [S]
    inputs = LossInputs(
        policy_logprobs=out.policy_logprobs.float(), sampler_logprobs=row.sampler_logprobs,
        advantages=row.advantages, sequence_index=row.sample_id, group_index=group_of_sample[row.sample_id],
        sequence_lengths=torch.bincount(row.sample_id, minlength=len(samples)),
        num_tokens_global=plan.trained_tokens, num_sequences_global=plan.trained_sequences,
        max_completion_length=max_completion_length,
        policy_top_logprobs=None if out.policy_top_logprobs is None else out.policy_top_logprobs.float(),
        sampler_top_logprobs=row.sampler_top_logprobs)
    result = loss_fn(inputs, loss_options)
    return normalized_loss(result, inputs, world, grad_accum), result.metrics
# ==================================== END LOSS REGION ================================================================


def policy_module(policy):
    return getattr(policy, "module", policy)


# ------------------------------------------------------------------------------------------ the run

def resolve_eval_dataset(config: AsyncGRPOConfig, eval_dataset, environment_factory):
    """The held-out prompts: the Python argument, else `--eval-dataset` loaded; checked like the training set."""
    from grpo.data import load_prompts, validate_prompts

    if eval_dataset is None and config.eval_dataset is not None:
        eval_dataset = load_prompts(config.eval_dataset, config.eval_dataset_split,
                                    require_prompt=environment_factory is None)
    elif eval_dataset is not None:
        validate_prompts(eval_dataset, "eval_dataset", require_prompt=environment_factory is None)
    if eval_dataset is not None and config.eval_max_prompts is not None and config.eval_max_prompts < len(eval_dataset):
        n = config.eval_max_prompts
        eval_dataset = eval_dataset.select(range(n)) if hasattr(eval_dataset, "select") else list(eval_dataset)[:n]
    if eval_dataset is not None and (config.eval_num_generations < 1 or config.eval_steps < 0):
        raise ValueError(f"--eval-num-generations {config.eval_num_generations} --eval-steps {config.eval_steps}: "
                         f"pass k >= 1 and eval_steps >= 0 (0 = only the final evaluation)")
    return eval_dataset


def main(config: AsyncGRPOConfig, reward_funcs=None, train_dataset=None, tools=None, environment_factory=None,
         loop_cls=None, peft_config=None, eval_dataset=None) -> dict:
    import torch

    from grpo import checkpoint as ckpt
    from grpo.advantages import apply_batch_transforms, batch_transforms, check_advantage_config
    from grpo.batcher import TokenBudgetBatcher
    from grpo.distributed import barrier, broadcast_object, hsdp_replicas, init_distributed
    from grpo.evaluation import eval_due
    from grpo.flops import device_peak_flops
    from grpo.ledger import no_step_message, record_prompts, resume_skips
    from grpo.lora import adapter_versions_for, choose_sync_mode
    from grpo.losses import loss_function
    from grpo.metrics import MetricsLogger
    from grpo.model import load_tokenizer
    from grpo.rollout_worker import RolloutWorker, ServedModel, WorkerStart
    from grpo.shared_state import LoopOptions
    from grpo.repro import write_repro_bundle
    from grpo.step_plan import plan_step
    from grpo.trackers import COMPLETION_COLUMNS, build_trackers, check_trackers, completion_rows
    from grpo.weight_sync import WeightSync

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    check_not_reimported()
    check_model_path(config.model)
    loss_fn = loss_function(config.loss)  # an options class without a registered loss fails here
    check_advantage_config(config)  # the estimator, its options and the batch transforms, before any model loads
    transforms = batch_transforms(config.advantage_batch_transforms)
    check_trackers(config.report_to)  # a tracker whose library is missing fails here, with the pip command
    log.info("vLLM servers: %s", " ".join(config.vllm_server_urls))  # a malformed URL fails here, before the data
    reward_funcs, dataset, tools, environment_factory, loop_cls = resolve_inputs(
        config, reward_funcs, train_dataset, tools, environment_factory, loop_cls)
    eval_dataset = resolve_eval_dataset(config, eval_dataset, environment_factory)
    info = init_distributed(config.vllm_server_timeout)
    hsdp_replicas(config.hsdp_replicas, info)  # a bad value fails here, before the server is contacted
    ckpt.check_shared_output_dir(config.output_dir)  # rank 0 writes what every rank reads back on resume
    torch.manual_seed(config.seed)
    facts = broadcast_object(server_facts(config) if info.is_main else None, info)
    budget = config.token_budget or facts["max_model_len"]

    tokenizer = load_tokenizer(config.model, config.trust_remote_code)
    model, policy, optimizer, scheduler, autocast = build_policy(config, info, budget, peft_config)

    state = ckpt.start_state(config.resume_from_checkpoint, config.output_dir, model, optimizer, scheduler,
                             log_on_this_rank=info.is_main)

    adapter = adapter_versions_for(config, choose_sync_mode(config.lora_sync, model, facts["lora"],
                                                            config.max_staleness))
    # auto is decided by WeightSync.init from the servers (ipc / nccl / cpu_file, grpo/ipc_transfer.py) and logged
    sync = WeightSync(config.vllm_server_urls, sync_config(config), adapter=adapter)
    sync.rejoiner.probe = rejoin_probe(config, facts)  # dropped servers come back (docs/reliability.md)
    sync.init(model)
    version = state["model_version"] + 1
    sync.sync(model, version)  # cold sync: the first rollouts already come from this policy

    worker = stop_groups = None
    logger = MetricsLogger(config.output_dir, enabled=info.is_main,
                           total_steps=config.max_steps if config.max_steps > 0 else None,
                           trackers=build_trackers(config) if info.is_main else [])
    if info.is_main:
        write_repro_bundle(config.output_dir, config, info.world_size)
        options = LoopOptions(tools=tuple(tools), environment_factory=environment_factory,
                              lora_name=adapter and adapter.name, dataset_start_index=state["prompt_index"],
                              skip_positions=frozenset(resume_skips(state)), eval_dataset=eval_dataset)
        worker = RolloutWorker(config, dataset, reward_funcs, options, loop_cls=loop_cls,
                               served=ServedModel(name=facts["served_model"]),
                               start=WorkerStart(model_version=version, servers_alive=tuple(sync.alive_flags),
                                                 carried=tuple(state.get("carried", []))))
        # until the first step says what one consumes: a full step of token budgets on every rank
        worker.set_allowance_from_step(budget * info.world_size * config.gradient_accumulation_steps)
        worker.start()
        sync.alive_flags = worker.servers_alive  # a server either side finds dead leaves both (several servers)
        worker.on_idle = lambda: sync.rejoin_alone(model, worker.model_version)  # no server alive: bring one back
        if config.max_steps <= 0:
            stop_groups = config.epoch_prompts(len(dataset)) - state["prompt_index"]
    batcher = TokenBudgetBatcher(budget, info.world_size)

    def save(at_step: int, rollout_state: dict | None = None) -> int:
        if rollout_state is None:  # + the untrained rest of partial groups (read while the worker runs)
            rollout_state = worker.state_dict(batcher.pending()) if info.is_main else {}
        ckpt.save_checkpoint(config.output_dir, at_step, model, tokenizer, optimizer, scheduler, rollout_state,
                             config.save_total_limit)
        return at_step

    saved_step = state["step"]
    peak = device_peak_flops(info.device)
    step, num_tokens, window = state["step"], 0, []
    nonfinite_in_a_row = 0
    sync_due = False
    try:
        while config.max_steps <= 0 or step < config.max_steps:
            t_step = time.perf_counter()
            plans = plan_step(worker, batcher, stop_groups, config.gradient_accumulation_steps, info)
            if not plans:
                break
            # the per-step advantage hook: every sample of the step (all ranks' rows), the same on every rank
            apply_batch_transforms(transforms, [s for p in plans for row in p.rows for s in row], step + 1)
            # the last step of the epochs may close fewer micro-batches: they are trained, normalised by their count
            micro = [train_micro_batch(policy, p.rows[info.rank], p, loss_fn, config.loss, info.world_size,
                                       len(plans), autocast, config.max_completion_length) for p in plans]
            grad_norm, optimizer_s, stepped = optimizer_step(policy, optimizer, scheduler, config.max_grad_norm,
                                                             [m["loss"] for m in micro])
            micro = resolve_metrics(micro)
            step += 1
            nonfinite_in_a_row = check_nonfinite(stepped, step, micro, float(grad_norm), nonfinite_in_a_row,
                                                 config.max_nonfinite_steps_in_a_row)
            sync_due = sync_due or step % config.weight_sync_steps == 0
            sync_metrics, trained_version = {}, version
            if sync_due and stepped:  # a skipped step's sync waits for the next step that trains
                version += 1
                sync_metrics = sync.sync(model, version)
                sync_due = False
            samples = [s for p in plans for row in p.rows for s in row if s.group_id >= 0]
            if info.is_main:
                worker.set_allowance_from_step(sum(len(s) for s in samples))
                worker.set_model_version(version)
                worker.mark_trained(samples)
                if eval_dataset is not None and eval_due(step, config.eval_steps):
                    worker.request_eval(version)  # run by the worker at this version; training goes on
                record_prompts(config.output_dir, step, samples, state, worker.drain_drops())
            step_metrics = step_summary(plans, samples, micro, info, time.perf_counter() - t_step, optimizer_s,
                                        sync_metrics, model.config, peak)
            num_tokens += step_metrics["batch/forwarded_tokens_per_step"]
            step_metrics |= {"num_tokens": num_tokens, "grad_norm": float(grad_norm),
                             "perf/rollout_wait_s": worker.take_wait_s() if info.is_main else 0.0,
                             "train/skipped_nonfinite_count": float(not stepped),
                             "learning_rate": scheduler.get_last_lr()[0]}
            window.append(step_metrics)
            if step % config.logging_steps == 0:
                log_window(logger, step, window, worker)
                window = []
                if config.log_completions:
                    logger.log_table(step, "completions", COMPLETION_COLUMNS, completion_rows(
                        samples, tokenizer, trained_version, step, config.num_completions_to_print))
            if config.save_strategy == "steps" and step % config.save_steps == 0:
                saved_step = save(step)
        if window:  # the last, partial logging window
            log_window(logger, step, window, worker)
        if eval_dataset is not None and info.is_main and step > state["step"]:  # the final evaluation, waited for
            worker.request_eval(version)
            if not worker.wait_eval(version, config.vllm_server_timeout):
                log.warning("the final evaluation (weight version %d) did not finish within %.0f s", version,
                            config.vllm_server_timeout)
            log_window(logger, step, [], worker)
        if info.is_main:  # drops booked after the last step (e.g. while the epochs ran out)
            record_prompts(config.output_dir, step, None, state, worker.drain_drops())
        if step == state["step"]:
            raise RuntimeError(no_step_message(worker))
        final_state = worker.state_dict(batcher.pending()) if info.is_main and step > saved_step else None
    finally:
        if worker is not None:
            worker.stop()
        logger.close()
    if step > saved_step:  # the final model is always saved, also with save_strategy="no"
        saved_step = save(step, final_state)
    barrier(info)
    sync.close()
    return {"step": step, "model_version": version, "output_dir": config.output_dir}


def config_class(argv: list[str]) -> tuple[type, list[str]]:
    """`--config-cls pkg.module:MyConfig` (anywhere in argv) -> the class, and argv without it."""
    from grpo.imports import resolve_import

    if "--config-cls" not in argv and not any(a.startswith("--config-cls=") for a in argv):
        return AsyncGRPOConfig, argv
    rest, path, i = [], None, 0
    while i < len(argv):
        if argv[i] == "--config-cls" and i + 1 < len(argv):
            path, i = argv[i + 1], i + 2
            continue
        if argv[i].startswith("--config-cls="):
            path = argv[i].split("=", 1)[1]
        else:
            rest.append(argv[i])
        i += 1
    cls = resolve_import(path or "")
    if not (isinstance(cls, type) and issubclass(cls, AsyncGRPOConfig)):
        raise TypeError(f"--config-cls {path!r} is not a subclass of AsyncGRPOConfig")
    return cls, rest


def install_signal_handlers() -> None:
    """SIGTERM (torchrun, schedulers, `kill`) unwinds like Ctrl-C, so the rollout worker is stopped on the way."""
    import signal

    def stop(signum, frame):
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, stop)


if __name__ == "__main__":
    import sys

    import tyro

    cls, args = config_class(sys.argv[1:])
    install_signal_handlers()
    main(tyro.cli(cls, args=args, description=__doc__))
