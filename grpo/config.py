"""The run configuration: the spec's `AsyncGRPOConfig` fields (same names, same defaults), parsed by tyro.

One departure: the spec's loss fields (`score_centering`, `epsilon`, `epsilon_high`,
`vllm_importance_sampling_clip_min/max`, `num_sampler_logprobs`) keep their names and defaults but live in the
options dataclass of the chosen loss: `loss=ScoreCenteringOptions(epsilon=0.28)` in Python, `--loss.epsilon 0.28`
on the CLI; `score_centering=False` becomes `loss=ClippedOptions()` / `loss:clipped-surrogate` (docs/losses.md).

Only fields this trainer acts on are here; each docstring is the `--help` text. Derived values are properties.
A subclass with extra fields (e.g. a curriculum threshold read by a custom rollout loop) works as in the spec:
pass an instance to `train.main(config, ...)`, or `python train.py --config-cls pkg.module:MyConfig ...` on the CLI
(a `@dataclass` subclass of AsyncGRPOConfig; its fields become flags).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

from grpo.advantages import (batch_transform_cli_type, estimator_cli_union, estimator_options, transform_options,
                             transform_options_class)
from grpo.domains import (LITERAL, MAX_WAIT_S, Checked, CrossRule, Flag, Num, Text, Texts, budget_fits_a_sample,
                          buffer_inside_completion, chat_kwargs, estimator, hsdp, loss_options, schedule_has_an_end,
                          server_urls, warmup_inside_steps)
from grpo.group_estimators import GroupStdOptions
from grpo.losses import loss_cli_union, sampler_needs
from grpo.score_centering import ScoreCenteringOptions

DEFAULT_DATASET = "trl-lib/DeepMath-103K"
LossOptions = loss_cli_union()
"""Union of the registered losses' options classes, one tyro subcommand `loss:NAME` per registered loss."""
AdvantageOptions = estimator_cli_union()
"""Union of the registered estimators' options classes, one tyro subcommand `advantage:NAME` per estimator."""
BatchTransformNames = batch_transform_cli_type()
"""The registered advantage batch transforms' names (described in --help)."""
TransformOptions = transform_options_class(__name__)
"""One field per registered batch transform holding its options: `--transform.NAME.OPTION VALUE` on the CLI."""


@dataclass
class AsyncGRPOConfig:
    # ---- model -------------------------------------------------------------------------------------------------
    model: str = "Qwen/Qwen3.5-2B"
    """Model id or local `save_pretrained` directory. VLM checkpoints are trained text-only (vision tower frozen)."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "float32"
    """Dtype the weights are loaded in. float32 by default (the train/inference mismatch is precision sensitive);
    serve vLLM with the same `--dtype` to close the gap end to end."""
    trust_remote_code: bool = False
    """Allow custom modelling code from the checkpoint."""
    router_aux_loss_coef: float | None = None
    """MoE load-balancing loss weight (>= 0); None = the model config's value, 0 disables. Errors on a dense
    model."""
    attn_backend: Literal["auto", "flash_varlen", "flash_split", "flex", "sdpa"] = "auto"
    """Tree-attention backend. auto: flash_split on CUDA (sm80+), else FlashAttention varlen / FlexAttention, the
    SDPA reference on CPU. flash_split reads each shared prefix once per parent (two flash calls merged by
    log-sum-exp); flash_varlen gathers every segment's whole path (a prefix once per descendant)."""
    gradient_checkpointing: Literal["auto", "true", "false"] = "auto"
    """Recompute activations in the backward pass. auto: measured before the first step with a worst-case
    micro-batch; off when the peak fits the GPU, otherwise just enough layers to fit (selective); off on CPU."""
    bf16: bool | None = None
    """bf16 compute for forward/backward (fp32 masters, FSDP2 mixed precision); None = on when CUDA is available."""
    one_process_fsdp: bool = False
    """One process with bf16 compute over fp32 weights (one GPU): false keeps bf16 compute copies beside the fp32
    masters without FSDP2 (grpo/master_weights.py); true shards through FSDP2 anyway (a group of one, with its
    per-step casts and one-rank collectives; same numerics, 2-16 % slower on an H200). No effect on several ranks."""
    compile_layers: bool | None = None
    """torch.compile each decoder layer's norms, MLP and rotary embedding, Gated DeltaNet's tree conv and gated norm,
    and the log-prob head's softmax passes (fused elementwise work); None = on when CUDA is available."""
    compile_scope: Literal["regions", "layers", "layers_gdn"] = "layers_gdn"
    """What `compile_layers` compiles: layers_gdn = each dense attention layer whole, and where FLA runs Gated
    DeltaNet in one pass per row each GDN layer whole too (FLA a custom op inside; with a sparse MLP, its mixer
    alone; grpo/kernels/gdn_graph.py); layers = the attention layers whole only (GDN layers keep their regions); regions =
    the norms, MLP and rotary embedding of each layer, one compiled call each (~6 per layer). The attention layer's
    graph holds `flash_split` as a custom op (other backends split it into two graphs); MoE layers keep their
    regions. On an H200: layers gave the Qwen3-0.6B step +5-17 % and Qwen3-1.7B +1-5 % trained tokens/s over
    regions (2026-12-03); layers_gdn gave the Qwen3.5-2B step +10 % (tree) and +12 % (plain) over layers
    (2026-12-05, 40.5 % MFU)."""
    gdn_kernel: Literal["auto", "fla", "torch"] = "auto"
    """Gated DeltaNet (Qwen3.5) recurrence on tree rows: fla = flash-linear-attention's varlen Triton kernel
    (`pip install fla-core`), torch = this project's chunked torch kernel per padded trie level (grpo/kernels/gdn_kernel.py);
    auto = fla on CUDA where installed and checked, else torch (grpo/kernels/gdn_choice.py)."""

    # ---- PEFT / LoRA -----------------------------------------------------------------------------------------------
    lora_r: int = 0
    """> 0: train a LoRA adapter of this rank instead of the full model; 0 = train the full model (Python API:
    `peft_config=LoraConfig(...)` replaces the lora_* fields). Checkpoints then hold the adapter (PEFT format)."""
    lora_alpha: float | None = None
    """LoRA scaling numerator (scale = alpha / r); None = 2 x lora_r."""
    lora_target_modules: tuple[str, ...] = ("all-linear",)
    """Modules that get an adapter: `all-linear` (every linear layer but the LM head) or module names."""
    lora_sync: Literal["auto", "merged", "adapter"] = "auto"
    """How a PEFT policy reaches vLLM. auto: adapter-only when the server runs --enable-lora (runtime LoRA),
    merged weights otherwise; adapter: fail at start unless the server can serve it; merged: always merge."""
    lora_name: str = "grpo"
    """Adapter sync: versions are served as `<lora_name>-v<N>` from `<output_dir>/.vllm_lora/`."""

    # ---- data --------------------------------------------------------------------------------------------------
    dataset: str | None = None
    """Hub dataset name or local json/jsonl/parquet path; `builtin:<task>` for the built-in synthetic tasks.
    None = trl-lib/DeepMath-103K (the spec's quick start), or no dataset at all when an environment_factory is
    given: the environment owns the data (its reset() returns the prompt) and max_steps bounds the run."""
    dataset_split: str = "train"
    """Split to train on."""
    reward_funcs: tuple[str, ...] | None = None
    """Reward functions: registry names (see grpo/rewards.py) or import paths `pkg.module:name`. None = `accuracy`,
    or none at all with an environment_factory (its get_reward() scores the episodes)."""
    tools: tuple[str, ...] = ()
    """Tool functions by import path `pkg.module:name`."""
    environment_factory: str | None = None
    """Environment class by import path `pkg.module:Class`."""
    loop_cls: str | None = None
    """Rollout-loop subclass by import path `pkg.module:Class` (default: grpo.rollout_loop:AsyncRolloutLoop)."""
    chat_template_kwargs: dict[str, str | bool] = field(default_factory=dict)
    """Extra keyword arguments for `apply_chat_template`, e.g. enable_thinking=False."""

    # ---- held-out evaluation (grpo/evaluation.py) ------------------------------------------------------------------
    eval_dataset: str | None = None
    """Held-out prompts (same forms as --dataset; Python: `train.main(..., eval_dataset=ds)`), evaluated every
    eval_steps optimizer steps and at the end, by the rollout worker on the same servers while training goes on:
    greedy and k sampled rollouts per prompt, scored by the reward functions, never trained or counted as consumed."""
    eval_dataset_split: str = "test"
    """Split of a Hub eval_dataset (a local file or builtin: task holds one split)."""
    eval_max_prompts: int | None = None
    """Evaluate only the first N eval prompts (N >= 1; None = all of them)."""
    eval_steps: int = 50
    """Optimizer steps between evaluations (0 = only the final one)."""
    eval_num_generations: int = 4
    """k >= 1: sampled rollouts per eval prompt (eval/pass@k, eval/mean@k), beside one greedy rollout
    (eval/reward)."""

    # ---- generation --------------------------------------------------------------------------------------------
    num_generations: int = 8
    """Rollouts per prompt (the group)."""
    max_completion_length: int = 2048
    """Maximum tokens generated per vLLM request, i.e. per turn (>= 1)."""
    temperature: float = 1.0
    """Sampling temperature (> 0); the trainer scales its logits by the same value. 0 (greedy) is refused: every
    rollout of a group would be the same, and every group dropped for equal rewards."""
    top_p: float = 1.0
    """Nucleus sampling, 0 < top_p <= 1; < 1 needs top_k and a server with --return-sampling-mask
    --enable-scale-out."""
    top_k: int = 0
    """Top-k sampling; 0 = off (the server's -1 is spelled 0 here)."""
    min_p: float | None = None
    """Min-p sampling in [0, 1]; needs top_k. None or 0 = off."""
    repetition_penalty: float = 1.0
    """vLLM's repetition penalty (> 0; 1.0 = none). Must stay 1.0 with score centering (the trainer cannot
    replicate a penalised distribution)."""
    max_tool_calling_iterations: int | None = None
    """Cap on tool-calling turns per rollout; None = until the model stops calling tools; 0 = no tool turn (the
    first completion that calls a tool ends the rollout)."""

    # ---- vLLM server ---------------------------------------------------------------------------------------------
    vllm_server_base_url: str | tuple[str, ...] = "http://localhost:8000"
    """Base URL of the vLLM server, or several (`--vllm-server-base-url http://a:8000 http://b:8000`): each group
    goes whole to one server, every weight version to all of them (docs/design.md, several servers)."""
    vllm_server_timeout: float = 1800.0
    """Seconds for readiness, each generation request (retried on expiry) and each weight-sync call (raises)."""
    sync_keeps_kv_cache: bool = False
    """A weight sync pauses vLLM with mode=keep, and vLLM then clears its prefix cache, the running requests' KV
    included: they re-prefill after the sync, under the new weights. True keeps that cache (clear_cache=false): no
    re-prefill burst after each sync, but requests in flight go on from KV computed with the older weights and
    new requests may reuse prompt blocks cached before the sync (their tokens are still labelled with the
    version at dispatch; importance sampling uses the logprobs that were actually sampled either way)."""
    weight_sync_timeout: float = 600.0
    """Deadline in seconds for each server's part of each weight-sync phase (pause, start, transfer, finish,
    resume), apart from the HTTP timeout; a progress line names the server and the phase every
    `progress_interval_s`. Past it the server is dropped (several servers) or the run waits for it to rejoin
    (docs/reliability.md)."""
    server_rejoin_interval_s: float = 30.0
    """Seconds between probes of a dropped server (health, served model, max_model_len, dtype); one that answers
    gets a cold sync of the current weights, then rollouts again."""
    server_rejoin_wait_s: float = 600.0
    """With no server left, how long the run waits (progress lines) for one to come back before it stops with
    NoServerLeftError / WeightSyncError; 0 = stop at once."""
    weight_transfer: Literal["auto", "nccl", "cpu_file", "ipc"] = "auto"
    """How weights reach the server: NCCL (servers on other GPUs), CUDA IPC (one server on the trainer's own GPU,
    vLLM's `ipc` backend, loopback URL only), or this project's cpu_file plugin backend (CPU servers). auto =
    ipc when the server shares the trainer's GPU, else the server's backend; the choice and why are logged."""
    ipc_bucket_mb: int = 256
    """ipc: MiB gathered and shared per /update_weights call (whole parameter groups; a larger group travels alone).
    Fewer, larger buckets mean fewer round trips and more GPU memory held during a sync (the one-GPU memory plan
    counts 4 buckets)."""

    # ---- loss & advantages (grpo/losses.py, grpo/advantages.py, docs/losses.md) -------------------------------
    loss: LossOptions = field(default_factory=ScoreCenteringOptions)
    """The loss and its options: `loss:NAME --loss.OPTION VALUE` (one subcommand per registered loss; default
    score centering). Each option's meaning is in `train.py loss:NAME --help`."""
    advantage: AdvantageOptions = field(default_factory=GroupStdOptions)
    """The advantage estimator and its options: `advantage:NAME --advantage.OPTION VALUE` (one subcommand per
    registered estimator; default group_std). Python: an options instance or a registered name."""
    advantage_batch_transforms: BatchTransformNames = ()
    """Per-step advantage transforms applied in order to every sample of a step (registered names; --help lists
    them; docs/losses.md)."""
    transform: TransformOptions = field(default_factory=TransformOptions)
    """Options of the batch transforms, by name: `--transform.NAME.OPTION VALUE` (used when NAME is selected in
    --advantage-batch-transforms). Python: an options instance in advantage_batch_transforms stands for its name."""
    drop_equal_reward_groups: bool = True
    """Drop groups whose scorable rewards are all equal (zero advantage; the spec's rule, DAPO's dynamic sampling).
    False trains them too: they add no gradient but count in the token/sequence normalisers."""
    overlong_buffer_length: int = 0
    """DAPO soft overlong punishment: completions longer than max_completion_length - this get a reward penalty
    growing linearly to -overlong_penalty_factor at max_completion_length (0 = off); applied to advantages only."""
    overlong_penalty_factor: float = 1.0
    """Maximum overlong penalty (>= 0; 0 = no penalty)."""

    # ---- batching & optimisation -----------------------------------------------------------------------------------
    token_budget: int | None = None
    """Unique tokens (and loss terms) per packed row; None = the server's max_model_len. Must exceed
    max_completion_length (a sample is at least one prompt token plus its completion; one that does not fit a row
    is dropped)."""
    gradient_accumulation_steps: int = 1
    """Micro-batches per optimizer step (>= 1)."""
    learning_rate: float = 1e-6
    """AdamW learning rate (> 0)."""
    lr_scheduler_type: Literal["constant", "linear", "cosine"] = "constant"
    """Constant by default: the number of steps per epoch is unknown in advance."""
    warmup_steps: int = 0
    """Linear warm-up steps (0 = none)."""
    weight_decay: float = 0.0
    """AdamW weight decay (0 = none)."""
    adam_beta1: float = 0.9
    """AdamW first-moment decay, 0 <= beta1 < 1 (0 = no momentum: each step follows the current gradient only)."""
    adam_beta2: float = 0.999
    """AdamW second-moment decay, 0 < beta2 < 1 (the averaging window of squared gradients, ~1 / (1 - beta2) steps)."""
    adam_epsilon: float = 1e-8
    """AdamW denominator term, 0 < epsilon <= 1 (guards the division where the second moment is ~0)."""
    max_grad_norm: float = 1.0
    """Gradient clipping norm (0 disables clipping)."""
    num_train_epochs: float = 3.0
    """Passes over the prompts (> 0; fractions allowed), counted by prompts consumed; the stop condition unless
    max_steps > 0."""
    max_steps: int = -1
    """> 0: stop after this many optimizer steps instead of by epochs; -1 = stop by num_train_epochs (0 and other
    negatives are refused)."""
    seed: int = 42
    """Seed for model init, data order and sampling seeds (0 <= seed < 2**32)."""

    # ---- async pipeline ----------------------------------------------------------------------------------------------
    max_concurrent_rollouts: int = 512
    """Upper bound on rollouts in flight (also the tool thread-pool size; >= 1)."""
    max_staleness: int = 4
    """Samples more than this many weight versions old are dropped; also bounds how far generation runs ahead.
    0 = on-policy only: a sample must come from the weights being trained."""
    weight_sync_steps: int = 1
    """Optimizer steps between weight syncs to the server (>= 1)."""
    sync_check_steps: int = 10
    """Sync probe (grpo/sync_probe.py): after the first weight sync and every this many syncs, each server's
    log-probs on a fixed 16-token probe are compared with the trainer's own forward; a gap above the dtype floor
    stops the run naming the transfer path and the tensors most likely at fault (a server silently left on old
    weights, docs/failures.md). 0 = never. Costs one short forward and one request per server."""
    sync_check_tolerance: float | None = None
    """Largest |log-prob difference| the sync probe accepts; None = by dtype (float32 5e-3, float16 0.1,
    bfloat16 0.3: `FLOORS` in grpo/sync_probe.py)."""
    rollout_worker_timeout: float = 300.0
    """Seconds without a worker heartbeat after which the trainer declares it hung."""
    score_queue_maxsize: int = 16
    """Completed groups waiting to be scored before generation blocks (>= 1)."""

    # ---- trainer sharding (README "Several trainer nodes") -------------------------------------------------------
    hsdp_replicas: str = "1"
    """`1`: plain FSDP2, every parameter sharded over all ranks. `auto`: HSDP with one replica per node (sharded
    inside a node, replicated across nodes: only the gradient all-reduce crosses nodes). N: N replica groups of
    world/N consecutive ranks. Multi-node runs need output_dir on a filesystem every node shares."""

    # ---- failure handling (README "Failure policy") -------------------------------------------------------------
    progress_interval_s: float = 30.0
    """Seconds between progress lines while waiting on something external (server start, empty sample queue,
    a reward function)."""
    reward_timeout_s: float = 600.0
    """Seconds one reward function (or an environment's get_reward()) may take on one group. Past it, the group is
    dropped like a raising reward function (`reward_errors=drop`: counted in `rollout/dropped_reward_error_count`,
    recorded as reward_timeout) or the run stops naming the function (`raise`). A sync function's thread cannot be
    killed and finishes in the background. 10 minutes by default: far above a math verifier, below "hung"."""
    reward_errors: Literal["raise", "drop"] = "raise"
    """A reward function that raises: `raise` stops the run with its traceback; `drop` drops the group (counted in
    `rollout/dropped_reward_error_count`, warned about, recorded in dropped_prompts.jsonl as reward_error)."""
    max_dropped_groups_in_a_row: int = 256
    """Stop with a named error after this many groups in a row are dropped at scoring with none kept (rewards all
    equal or all None/NaN: GRPO gets no signal). 0 disables the check."""
    max_nonfinite_steps_in_a_row: int = 3
    """A step whose loss or gradient norm is NaN/inf is skipped (no optimizer or scheduler step, no weight sync;
    counted in `train/skipped_nonfinite_count`); this many in a row stop the run with `NonFiniteStepError`
    (0 = never stop for it)."""
    env_reset_retries: int = 1
    """Retries of an environment whose reset() (or constructor) raises, each on a fresh instance; when they fail
    too, the prompt is dropped: counted (`rollout/dropped_env_reset_failed_count`), warned about, and recorded in
    dropped_prompts.jsonl with reason env_reset_failed. 0 = drop at the first failure."""

    # ---- logging & checkpoints -----------------------------------------------------------------------------------
    output_dir: str = "outputs/run"
    """Checkpoints, TensorBoard logs, metrics.jsonl and the reproduction bundle."""
    logging_steps: int = 1
    """Optimizer steps per logging window (>= 1)."""
    save_strategy: Literal["steps", "no"] = "steps"
    """`no` disables checkpoints (a long run then ends with nothing saved but the final model)."""
    save_steps: int = 500
    """Optimizer steps between checkpoints (>= 1; save_strategy=no disables them)."""
    save_total_limit: int | None = None
    """Keep at most this many checkpoints (>= 1); None = keep all of them."""
    resume_from_checkpoint: str | None = None
    """Checkpoint directory, or `latest` for the newest one in output_dir."""
    report_to: tuple[Literal["tensorboard", "wandb", "trackio", "none"], ...] = ("tensorboard",)
    """Experiment trackers (several allowed; `none` = only metrics.jsonl and the console). wandb honours WANDB_MODE
    (offline: no account, `wandb sync` later); trackio logs locally (TRACKIO_DIR; `trackio show`)."""
    run_name: str | None = None
    """Run name shown by the trackers; None = the output_dir's name."""
    project: str = "huggingface"
    """wandb / trackio project (the spec's name and default)."""
    log_completions: bool = False
    """Log a completions table (prompt, completion, reward, advantage, staleness) at each log: printed to the
    console and sent to the trackers."""
    num_completions_to_print: int | None = None
    """Rows of that table (>= 1); None = one group."""

    def __setattr__(self, name: str, value) -> None:
        """Frozen once built (a field set twice is refused; derive a changed config with `dataclasses.replace`).
        Not `frozen=True`: a user's non-frozen `@dataclass` subclass (`--config-cls`) must stay legal."""
        if name in self.__dict__:
            from dataclasses import FrozenInstanceError

            raise FrozenInstanceError(f"AsyncGRPOConfig is frozen: cannot set {name!r}; use "
                                      f"dataclasses.replace(config, {name}=...)")
        object.__setattr__(self, name, value)

    def __post_init__(self) -> None:
        """Check (never change) the plug-in names: a typo from Python fails here, not in the rollout worker after
        the model loaded. `advantage` may stay a registered name; readers resolve it with estimator_options."""
        estimator_options(self.advantage)
        transform_options(self.advantage_batch_transforms, self.transform)

    @property
    def num_sampler_logprobs(self) -> int:
        """Top-k sampler logprobs per token the loss declared it needs (0 = none)."""
        return sampler_needs(self.loss).top_logprobs

    @property
    def vllm_server_urls(self) -> tuple[str, ...]:
        """`vllm_server_base_url` as a tuple of distinct server roots, without trailing slashes or `/v1` (one string =
        one server)."""
        raw = self.vllm_server_base_url
        # the OpenAI-style `.../v1` users paste names the same server: its root carries /health and the dev routes
        urls = tuple(u.rstrip("/").removesuffix("/v1") for u in ((raw,) if isinstance(raw, str) else raw))
        if not urls or len(set(urls)) != len(urls):
            raise ValueError(f"vllm_server_base_url={raw!r}: pass one or more distinct server URLs")
        for url in urls:
            if "://" not in url:
                from grpo.losses import registered_losses

                raise ValueError(
                    f"--vllm-server-base-url {url!r} is not a server URL (http://host:port). If it was meant as the "
                    f"loss subcommand, that loss is unknown (an unknown subcommand after the URLs is read as one more "
                    f"URL); registered: {', '.join('loss:' + name for name in registered_losses())}")
        return urls

    @property
    def lora_alpha_value(self) -> float:
        return 2.0 * self.lora_r if self.lora_alpha is None else self.lora_alpha

    @property
    def uses_truncated_sampling(self) -> bool:
        return self.top_k > 0 or self.top_p < 1.0 or (self.min_p or 0.0) > 0.0

    def epoch_prompts(self, dataset_len: int) -> int:
        """Groups consumed before the epoch-based stop."""
        return math.ceil(self.num_train_epochs * dataset_len)


# ---- field domains (grpo/domains.py): every field's accepted values, checked by `check_config` before anything
# starts. A value outside the ordinary range is accepted only as a `special` whose meaning the field's docstring
# states. A new field needs a line here (tests/test_config_domains.py fails without one).
SECONDS = Num(lo=0, lo_open=True, hi=MAX_WAIT_S)
COUNT = Num(lo=1, integer=True)
TIME_OR_ZERO = Num(lo=0, hi=MAX_WAIT_S, special={0: "at once"})

FIELD_DOMAINS = {
    "model": Text(), "dtype": LITERAL, "trust_remote_code": Flag(),
    "router_aux_loss_coef": Num(lo=0, none="the model config's value", special={0: "disables it"}),
    "attn_backend": LITERAL, "gradient_checkpointing": LITERAL, "bf16": Flag(none="on when CUDA is available"),
    "one_process_fsdp": Flag(), "compile_layers": Flag(none="on when CUDA is available"), "compile_scope": LITERAL,
    "gdn_kernel": LITERAL,
    "lora_r": Num(lo=1, integer=True, special={0: "train the full model"}),
    "lora_alpha": Num(lo=0, lo_open=True, none="2 x lora_r"), "lora_target_modules": Texts(),
    "lora_sync": LITERAL, "lora_name": Text(),
    "dataset": Text(none="the default dataset, or the environment's"), "dataset_split": Text(),
    "reward_funcs": Texts(none="accuracy, or the environment's get_reward()"), "tools": Texts(),
    "environment_factory": Text(none="no environment"), "loop_cls": Text(none="AsyncRolloutLoop"),
    "chat_template_kwargs": Checked(check=chat_kwargs, what="apply_chat_template keyword arguments"),
    "eval_dataset": Text(none="no evaluation"), "eval_dataset_split": Text(),
    "eval_max_prompts": Num(lo=1, integer=True, none="all of them"),
    "eval_steps": Num(lo=1, integer=True, special={0: "only the final evaluation"}),
    "eval_num_generations": COUNT,
    "num_generations": Num(lo=2, integer=True, hint="GRPO needs >= 2 generations per prompt to compute group "
                                                         "advantages: each rollout is scored against its group's mean"),
    "max_completion_length": COUNT,
    "temperature": Num(lo=0, lo_open=True, hint="0 is greedy: the num_generations rollouts of a group would be "
                       "identical and every group dropped for equal rewards; pass e.g. --temperature 1.0"),
    "top_p": Num(lo=0, hi=1, lo_open=True), "top_k": Num(lo=1, integer=True, special={0: "off"}),
    "min_p": Num(lo=0, hi=1, none="off", special={0: "off"}),
    "repetition_penalty": Num(lo=0, lo_open=True),
    "max_tool_calling_iterations": Num(lo=1, integer=True, none="until the model stops calling tools",
                                       special={0: "the first tool call ends the rollout"}),
    "vllm_server_base_url": Checked(check=server_urls, what="one or more distinct http://host:port URLs"),
    "vllm_server_timeout": SECONDS, "sync_keeps_kv_cache": Flag(), "weight_sync_timeout": SECONDS,
    "server_rejoin_interval_s": SECONDS, "server_rejoin_wait_s": TIME_OR_ZERO,
    "weight_transfer": LITERAL, "ipc_bucket_mb": COUNT,
    "loss": Checked(check=loss_options, what="a registered loss's options"),
    "advantage": Checked(check=estimator, what="a registered estimator's options or name"),
    "advantage_batch_transforms": Checked(what="registered transform names (checked in __post_init__)"),
    "transform": Checked(what="the batch transforms' options (checked in __post_init__)"),
    "drop_equal_reward_groups": Flag(),
    "overlong_buffer_length": Num(lo=1, integer=True, special={0: "off"}),
    "overlong_penalty_factor": Num(lo=0, special={0: "no penalty"}),
    "token_budget": Num(lo=2, integer=True, none="the server's max_model_len"),
    "gradient_accumulation_steps": COUNT,
    "learning_rate": Num(lo=0, lo_open=True), "lr_scheduler_type": LITERAL,
    "warmup_steps": Num(lo=1, integer=True, special={0: "no warm-up"}),
    "weight_decay": Num(lo=0, special={0: "no decay"}),
    "adam_beta1": Num(lo=0, hi=1, hi_open=True, special={0: "no momentum"}),
    "adam_beta2": Num(lo=0, hi=1, lo_open=True, hi_open=True), "adam_epsilon": Num(lo=0, hi=1, lo_open=True),
    "max_grad_norm": Num(lo=0, special={0: "no clipping"}),
    "num_train_epochs": Num(lo=0, lo_open=True, hint="0 epochs would consume no prompt"),
    "max_steps": Num(lo=1, integer=True, special={-1: "stop by num_train_epochs"}),
    "seed": Num(lo=0, hi=2**32 - 1, integer=True, special={0: "a seed like any other"}),
    "max_concurrent_rollouts": COUNT,
    "max_staleness": Num(lo=1, integer=True, special={0: "on-policy samples only"},
                         hint="a negative staleness bound marks every sample stale"),
    "weight_sync_steps": COUNT, "sync_check_steps": Num(lo=1, integer=True, special={0: "never"}),
    "sync_check_tolerance": Num(lo=0, lo_open=True, none="by dtype"), "rollout_worker_timeout": SECONDS, "score_queue_maxsize": COUNT,
    "hsdp_replicas": Checked(check=hsdp, what="1, auto or a replica count"),
    "progress_interval_s": SECONDS, "reward_timeout_s": SECONDS, "reward_errors": LITERAL,
    "max_dropped_groups_in_a_row": Num(lo=1, integer=True, special={0: "never stop for it"}),
    "max_nonfinite_steps_in_a_row": Num(lo=1, integer=True, special={0: "never stop for it"}),
    "env_reset_retries": Num(lo=1, integer=True, special={0: "drop at the first failure"}),
    "output_dir": Text(), "logging_steps": COUNT, "save_strategy": LITERAL, "save_steps": COUNT,
    "save_total_limit": Num(lo=1, integer=True, none="keep every checkpoint"),
    "resume_from_checkpoint": Text(none="a fresh start"), "report_to": LITERAL,
    "run_name": Text(none="the output_dir's name"), "project": Text(), "log_completions": Flag(),
    "num_completions_to_print": Num(lo=1, integer=True, none="one group"),
}
AsyncGRPOConfig.FIELD_DOMAINS = FIELD_DOMAINS  # a subclass adds its own fields' in a FIELD_DOMAINS class attribute


AsyncGRPOConfig.CROSS_RULES = (
    CrossRule(("lr_scheduler_type", "max_steps"), schedule_has_an_end),
    CrossRule(("token_budget", "max_completion_length"), budget_fits_a_sample),
    CrossRule(("overlong_buffer_length", "max_completion_length"), buffer_inside_completion),
    CrossRule(("warmup_steps", "max_steps"), warmup_inside_steps),
)

def config_class(argv: list[str]) -> tuple[type, list[str]]:
    """`--config-cls pkg.module:MyConfig` (anywhere in argv) -> the class, and argv without it, its variadic flags
    whose values run into a subcommand moved before that subcommand (grpo/cli_order.py): so
    `--advantage-batch-transforms batch_std loss:dr_grpo` parses as written."""
    from grpo.cli_order import hoist_variadic_flags
    from grpo.imports import resolve_import

    if "--config-cls" not in argv and not any(a.startswith("--config-cls=") for a in argv):
        return AsyncGRPOConfig, hoist_variadic_flags(AsyncGRPOConfig, argv)
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
    return cls, hoist_variadic_flags(cls, rest)

