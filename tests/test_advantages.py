"""grpo/advantages.py and the drop rule: invariants over every registered estimator, each estimator against its
textbook definition computed independently, the batch transform hook, and the one-file plug-in path.

A fork's estimator gets the invariants too: `GRPO_PLUGIN_MODULES=my_pkg.my_estimators pytest tests/test_advantages.py`.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from grpo.advantages import (ESTIMATORS, apply_batch_transforms, batch_transforms, check_advantage_config,
                             estimate_advantages, estimator_options, overlong_penalty, registered_batch_transforms,
                             registered_estimators)
from grpo.samples import TrainingSample
from grpo.scoring import is_kept

REPO = Path(__file__).resolve().parents[1]
ALL_ESTIMATORS = sorted(registered_estimators())
GROUPS = [np.array([1.0, 0.0, 0.5, 0.25, 0.0, 1.0]), np.array([0.0, 0.0, 0.0, 1.0]), np.array([3.0, -1.0, 2.0])]


# the invariants over every registered estimator and transform: tests/test_advantage_kit.py

REWARDS = np.array([1.0, 0.0, 0.5, np.nan, 0.25])  # one unscorable rollout


def _scored():
    return REWARDS[~np.isnan(REWARDS)]


def test_registry_has_the_families():
    assert {"group_std", "no_std", "rloo", "pass_at_k"} <= set(ESTIMATORS)
    assert "batch_std" in registered_batch_transforms()


def test_group_std_is_the_standardised_reward_with_population_std():
    r = _scored()
    want = (r - r.mean()) / (np.sqrt(((r - r.mean()) ** 2).mean()) + 1e-8)
    got = estimate_advantages("group_std", REWARDS)
    np.testing.assert_allclose(got[~np.isnan(REWARDS)], want)
    assert got[3] == 0.0


def test_no_std_centres_only():
    got = estimate_advantages("no_std", REWARDS)
    np.testing.assert_allclose(got[[0, 1, 2, 4]], _scored() - _scored().mean())
    assert got[3] == 0.0


def test_rloo_subtracts_the_mean_of_the_others():
    r = _scored()
    leave_one_out = np.array([r[i] - np.delete(r, i).mean() for i in range(len(r))])
    np.testing.assert_allclose(estimate_advantages("rloo", REWARDS)[[0, 1, 2, 4]], leave_one_out)
    np.testing.assert_array_equal(estimate_advantages("rloo", np.array([0.7, np.nan])), [0.0, 0.0])


def test_overlong_penalty_is_dapo_soft_punishment():
    # max 12, buffer 4: no penalty up to 8, then -(L - 8) / 4, -1 at 12 and beyond
    np.testing.assert_allclose(overlong_penalty(np.array([5, 8, 9, 11, 12, 20]), 12, 4, 1.0),
                               [0, 0, -0.25, -0.75, -1.0, -1.0])
    shaped = estimate_advantages("no_std", np.array([1.0, 1.0]), np.array([6, 12]), 12, 4, 0.5)
    np.testing.assert_allclose(shaped, [0.25, -0.25])  # rewards 1.0 and 0.5 after shaping
    # buffer 1: only the completion at max_length is penalised, by the whole factor
    np.testing.assert_allclose(estimate_advantages("no_std", np.array([1.0, 1.0]), np.array([11, 12]), 12, 1, 0.5),
                               [0.25, -0.25])


def test_unknown_estimator_names_the_choices():
    with pytest.raises(ValueError, match="group_std"):
        estimate_advantages("ppo", REWARDS)


def _best_of_k_reference(rewards, k):
    """pass@k advantages by brute force: every k-subset's best reward, standardised over subsets, averaged over the
    subsets holding each rollout."""
    subsets = list(itertools.combinations(range(len(rewards)), k))
    best = np.array([max(rewards[i] for i in s) for s in subsets])
    if best.std() == 0:  # every subset has the same best reward: no signal
        return np.zeros(len(rewards))
    z = (best - best.mean()) / best.std()
    return np.array([np.mean([z[j] for j, s in enumerate(subsets) if i in s]) for i in range(len(rewards))])


@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_pass_at_k_is_the_standardised_best_of_k_over_subsets(k):
    from grpo.pass_at_k import PassAtKOptions

    for rewards in (np.array([1.0, 0.0, 0.0, 1.0, 0.0, 0.0]), np.array([0.3, 0.9, 0.1, 0.5, 0.9])):
        np.testing.assert_allclose(estimate_advantages(PassAtKOptions(k=k), rewards),
                                   _best_of_k_reference(rewards, k), rtol=1e-9)


def test_pass_at_k_binary_closed_form_of_the_paper():
    # arXiv 2508.10751: N = 8, 2 correct, k = 4: R = 1 - C(6,4)/C(8,4) = 55/70; sigma = sqrt(R (1 - R));
    # A_pos = (1 - R) / sigma; A_neg = (1 - R - C(5,3)/C(7,3)) / sigma
    from grpo.pass_at_k import PassAtKOptions

    r = 1 - 15 / 70
    sigma = np.sqrt(r * (1 - r))
    got = estimate_advantages(PassAtKOptions(k=4), np.array([1.0, 0, 0, 1, 0, 0, 0, 0]))
    np.testing.assert_allclose(got[[0, 3]], (1 - r) / sigma)
    np.testing.assert_allclose(got[[1, 2, 4, 5, 6, 7]], (1 - r - 10 / 35) / sigma)
    np.testing.assert_allclose(estimate_advantages(PassAtKOptions(k=1), GROUPS[0]),
                               estimate_advantages("group_std", GROUPS[0]), rtol=1e-6)


def test_options_are_checked_at_start():
    from grpo.config import AsyncGRPOConfig
    from grpo.pass_at_k import PassAtKOptions

    with pytest.raises(ValueError, match="num-generations"):
        check_advantage_config(AsyncGRPOConfig(num_generations=4, advantage=PassAtKOptions(k=5)))
    with pytest.raises(ValueError, match="unknown advantage estimator 'rlo'.*rloo"):
        AsyncGRPOConfig(advantage="rlo")  # a Python typo fails at construction
    with pytest.raises(ValueError, match="batch_std"):
        AsyncGRPOConfig(advantage_batch_transforms=("batch_sdt",))
    assert estimator_options(AsyncGRPOConfig(advantage="pass_at_k").advantage) == PassAtKOptions()


def _sample(group_id, rollout_id, advantage):
    return TrainingSample(input_ids=[1, 2], completion_mask=[0, 1], sampler_logprobs=[0.0, -1.0],
                          advantage=advantage, group_id=group_id, model_version=1, rollout_id=rollout_id, reward=0.0)


def test_batch_std_divides_by_the_std_over_the_steps_rollouts():
    # rollouts: (0,a) 2.0 with two samples (multi-turn), (0,b) -2.0, (1,c) 1.0, (1,d) -1.0; a padding sample
    samples = [_sample(0, "a", 2.0), _sample(0, "a", 2.0), _sample(0, "b", -2.0), _sample(1, "c", 1.0),
               _sample(1, "d", -1.0), _sample(-1, "pad", 0.0)]
    seen = apply_batch_transforms(batch_transforms(("batch_std",)), samples, step=1)
    assert seen == 4
    std = np.array([2.0, -2.0, 1.0, -1.0]).std()  # once per rollout, not per sample
    np.testing.assert_allclose([s.advantage for s in samples], [2 / std, 2 / std, -2 / std, 1 / std, -1 / std, 0.0],
                               rtol=1e-6)


def test_a_bad_batch_transform_is_named():
    with pytest.raises(ValueError, match="must return"):
        apply_batch_transforms([lambda batch: batch.advantages[:1]], [_sample(0, "a", 1.0), _sample(0, "b", 0.0)], 1)


PLUGIN = textwrap.dedent('''
    """A fork's estimator, batch transform and rollout loop, one file, no core edit."""
    from dataclasses import dataclass
    from grpo.advantage_kit import EstimatorCase, register_estimator_case
    from grpo.advantages import register_batch_transform, register_estimator
    from grpo.rollout_loop import AsyncRolloutLoop

    @dataclass(frozen=True)
    class CappedOptions:
        cap: float = 1.0
        """Largest advantage magnitude."""

    @register_estimator("fork_capped", CappedOptions())
    def fork_capped(group, opts):
        """Centred rewards clipped to +-cap."""
        return (group.rewards - group.rewards.mean()).clip(-opts.cap, opts.cap)

    # rewards (4, 0, 0, 0): centred (3, -1, -1, -1), cap 2 clips the first
    register_estimator_case("fork_capped", EstimatorCase(rewards=(4.0, 0, 0, 0), want=(2.0, -1, -1, -1),
                                                         overrides={"cap": 2.0}))

    @register_batch_transform("fork_halve")
    class Halve:
        """Halve every advantage (a class: one instance per run)."""
        def __call__(self, batch):
            return batch.advantages / 2

    class ForkLoop(AsyncRolloutLoop):
        """A loop in the same plug-in file."""
''')


@pytest.mark.parametrize("env_var", ["GRPO_PLUGIN_MODULES", "GRPO_LOSS_MODULES"])
def test_a_one_file_plugin_reaches_the_cli_and_the_kit(tmp_path, env_var):
    (tmp_path / "fork_advantages.py").write_text(PLUGIN)
    env = os.environ | {env_var: "fork_advantages", "PYTHONPATH": os.pathsep.join([str(tmp_path), str(REPO)])}
    help_text = subprocess.run([sys.executable, str(REPO / "train.py"), "--help"], env=env, capture_output=True,
                               text=True, timeout=120).stdout
    assert "advantage:fork-capped" in help_text and "Centred rewards clipped" in help_text
    assert "fork_halve: Halve" in help_text
    sub = subprocess.run([sys.executable, str(REPO / "train.py"), "advantage:fork-capped", "--help"], env=env,
                         capture_output=True, text=True, timeout=120).stdout
    assert "--advantage.cap" in sub and "Largest advantage magnitude" in sub
    if env_var != "GRPO_PLUGIN_MODULES":
        return
    # the kit runs over it: the estimator passes; the transform registered without a hand case fails, with how-to
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rf",
                          str(REPO / "tests" / "test_advantage_kit.py"), "-k", "fork_ and not example_plugins"],
                         env=env, capture_output=True, text=True, timeout=300, cwd=REPO)
    assert run.returncode == 1, run.stdout[-2000:]
    failed = [line for line in run.stdout.splitlines() if line.startswith("FAILED")]
    assert len(failed) == 3 and all("fork_halve" in line for line in failed), failed  # no case: ships, hand, coverage
    assert "register_transform_case('fork_halve'" in run.stdout
    assert "9 passed" in run.stdout  # fork_capped: its case, coverage and 4 invariants; fork_halve: 2 invariants


@pytest.mark.parametrize("rewards,default,keep_all", [
    ([1.0, 0.0], True, True), ([0.5, 0.5], False, True), ([0.5, np.nan], False, True),
    ([np.nan, np.nan], False, False)])
def test_drop_rule_is_an_option(rewards, default, keep_all):
    rewards = np.array(rewards)
    assert is_kept(rewards) is default
    assert is_kept(rewards, drop_equal_rewards=False) is keep_all


# ---- what the estimator and the transforms are handed; check(config, inputs) -------------------------------------

@pytest.fixture
def temporary_estimator():
    """Register an estimator for one test, then take it out of the registries again."""
    import grpo.advantages as adv

    added = []

    def register(name, options, fn):
        adv.register_estimator(name, options)(fn)
        added.append((name, type(options)))

    yield register
    for name, cls in added:
        adv.ESTIMATORS.pop(name), adv.ESTIMATOR_DESCRIPTIONS.pop(name), adv._ESTIMATOR_FNS.pop(cls)


@dataclasses.dataclass(frozen=True)
class SeenOptions:
    """Records the group it was handed."""


@dataclasses.dataclass(frozen=True)
class NeedsLoopOptions:
    """Accepts only runs whose rollout loop is a NeedsThisLoop (Python API `loop_cls=` or --loop-cls)."""

    def check(self, config, inputs):
        if not (isinstance(inputs.loop_cls, type) and issubclass(inputs.loop_cls, NeedsThisLoop)):
            raise ValueError("this estimator needs loop_cls=NeedsThisLoop")


class NeedsThisLoop:  # stands for a rollout-loop subclass (the check reads the class, never runs it)
    pass


def some_reward(completions, **kwargs):
    return [0.0] * len(completions)


def test_the_loop_hands_the_estimator_lengths_trained_tokens_turns_and_the_prompt(temporary_estimator):
    from grpo.config import AsyncGRPOConfig
    from grpo.rollout_loop import AsyncRolloutLoop, advantage_group
    from grpo.samples import Rollout, RolloutGroup, TurnRecord

    seen = []
    temporary_estimator("seen_group", SeenOptions(), lambda group, opts: seen.append(group) or group.rewards * 0)
    turns = [[TurnRecord([1], [5, 6, 7], [-1.0] * 3)], [TurnRecord([1], [5], [-1.0]), TurnRecord([1, 5, 9], [8, 2],
                                                                                                  [-1.0] * 2)]]
    rollouts = [Rollout(completion=[], completion_ids=[t for turn in ts for t in turn.output_ids], turns=ts)
                for ts in turns]
    long = TrainingSample(input_ids=[1, 2, 3, 4], completion_mask=[0, 1, 1, 1], sampler_logprobs=[0.0] * 4,
                          advantage=0.0, group_id=0, model_version=1, rollout_id="a")
    sequences = [[long], [_sample(0, "b", 0.0), _sample(0, "b", 0.0)]]  # 3 and 1 + 1 trained tokens
    group = RolloutGroup(prompts=[[]] * 2, reward_kwargs={}, completions=[[]] * 2, completions_ids=[[], []],
                         completions_sequences=sequences, tool_call_counts=[0, 0], tool_failure_counts=[0, 0],
                         model_version=1, group_id=3, row_index=17, env_rewards=[None, None],
                         rollout_rewards=[None, None], rewards=np.array([1.0, 0.0]), rollouts=rollouts)
    loop = AsyncRolloutLoop.__new__(AsyncRolloutLoop)  # compute_advantages reads only the config
    loop.config = AsyncGRPOConfig(advantage=SeenOptions())
    loop.compute_advantages(group)
    (got,) = seen
    np.testing.assert_array_equal(got.completion_lengths, [3, 3])
    np.testing.assert_array_equal(got.trained_tokens, [3, 2])
    np.testing.assert_array_equal(got.turns, [1, 2])
    assert got.prompt_id == 17 and advantage_group(group).prompt_id == 17
    np.testing.assert_array_equal(got.rewards, [1.0, 0.0])


def test_transforms_see_each_rollouts_lengths_tokens_turns_and_prompt():
    seen = []
    samples = [_sample(0, "a", 1.0), _sample(0, "a", 1.0), _sample(1, "b", -1.0), _sample(-1, "pad", 0.5)]
    for sample, (length, turns, row) in zip(samples, [(9, 2, 4), (9, 2, 4), (3, 1, 5), (0, 1, 0)]):
        sample.completion_length, sample.turns, sample.row_index = length, turns, row
    apply_batch_transforms([lambda batch: seen.append(batch) or batch.advantages], samples, step=2)
    (batch,) = seen
    np.testing.assert_array_equal(batch.completion_lengths, [9, 3])
    np.testing.assert_array_equal(batch.trained_tokens, [2, 1])  # rollout a: two samples of one trained token each
    np.testing.assert_array_equal(batch.turns, [2, 1])
    np.testing.assert_array_equal(batch.prompt_ids, [4, 5])
    assert batch.step == 2 and samples[-1].advantage == 0.5


def test_check_sees_the_python_apis_loop_cls(temporary_estimator):
    from grpo.config import AsyncGRPOConfig
    from grpo.inputs import resolve_inputs

    temporary_estimator("needs_loop", NeedsLoopOptions(), lambda group, opts: group.rewards - group.rewards.mean())
    config = AsyncGRPOConfig(advantage=NeedsLoopOptions(), num_generations=2)
    dataset = [{"prompt": [{"role": "user", "content": "hi"}]}]
    check_advantage_config(config)  # config-only: a two-argument check waits for the inputs
    inputs = resolve_inputs(config, [some_reward], dataset, [], None, NeedsThisLoop)  # the Python API's loop_cls
    assert inputs.loop_cls is NeedsThisLoop
    with pytest.raises(ValueError, match="needs loop_cls=NeedsThisLoop"):
        resolve_inputs(config, [some_reward], dataset, [], None, None)


def test_transform_options_come_from_the_cli_group_or_an_instance():
    import tyro

    from grpo.batch_std import BatchStdOptions
    from grpo.config import AsyncGRPOConfig

    cli = tyro.cli(AsyncGRPOConfig, args=["--advantage-batch-transforms", "batch_std",
                                          "--transform.batch-std.std-eps", "0.5"])
    python = AsyncGRPOConfig(advantage_batch_transforms=(BatchStdOptions(std_eps=0.5),))
    samples = [_sample(0, "a", 2.0), _sample(0, "b", -2.0)]  # std 2: 2 / (2 + 0.5) = 0.8
    for config in (cli, python):
        copy = [dataclasses.replace(s) for s in samples]
        apply_batch_transforms(batch_transforms(config.advantage_batch_transforms, config.transform), copy, 1)
        np.testing.assert_allclose([s.advantage for s in copy], [0.8, -0.8])


def test_unscored_rollouts_leave_every_field_of_the_group(temporary_estimator):
    from grpo.advantages import AdvantageGroup

    seen = []
    temporary_estimator("seen_subset", SeenOptions(), lambda group, opts: seen.append(group) or group.rewards * 0)
    group = AdvantageGroup.of([1.0, np.nan, 0.0], [4, 5, 6], [3, 2, 1], [1, 2, 3], prompt_id=8)
    estimate_advantages(SeenOptions(), group)
    (got,) = seen
    for field, want in (("rewards", [1.0, 0.0]), ("completion_lengths", [4, 6]), ("trained_tokens", [3, 1]),
                        ("turns", [1, 3])):
        np.testing.assert_array_equal(getattr(got, field), want)
    assert got.prompt_id == 8
