"""scripts/eval_heldout.py's interval: the Wilson score interval is the set of p whose score test does not reject
p-hat, |p-hat - p| <= z sqrt(p (1 - p) / n); checked against that definition solved by bisection."""

import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

from eval_heldout import wilson_interval  # noqa: E402

Z = 1.959964


def score_test_bound(successes: int, trials: int, upper: bool) -> float:
    p_hat = successes / trials
    accepted = lambda p: abs(p_hat - p) <= Z * math.sqrt(p * (1 - p) / trials) + 1e-15  # noqa: E731
    lo, hi = (p_hat, 1.0) if upper else (0.0, p_hat)
    for _ in range(200):  # the accepted set is an interval around p_hat: bisect its edge
        mid = (lo + hi) / 2
        if accepted(mid) == upper:
            lo = mid
        else:
            hi = mid
    return lo if upper else hi


@pytest.mark.parametrize("successes,trials", [(32, 256), (0, 50), (50, 50), (1, 3), (128, 256)])
def test_wilson_interval_matches_the_score_test(successes, trials):
    low, high = wilson_interval(successes, trials)
    assert low == pytest.approx(score_test_bound(successes, trials, upper=False), abs=1e-9)
    assert high == pytest.approx(score_test_bound(successes, trials, upper=True), abs=1e-9)
    assert 0.0 <= low <= successes / trials <= high <= 1.0
