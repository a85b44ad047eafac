"""Trainer entry point: `torchrun --nproc-per-node 4 train.py --model Qwen/Qwen3.5-2B` (or plain `python`).

Recipe, top to bottom: parse the config (`__main__`) -> `build` (checks, inputs, model and optimizer, cold weight
sync, the rollout worker on rank 0) -> loop: pull samples and pack them as prefix tries (one row per rank),
forward/backward with tree attention (`train_step`), push weights to vLLM every `weight_sync_steps`, log,
checkpoint (`after_step`) -> `wind_down`. The builders live in `grpo/` (`grpo/inputs.py`, `grpo/server_facts.py`,
`grpo/policy.py`, `grpo/step.py`, `grpo/rollout_worker.py`). A fork changes the loss through the loss registry
(one file, docs/losses.md "Adding a loss in a fork"), not here: that path is what the loss trace and the invariant
tests run.

Python API: `train.main(config, reward_funcs=[fn], train_dataset=ds, tools=[...], environment_factory=Env,
loop_cls=MyLoop, peft_config=LoraConfig(...), eval_dataset=held_out)`; every argument left None is taken from the
config (registry names, `pkg.module:name`, the `lora_*` fields, `eval_dataset`).
"""

from __future__ import annotations

import functools
import logging
import time
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from grpo.config import AsyncGRPOConfig, config_class

log = logging.getLogger("train")


@dataclass
class LogWindow:
    """What the next log row aggregates: the steps' metrics and the rollout worker's metrics since the last row."""

    steps: list = field(default_factory=list)
    rollout: list = field(default_factory=list)


@dataclass
class Run:
    """What `build` makes for one run, and the loop's counters."""

    config: AsyncGRPOConfig
    info: Any  # grpo.distributed.DistInfo
    tokenizer: Any
    model: Any  # the Hugging Face (or PEFT) model: saved, synced
    policy: Any  # the packed, sharded module that trains (grpo/policy.py)
    optimizer: Any
    scheduler: Any
    autocast: Any
    sync: Any  # grpo.weight_sync.WeightSync
    logger: Any  # grpo.metrics.MetricsLogger
    batcher: Any  # grpo.batcher.TokenBudgetBatcher
    state: dict  # the resume state (grpo/checkpoint.py `start_state`)
    eval_dataset: Any = None
    worker: Any = None  # rank 0: grpo.rollout_worker.RolloutWorker
    stop_groups: int | None = None  # epoch-based runs: the prompt count that ends the epochs
    version: int = 0  # the weight version the servers hold
    step: int = 0
    saved_step: int = 0
    num_tokens: int = 0
    window: LogWindow = field(default_factory=LogWindow)
    nonfinite_in_a_row: int = 0
    sync_due: bool = False  # a weight sync fell due on a step that skipped its optimizer: the next one that trains
    step_end: float = 0.0  # perf_counter() when the last step was concluded
    lock: Any = None  # rank 0: the output_dir's lock file (grpo/run_lock.py), released at the end

    @cached_property
    def loss_fn(self):
        from grpo.losses import loss_function

        return loss_function(self.config.loss)

    @cached_property
    def transforms(self) -> list:
        from grpo.advantages import batch_transforms

        return batch_transforms(self.config.advantage_batch_transforms)

    @cached_property
    def peak(self) -> float | None:
        """The device's peak FLOP/s (MFU), None when unknown."""
        from grpo.flops import device_peak_flops

        return device_peak_flops(self.info.device)


@dataclass
class WorkerReport:
    """Rank 0's booking of one step with the rollout worker (`book`): the worker's metrics and drops up to then,
    i.e. from planning this step's samples. They go on this step's log row and ledger line."""

    metrics: list = field(default_factory=list)
    drops: list = field(default_factory=list)


@dataclass
class PendingStep:
    """An optimizer step queued on the device and not yet concluded (read back, synced, logged, saved)."""

    plans: list  # grpo.step_plan.StepPlan per micro-batch
    micro: list  # the micro-batch metrics, device tensors until `finish_step` reads them
    queued: Any  # grpo.step.QueuedOptimizerStep
    started: float  # perf_counter() when its planning began
    report: WorkerReport | None = None  # None until `book`: a step queued ahead is booked at once, others at the end

    @property
    def samples(self) -> list:
        """Every rank's trained samples (a padding row's dummies have group_id < 0)."""
        return [s for p in self.plans for row in p.rows for s in row if s.group_id >= 0]


@dataclass
class StepOutcome:
    """What a concluded step read back."""

    micro: list  # the micro-batch metrics as floats
    grad_norm: Any
    optimizer_s: float
    stepped: bool  # False: a non-finite loss or gradient norm skipped the optimizer (grpo/step.py)


def build(config: AsyncGRPOConfig, reward_funcs, train_dataset, tools, environment_factory, loop_cls, peft_config,
          eval_dataset) -> Run:
    """Checks and inputs (before any model loads), the process group, the server facts, the policy, the resume
    state, the cold weight sync (the first rollouts already come from this policy), the rollout worker."""
    import torch

    from grpo import checkpoint as ckpt
    from grpo import run_lock
    from grpo.batcher import TokenBudgetBatcher
    from grpo.distributed import broadcast_object, hsdp_replicas, init_distributed
    from grpo.inputs import check_run_config, check_tokenizer, resolve_eval_dataset, resolve_inputs
    from grpo.metrics import MetricsLogger
    from grpo.model import load_tokenizer
    from grpo.model_check import check_logprob_path
    from grpo.policy import build_policy
    from grpo.server_facts import build_weight_sync, server_facts
    from grpo.sync_probe import SyncProbe
    from grpo.trackers import build_trackers

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    check_run_config(config)  # the loss, the advantage options, the trackers: before any model loads
    inputs = resolve_inputs(config, reward_funcs, train_dataset, tools, environment_factory, loop_cls)
    eval_dataset = resolve_eval_dataset(config, eval_dataset, inputs.environment_factory)
    tokenizer = load_tokenizer(config.model, config.trust_remote_code)
    check_tokenizer(tokenizer, config.model)  # before any server wait or model load
    info = init_distributed(config.vllm_server_timeout)
    hsdp_replicas(config.hsdp_replicas, info)  # a bad value fails here, before the server is contacted
    ckpt.check_shared_output_dir(config.output_dir)  # rank 0 writes what every rank reads back on resume
    lock = run_lock.acquire(config.output_dir) if info.is_main else None  # one live run per output_dir
    torch.manual_seed(config.seed)
    facts = broadcast_object(server_facts(config) if info.is_main else None, info)
    budget = config.token_budget or facts["max_model_len"]
    model, policy, optimizer, scheduler, autocast = build_policy(config, info, budget, peft_config)
    check_logprob_path(model, policy)  # trainer's log-probs == the model's own forward, or stop (grpo/model_check.py)
    state = ckpt.start_state(config.resume_from_checkpoint, config.output_dir, model, optimizer, scheduler,
                             log_on_this_rank=info.is_main)
    sync, adapter = build_weight_sync(config, facts, model)
    sync.probe = SyncProbe.from_config(config)  # server == trainer after syncs (grpo/sync_probe.py)
    version = state["model_version"] + 1
    sync.sync(model, version)  # cold sync
    logger = MetricsLogger(config.output_dir, enabled=info.is_main,
                           total_steps=config.max_steps if config.max_steps > 0 else None,
                           trackers=build_trackers(config) if info.is_main else [])
    run = Run(config=config, info=info, tokenizer=tokenizer, model=model, policy=policy, optimizer=optimizer,
              scheduler=scheduler, autocast=autocast, sync=sync, logger=logger,
              batcher=TokenBudgetBatcher(budget, info.world_size), state=state, eval_dataset=eval_dataset,
              version=version, step=state["step"], saved_step=state["step"], lock=lock)
    if info.is_main:
        start_worker(run, inputs, facts["served_model"], adapter and adapter.name, budget)
    return run


def start_worker(run: Run, inputs, served_model: str, lora_name: str | None, budget: int) -> None:
    """Rank 0: the reproduction bundle, then the rollout worker, started where the (resumed) run stands."""
    from grpo.ledger import resume_skips
    from grpo.repro import write_repro_bundle
    from grpo.rollout_worker import RolloutWorker, ServedModel, WorkerStart
    from grpo.shared_state import LoopOptions

    config, state, sync, model = run.config, run.state, run.sync, run.model
    write_repro_bundle(config.output_dir, config, run.info.world_size)
    options = LoopOptions(tools=tuple(inputs.tools), environment_factory=inputs.environment_factory,
                          lora_name=lora_name, dataset_start_index=state["prompt_index"],
                          skip_positions=frozenset(resume_skips(state)), eval_dataset=run.eval_dataset)
    worker = RolloutWorker(config, inputs.dataset, inputs.reward_funcs, options, loop_cls=inputs.loop_cls,
                           served=ServedModel(name=served_model),
                           start=WorkerStart(model_version=run.version, servers_alive=tuple(sync.alive_flags),
                                             carried=tuple(state.get("carried", []))))
    # until the first step says what one consumes: a full step of token budgets on every rank
    worker.set_allowance_from_step(budget * run.info.world_size * config.gradient_accumulation_steps)
    worker.start()
    sync.alive_flags = worker.servers_alive  # a server either side finds dead leaves both (several servers)
    worker.on_idle = lambda: sync.rejoin_alone(model, worker.model_version)  # no server alive: bring one back
    run.worker = worker
    if config.max_steps <= 0:
        run.stop_groups = config.epoch_prompts(len(inputs.dataset)) - state["prompt_index"]


def queue_step(run: Run, plans: list, number: int, started: float, before_optimizer=None) -> PendingStep:
    """Queue optimizer step `number` on the device without waiting for it: forward/backward of every planned
    micro-batch, then the optimizer step. `before_optimizer` runs between the two: the previous step's `conclude`,
    whose verdict and learning-rate step this optimizer needs."""
    from grpo.advantages import apply_batch_transforms
    from grpo.step import queue_optimizer_step, train_micro_batch

    cfg, info = run.config, run.info
    # the per-step advantage hook: every sample of the step (all ranks' rows), the same on every rank
    apply_batch_transforms(run.transforms, [s for p in plans for row in p.rows for s in row], number)
    # the last step of the epochs may close fewer micro-batches: they are trained, normalised by their count
    micro = [train_micro_batch(run.policy, p.rows[info.rank], p, run.loss_fn, cfg.loss, info.world_size, len(plans),
                               run.autocast, cfg.max_completion_length) for p in plans]
    if before_optimizer is not None:
        before_optimizer()
    queued = queue_optimizer_step(run.policy, run.optimizer, cfg.max_grad_norm, [m["loss"] for m in micro])
    return PendingStep(plans, micro, queued, started)


def finish_step(run: Run, step: PendingStep) -> StepOutcome:
    """Wait for a queued step and read it back. A non-finite loss or gradient norm skipped its optimizer step
    (grpo/step.py); too many in a row raise."""
    from grpo.step import check_nonfinite, finish_optimizer_step
    from grpo.step_metrics import resolve_metrics

    grad_norm, optimizer_s, stepped = finish_optimizer_step(step.queued, run.scheduler)
    micro = resolve_metrics(step.micro)
    run.step += 1
    run.nonfinite_in_a_row = check_nonfinite(stepped, run.step, micro, float(grad_norm), run.nonfinite_in_a_row,
                                             run.config.max_nonfinite_steps_in_a_row)
    return StepOutcome(micro, grad_norm, optimizer_s, stepped)


def ends_in_barrier(run: Run, number: int) -> bool:
    """Whether step `number` must finish before the next one is planned: a weight sync is due (the next step's
    samples are checked for staleness against the synced version), a checkpoint, an evaluation, or the last step.
    Between barriers the next step's planning, packing and forward are queued while this one's backward and
    optimizer still run on the device, and this one is concluded (read back, logged) after that."""
    from grpo.evaluation import eval_due

    cfg = run.config
    return (run.sync_due or number % cfg.weight_sync_steps == 0
            or (cfg.save_strategy == "steps" and number % cfg.save_steps == 0)
            or (run.eval_dataset is not None and eval_due(number, cfg.eval_steps))
            or 0 < cfg.max_steps <= number)


def book(run: Run, step: PendingStep) -> WorkerReport:
    """Once per step: rank 0 tells the worker what the step consumed (its run-ahead allowance, the trained groups)
    and takes the worker's metrics and drops so far, which are this step's; what the worker reports after this
    (planning the next step) belongs to the next one. A step queued ahead is booked as soon as it is queued (the
    worker may be waiting for that allowance to generate the next step's samples), any other when it concludes."""
    if step.report is None:
        step.report = WorkerReport()
        if run.info.is_main:
            run.worker.set_allowance_from_step(sum(len(s) for s in step.samples))
            run.worker.mark_trained(step.samples)
            step.report = WorkerReport(run.worker.drain_metrics(), run.worker.drain_drops())
    return step.report


def conclude(run: Run, step: PendingStep) -> None:
    """Finish a queued step and do what follows it (`after_step`)."""
    after_step(run, step, finish_step(run, step))


def after_step(run: Run, step: PendingStep, outcome: StepOutcome) -> None:
    """The weight sync when due, the step booked with the worker, the step's metrics, a log, a checkpoint."""
    from grpo.evaluation import eval_due
    from grpo.ledger import record_prompts
    from grpo.step_metrics import log_window, step_summary
    from grpo.trackers import COMPLETION_COLUMNS, completion_rows

    cfg, info, worker = run.config, run.info, run.worker
    run.sync_due = run.sync_due or run.step % cfg.weight_sync_steps == 0
    sync_metrics, trained_version = {}, run.version
    if run.sync_due and outcome.stepped:  # a skipped step's sync waits for the next step that trains
        run.version += 1
        sync_metrics = run.sync.sync(run.model, run.version)
        run.sync_due = False
    samples = step.samples
    if info.is_main:
        worker.set_model_version(run.version)
    report = book(run, step)
    run.window.rollout += report.metrics
    if info.is_main:
        if run.eval_dataset is not None and eval_due(run.step, cfg.eval_steps):
            worker.request_eval(run.version)  # run by the worker at this version; training goes on
        record_prompts(cfg.output_dir, run.step, samples, run.state, report.drops)
    # a queued step's wall time starts where the previous one ended (its planning overlapped that one's backward)
    now = time.perf_counter()
    step_metrics = step_summary(step.plans, samples, outcome.micro, info, now - max(step.started, run.step_end),
                                outcome.optimizer_s, sync_metrics, run.model.config, run.peak)
    run.step_end = now
    run.num_tokens += step_metrics["batch/forwarded_tokens_per_step"]
    step_metrics |= {"num_tokens": run.num_tokens, "grad_norm": float(outcome.grad_norm),
                     "perf/rollout_wait_s": worker.take_wait_s() if info.is_main else 0.0,
                     "train/skipped_nonfinite_count": float(not outcome.stepped),
                     "learning_rate": run.scheduler.get_last_lr()[0]}
    run.window.steps.append(step_metrics)
    if run.step % cfg.logging_steps == 0:
        log_window(run.logger, run.step, run.window.steps, run.window.rollout)
        run.window = LogWindow()
        if cfg.log_completions:
            run.logger.log_table(run.step, "completions", COMPLETION_COLUMNS, completion_rows(
                samples, run.tokenizer, trained_version, run.step, cfg.num_completions_to_print))
    if cfg.save_strategy == "steps" and run.step % cfg.save_steps == 0:
        save(run, run.step)


def drain_rollout_metrics(run: Run) -> list:
    """The worker's metrics for the next log row: those booked with the steps of the window, then the ones since."""
    kept, run.window.rollout = run.window.rollout, []
    return kept + (run.worker.drain_metrics() if run.worker is not None else [])


def save(run: Run, at_step: int, rollout_state: dict | None = None) -> None:
    from grpo import checkpoint as ckpt

    if rollout_state is None:  # + the untrained rest of partial groups (read while the worker runs)
        rollout_state = run.worker.state_dict(run.batcher.pending()) if run.info.is_main else {}
    ckpt.save_checkpoint(run.config.output_dir, at_step, run.model, run.tokenizer, run.optimizer, run.scheduler,
                         rollout_state, run.config.save_total_limit)
    run.saved_step = at_step


def wind_down(run: Run) -> dict | None:
    """After the last step, while the worker still runs: the last log window, the final evaluation, the last
    drops booked; returns the rollout state of the final checkpoint (None when the last step is saved)."""
    from grpo.ledger import no_step_message, record_prompts
    from grpo.step_metrics import log_window

    cfg, info, worker, version = run.config, run.info, run.worker, run.version
    if run.window.steps:  # the last, partial logging window
        log_window(run.logger, run.step, run.window.steps, drain_rollout_metrics(run))
    if run.eval_dataset is not None and info.is_main and run.step > run.state["step"]:  # waited for
        worker.request_eval(version)
        if not worker.wait_eval(version, cfg.vllm_server_timeout):
            log.warning("the final evaluation (weight version %d) did not finish within %.0f s", version,
                        cfg.vllm_server_timeout)
        log_window(run.logger, run.step, [], drain_rollout_metrics(run))
    if info.is_main:  # drops booked after the last step (e.g. while the epochs ran out)
        record_prompts(cfg.output_dir, run.step, None, run.state, worker.drain_drops())
    if run.step == run.state["step"]:
        raise RuntimeError(no_step_message(worker))
    return worker.state_dict(run.batcher.pending()) if info.is_main and run.step > run.saved_step else None


def train_loop(run: Run) -> None:
    """Plan, queue and conclude steps until `max_steps` or the end of the epochs. A step that `ends_in_barrier` is
    concluded at once; any other stays pending while the next step is planned and its forward/backward queued (the
    host works ahead of the device), and is concluded just before that step's optimizer."""
    from grpo.step_plan import plan_step

    config, pending = run.config, None  # pending: a PendingStep whose device work may still run
    while config.max_steps <= 0 or run.step + (pending is not None) < config.max_steps:
        started = time.perf_counter()
        plans = plan_step(run.worker, run.batcher, run.stop_groups, config.gradient_accumulation_steps, run.info)
        if not plans:
            break
        number = run.step + 1 + (pending is not None)
        step = queue_step(run, plans, number, started, pending and functools.partial(conclude, run, pending))
        pending = None  # concluded inside queue_step, before this step's optimizer
        if ends_in_barrier(run, number):
            conclude(run, step)
        else:
            book(run, step)
            pending = step
    if pending is not None:
        conclude(run, pending)


def main(config: AsyncGRPOConfig, reward_funcs=None, train_dataset=None, tools=None, environment_factory=None,
         loop_cls=None, peft_config=None, eval_dataset=None) -> dict:
    """Build, train until `max_steps` or the end of the epochs, save the final model; {"step", "model_version",
    "output_dir"}."""
    from grpo import run_lock
    from grpo.distributed import barrier

    run = build(config, reward_funcs, train_dataset, tools, environment_factory, loop_cls, peft_config, eval_dataset)
    try:
        train_loop(run)
        final_state = wind_down(run)
    finally:
        if run.worker is not None:
            run.worker.stop()
        run.logger.close()
    if run.step > run.saved_step:  # the final model is always saved, also with save_strategy="no"
        save(run, run.step, final_state)
    barrier(run.info)
    run.sync.close()
    run_lock.release(run.lock)
    return {"step": run.step, "model_version": run.version, "output_dir": config.output_dir}


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
