"""The advantage kit (grpo/advantage_kit.py) over EVERY registered estimator and batch transform: a hand-computed
case each (a name registered without one fails here, with how to add it), a case that reaches each option's
effect, and the invariants: shape, finite, padding untouched, permutation equivariance within a group / step,
equal rewards (estimators) / zero advantages (transforms) giving zero where the options declare it.

A fork's estimators and transforms get all of it: `GRPO_PLUGIN_MODULES=my_pkg.my_module pytest
tests/test_advantage_kit.py` (tests/example_length_estimator.py and tests/example_token_transform.py are two).
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from grpo.advantage_kit import (estimator_case_for, option_effect_problems, run_estimator_case, run_transform_case,
                                transform_case_for)
from grpo.advantages import (AdvantageGroup, apply_batch_transforms, batch_transforms, estimate_advantages,
                             registered_batch_transforms, registered_estimators)
from grpo.samples import TrainingSample

REPO = Path(__file__).resolve().parents[1]
ESTIMATORS = sorted(registered_estimators())
TRANSFORMS = sorted(registered_batch_transforms())


def random_groups(seed: int = 0, count: int = 6) -> list[AdvantageGroup]:
    """Groups of 1 to 8 rollouts with ties, binary and real rewards, and unequal lengths, tokens and turns."""
    rng = np.random.default_rng(seed)
    groups = []
    for i in range(count):
        g = int(rng.integers(1, 9)) if i else 8
        rewards = rng.integers(0, 2, g).astype(float) if i % 2 else np.round(rng.normal(size=g), 1)
        lengths = rng.integers(1, 64, g)
        groups.append(AdvantageGroup.of(rewards, lengths, lengths - rng.integers(0, 1, g), rng.integers(1, 4, g), i))
    return groups


def options_under_test(name: str, estimator: bool = True) -> list:
    """The registered defaults and, where the case overrides them, the case's options."""
    defaults = (registered_estimators() if estimator else registered_batch_transforms())[name]
    try:
        case = estimator_case_for(name) if estimator else transform_case_for(name)
    except LookupError:
        return [defaults]
    return [defaults, dataclasses.replace(defaults, **case.overrides)] if case.overrides else [defaults]


def close(a, b) -> None:
    np.testing.assert_allclose(a, b, rtol=1e-9, atol=1e-12)


# ---- estimators --------------------------------------------------------------------------------------------------

# Both kinds: (kind, name) pairs, each kind's case lookup and runner.
EVERY = [("estimator", n) for n in ESTIMATORS] + [("transform", n) for n in TRANSFORMS]
CASE_FOR = {"estimator": estimator_case_for, "transform": transform_case_for}
RUN_CASE = {"estimator": run_estimator_case, "transform": run_transform_case}


@pytest.mark.parametrize("kind,name", EVERY)
def test_everything_registered_ships_a_hand_case(kind, name):
    try:
        CASE_FOR[kind](name)
    except LookupError as exc:
        pytest.fail(str(exc))


@pytest.mark.parametrize("kind,name", EVERY)
def test_hand_case(kind, name):
    case = CASE_FOR[kind](name)
    np.testing.assert_allclose(RUN_CASE[kind](name, case), case.want, rtol=1e-12, atol=1e-12,
                               err_msg=f"{kind} {name} differs from its hand-computed case")


@pytest.mark.parametrize("kind,name", EVERY)
def test_case_reaches_every_option(kind, name):
    assert not option_effect_problems(kind, name, CASE_FOR[kind](name))


@pytest.mark.parametrize("name", ESTIMATORS)
def test_estimator_shape_finite_and_permutation_equivariant(name):
    rng = np.random.default_rng(1)
    for options in options_under_test(name):
        for group in random_groups():
            base = estimate_advantages(options, group)
            assert base.shape == (len(group),) and np.isfinite(base).all(), (name, group.rewards, base)
            for _ in range(3):
                perm = rng.permutation(len(group))
                close(estimate_advantages(options, group.subset(perm)), base[perm])


@pytest.mark.parametrize("name", ESTIMATORS)
def test_estimator_leaves_unscored_rollouts_at_zero_and_out_of_the_statistics(name):
    for options in options_under_test(name):
        for group in random_groups(seed=2):
            where = [0, len(group)]
            padded = AdvantageGroup(np.insert(group.rewards, where, np.nan),
                                    np.insert(group.completion_lengths, where, 7),
                                    np.insert(group.trained_tokens, where, 5), np.insert(group.turns, where, 2),
                                    group.prompt_id)
            got = estimate_advantages(options, padded)
            scored = ~np.isnan(padded.rewards)
            assert (got[~scored] == 0).all() and np.isfinite(got).all()
            close(got[scored], estimate_advantages(options, group))


@pytest.mark.parametrize("name", ESTIMATORS)
def test_equal_rewards_give_zero_where_the_estimator_says_so(name):
    for options in options_under_test(name):
        if not getattr(options, "equal_rewards_give_zero", True):
            continue
        for group in random_groups(seed=3):  # unequal lengths, tokens and turns: only the rewards are equal
            for value in (0.0, 1.0, -2.5):
                equal = dataclasses.replace(group, rewards=np.full(len(group), value))
                np.testing.assert_allclose(estimate_advantages(options, equal), 0.0, atol=1e-9)


@pytest.mark.parametrize("name", ESTIMATORS)
def test_a_higher_reward_never_gets_a_lower_advantage_at_equal_lengths(name):
    for options in options_under_test(name):
        for group in random_groups(seed=4):
            rewards = group.rewards
            got = estimate_advantages(options, AdvantageGroup.of(rewards, np.full(len(group), 9)))
            order = np.argsort(rewards, kind="stable")
            assert (np.diff(got[order]) >= -1e-12).all(), (rewards, got)
            assert got[np.argmax(rewards)] >= 0 >= got[np.argmin(rewards)]


# ---- batch transforms -------------------------------------------------------------------------------------------

def random_step(seed: int, zero_group: bool = False) -> list[TrainingSample]:
    """A step's samples: 4 groups of 2-4 rollouts, some multi-turn (2 samples), unequal trained tokens, and a
    padding sample (group -1); group 0's advantages are 0 when `zero_group`."""
    rng = np.random.default_rng(seed)
    samples = []
    for group in range(4):
        for r in range(int(rng.integers(2, 5))):
            advantage = 0.0 if zero_group and group == 0 else float(np.round(rng.normal(), 2))
            trained = int(rng.integers(1, 6))
            for fork in range(int(rng.integers(1, 3))):
                samples.append(TrainingSample(
                    input_ids=list(range(trained + 1)), completion_mask=[0] + [1] * trained,
                    sampler_logprobs=[0.0] * (trained + 1), advantage=advantage, group_id=group, model_version=1,
                    rollout_id=f"{group}-{r}", reward=advantage, fork_index=fork, row_index=10 + group,
                    completion_length=trained * 2, turns=fork + 1))
    samples.insert(int(rng.integers(0, len(samples))), TrainingSample(
        input_ids=[0, 1], completion_mask=[0, 0], sampler_logprobs=[0.0, 0.0], advantage=0.25, group_id=-1,
        model_version=1, rollout_id="pad"))
    return samples


def transformed(options, samples: list[TrainingSample]) -> dict[str, float]:
    samples = [dataclasses.replace(s) for s in samples]
    apply_batch_transforms(batch_transforms((options,)), samples, step=3)  # raises on a wrong shape or non-finite
    out: dict[str, float] = {}
    for s in samples:
        assert out.setdefault(s.rollout_id, s.advantage) == s.advantage, "a rollout's samples must agree"
    return out


@pytest.mark.parametrize("name", TRANSFORMS)
def test_transform_shape_finite_padding_and_permutation(name):
    rng = np.random.default_rng(5)
    for options in options_under_test(name, estimator=False):
        for seed in range(3):
            samples = random_step(seed)
            base = transformed(options, samples)
            assert base["pad"] == 0.25, "a padding sample's advantage must stay as it is"
            for _ in range(3):
                shuffled = [samples[i] for i in rng.permutation(len(samples))]
                got = transformed(options, shuffled)
                close([got[k] for k in sorted(got)], [base[k] for k in sorted(base)])


@pytest.mark.parametrize("name", TRANSFORMS)
def test_zero_advantages_stay_zero_where_the_transform_says_so(name):
    for options in options_under_test(name, estimator=False):
        if not getattr(options, "keeps_zero_advantages", True):
            continue
        got = transformed(options, random_step(6, zero_group=True))
        assert all(got[k] == 0.0 for k in got if k.startswith("0-")), got


# ---- the fork's path: example plug-ins pass; a one-line mutation of each fails -------------------------------------

EXAMPLES = ("example_length_estimator", "example_token_transform", "example_cov_loss")
MUTATIONS = {
    "example_length_estimator.py": ("np.where(penalised, relative, 0.0)", "relative"),  # only_correct ignored
    "example_token_transform.py": ("(weights * batch.advantages).sum()", "batch.advantages.sum()"),  # not per token
    "example_cov_loss.py": ("opts.kl_coef * log_ratio ** 2", "opts.kl_coef * log_ratio.detach() ** 2"),  # detached
}


def run_kit(tmp_path: Path, mutate: bool) -> subprocess.CompletedProcess:
    """The two kits on the example plug-ins, as they are or each with its one-line mutation (the mutants get their
    own module names: pytest puts tests/ first on sys.path, where the originals would shadow them)."""
    modules = list(EXAMPLES)
    if mutate:
        modules = []
        for file, (old, new) in MUTATIONS.items():
            text = (REPO / "tests" / file).read_text()
            assert text.count(old) == 1, (file, old)
            (tmp_path / f"mutant_{file}").write_text(text.replace(old, new))
            modules.append(f"mutant_{file.removesuffix('.py')}")
    env = os.environ | {"GRPO_PLUGIN_MODULES": ",".join(modules),
                        "PYTHONPATH": os.pathsep.join([str(tmp_path), str(REPO), str(REPO / "tests")])}
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rf",
                           str(REPO / "tests" / "test_advantage_kit.py"), str(REPO / "tests" / "test_losses.py"),
                           "-k", "(length_penalized or token_whiten or kl_cov) and not example_plugins"],
                          env=env, capture_output=True, text=True, timeout=300, cwd=REPO)


def test_example_plugins_pass_the_kits_and_a_one_line_mutation_of_each_fails(tmp_path):
    clean = run_kit(tmp_path, mutate=False)
    assert clean.returncode == 0 and " passed" in clean.stdout, clean.stdout[-3000:]
    mutated = run_kit(tmp_path, mutate=True)
    assert mutated.returncode == 1, mutated.stdout[-3000:]
    for failing in ("test_hand_case[estimator-length_penalized]", "test_hand_case[transform-token_whiten]",
                    "test_hand_computed_case[kl_cov]"):
        assert failing in mutated.stdout, (failing, mutated.stdout[-3000:])
