"""Non-finite training steps: skipped (counted, logged, nothing stepped, nothing synced), a named stop after
`max_nonfinite_steps_in_a_row`, and the server serves the next run cleanly."""

from __future__ import annotations

import pytest

from .test_run_faults import ENV, REPO, records, train_cmd, within


def run(cmd, timeout: float, env=None):
    import subprocess

    return within(timeout, subprocess.run, cmd, capture_output=True, text=True, cwd=REPO, env=env or ENV)


@pytest.mark.vllm
def test_nonfinite_steps_are_skipped_then_stop_named_and_the_server_stays_clean(faults_server, tmp_path):
    """debefe5: `loss nan` at step 1, the NaN weights synced, and the run (and the next runs on the same server) died
    on a 400 'Out of range float values are not JSON compliant' naming nothing."""
    out = tmp_path / "bad"
    cmd = train_cmd(faults_server.base_url, out, "--max-steps", "6", "--max-nonfinite-steps-in-a-row", "3",
                    "loss:nan-reinforce")
    bad = run(cmd, timeout=400, env=ENV | {"GRPO_LOSS_MODULES": "faults.nan_loss"})
    text = bad.stdout + bad.stderr
    assert bad.returncode != 0
    assert "NonFiniteStepError" in text and "3 steps in a row" in text and "nothing was synced" in text, text[-4000:]
    assert text.count("skipped: loss") >= 3
    assert "Out of range float" not in text
    # The same server, a valid run: it must train and finish cleanly (the NaN weights never reached it).
    good = run(train_cmd(faults_server.base_url, tmp_path / "good", "--max-steps", "3"), timeout=400)
    assert good.returncode == 0, (good.stdout + good.stderr)[-4000:]
    metrics = records(tmp_path / "good", "metrics.jsonl")
    assert metrics[-1]["step"] == 3 and metrics[-1]["train/skipped_nonfinite_count"] == 0
