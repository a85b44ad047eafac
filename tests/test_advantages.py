"""grpo/advantages.py and the drop rule: each estimator against its textbook definition, computed independently."""

from __future__ import annotations

import numpy as np
import pytest

from grpo.advantages import ESTIMATORS, estimate_advantages, overlong_penalty
from grpo.scoring import is_kept

REWARDS = np.array([1.0, 0.0, 0.5, np.nan, 0.25])  # one unscorable rollout


def _scored():
    return REWARDS[~np.isnan(REWARDS)]


def test_registry_has_the_families():
    assert {"group_std", "no_std", "rloo"} <= set(ESTIMATORS)


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


def test_unknown_estimator_names_the_choices():
    with pytest.raises(ValueError, match="group_std"):
        estimate_advantages("ppo", REWARDS)


@pytest.mark.parametrize("rewards,default,keep_all", [
    ([1.0, 0.0], True, True), ([0.5, 0.5], False, True), ([0.5, np.nan], False, True),
    ([np.nan, np.nan], False, False)])
def test_drop_rule_is_an_option(rewards, default, keep_all):
    rewards = np.array(rewards)
    assert is_kept(rewards) is default
    assert is_kept(rewards, drop_equal_rewards=False) is keep_all
