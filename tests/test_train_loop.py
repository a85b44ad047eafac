"""train.py's loop (`train_loop`): between barriers (a weight sync, a checkpoint, an evaluation, the last step) the
next step is planned and its forward/backward queued before the previous one is concluded. That must change nothing
but timing: the same weights, losses, gradient norms and learning rates as concluding every step at once, each sync
sees the weights of its own step, and the worker hears what a step consumed before the next step is planned (it
may be waiting for that allowance to generate the next step's samples)."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from grpo.config import AsyncGRPOConfig
from test_train import random_samples

STEPS = 5


class RecordingWorker:
    """The rank-0 worker's trainer-facing calls, recorded in order with the planning calls."""

    def __init__(self, events: list):
        self.events = events
        self.metrics: list = []  # what planning a step reports (train.py logs it with that step's row)
        self.drops: list = []  # groups dropped while planning a step (booked on that step's ledger line)

    def set_allowance_from_step(self, tokens):
        self.events.append(("allowance", tokens))

    def set_model_version(self, version):
        self.events.append(("version", version))

    def mark_trained(self, samples):
        self.events.append(("trained", samples[0].model_version))  # the step number, stamped by the planner

    def drain_drops(self):
        drained, self.drops = self.drops, []
        return drained

    def drain_metrics(self):
        drained, self.metrics = self.metrics, []
        return drained

    def take_wait_s(self):
        return 0.0


class RecordingSync:
    """Each sync's step and a copy of the weights it pushed."""

    def __init__(self, run_ref: list):
        self.run_ref, self.pushed = run_ref, []

    def sync(self, model, version):
        run = self.run_ref[0]
        self.pushed.append((run.step, version, {k: v.detach().clone() for k, v in model.state_dict().items()}))
        return {"perf/weight_sync_s": 0.0}


def _plans(steps: int) -> list:
    from grpo.step_plan import StepPlan

    plans = []
    for step in range(1, steps + 1):
        samples = [dataclasses.replace(s, model_version=step) for s in random_samples(step)]
        plans.append([StepPlan([samples], sum(s.num_trained for s in samples))])
    return plans


def _run_loop(tiny: str, tmp_path, weight_sync_steps: int, monkeypatch):
    import train
    from grpo import step_plan
    from grpo.distributed import init_distributed
    from grpo.losses import get_loss
    from grpo.metrics import MetricsLogger
    from grpo.policy import build_policy

    torch.manual_seed(0)
    config = AsyncGRPOConfig(model=tiny, output_dir=str(tmp_path), max_steps=STEPS, learning_rate=1e-2,
                             weight_sync_steps=weight_sync_steps, save_strategy="no", lr_scheduler_type="linear",
                             warmup_steps=2, logging_steps=1,
                             loss=get_loss("clipped_surrogate")[1])
    info = init_distributed()
    model, policy, optimizer, scheduler, autocast = build_policy(config, info, 512)
    events: list = []
    pending_plans = _plans(STEPS)

    def plan_step(worker, batcher, stop_groups, grad_accum, info):
        step = len(pending_plans) and pending_plans[0][0].rows[0][0].model_version
        events.append(("plan", step))
        worker.metrics.append(("sample/planned_for_step", float(step)))
        worker.drops.append((1000 + step, "stale"))
        return pending_plans.pop(0) if pending_plans else []

    monkeypatch.setattr(step_plan, "plan_step", plan_step)
    conclude = train.conclude

    def recorded_conclude(run, pending):
        conclude(run, pending)
        events.append(("concluded", pending.plans[0].rows[0][0].model_version))

    monkeypatch.setattr(train, "conclude", recorded_conclude)
    run_ref: list = []
    run = train.Run(config=config, info=info, tokenizer=None, model=model, policy=policy, optimizer=optimizer,
                    scheduler=scheduler, autocast=autocast, sync=RecordingSync(run_ref),
                    logger=MetricsLogger(tmp_path, trackers=[], console=False), batcher=None,
                    state={"step": 0, "run_id": "t", "prompt_index": 0}, worker=RecordingWorker(events))
    run_ref.append(run)
    train.train_loop(run)
    run.logger.close()
    logged = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return run, events, logged, weights


@pytest.mark.parametrize("weight_sync_steps", [2, 3])
def test_queued_steps_train_exactly_like_steps_concluded_at_once(tiny_qwen3, tmp_path, monkeypatch,
                                                                 weight_sync_steps):
    every, every_events, every_logged, every_weights = _run_loop(str(tiny_qwen3), tmp_path / "every", 1,
                                                                 monkeypatch)
    queued, events, logged, weights = _run_loop(str(tiny_qwen3), tmp_path / "queued", weight_sync_steps,
                                                monkeypatch)
    assert every.step == queued.step == STEPS
    # the loop did run ahead: every step before a barrier was concluded after the next one was planned
    for k in range(1, STEPS):
        ahead = events.index(("plan", k + 1)) < events.index(("concluded", k))
        assert ahead == (k % weight_sync_steps != 0), (k, events)
    assert all(every_events.index(("concluded", k)) < every_events.index(("plan", k + 1)) for k in range(1, STEPS))
    assert [row["step"] for row in logged] == [row["step"] for row in every_logged] == list(range(1, STEPS + 1))
    # the worker's metrics from planning a step are logged with that step, not with the one before it
    assert [row["sample/planned_for_step"] for row in logged] == [float(s) for s in range(1, STEPS + 1)]
    dropped = [json.loads(line) for line in (tmp_path / "queued" / "dropped_prompts.jsonl").read_text().splitlines()]
    assert [(r["step"], r["prompts"]) for r in dropped] == [(s, [[1000 + s, "stale"]]) for s in range(1, STEPS + 1)]
    for ours, ref in zip(logged, every_logged):
        for key in ("loss", "grad_norm", "learning_rate", "batch/trained_tokens_per_step"):
            assert ours[key] == ref[key], (ours["step"], key)
    for name, w in every_weights.items():
        assert torch.equal(weights[name], w), name
    # syncs at their own steps only, each with that step's weights (the every-step run synced after each step)
    synced_steps = [step for step, _, _ in queued.sync.pushed]
    assert synced_steps == [s for s in range(1, STEPS + 1) if s % weight_sync_steps == 0]
    reference = {step: pushed for step, _, pushed in every.sync.pushed}
    for step, version, pushed in queued.sync.pushed:
        assert version == synced_steps.index(step) + 1
        for name, w in pushed.items():
            assert torch.equal(w, reference[step][name]), (step, name)
    # the worker is told what step k consumed before step k + 1 is planned
    for k in range(1, STEPS):
        assert events.index(("trained", k)) < events.index(("plan", k + 1)), events
    assert sum(1 for e in events if e[0] == "trained") == STEPS
