"""scripts/gpu_overlap.py (the one-GPU report's G, T, G_c, T_c, L, L_c) runs end to end on CPU against the shared
real vLLM server, and its long-tail workload has the length distribution it claims. The GPU runs of
scripts/gpu_e2e.sh call it; this keeps an import move or an API change from first failing on the device."""

from __future__ import annotations

import json
import math
import random
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))

from gpu_overlap import LONG_TAIL_FRACTION, completion_length  # noqa: E402


def test_completion_lengths_fixed_and_long_tail():
    rng = random.Random(0)
    assert {completion_length("fixed", 384, rng) for _ in range(50)} == {384}
    lengths = [completion_length("longtail", 384, rng) for _ in range(20_000)]
    assert min(lengths) >= 1 and max(lengths) == 384
    at_max = sum(n == 384 for n in lengths) / len(lengths)
    assert abs(at_max - LONG_TAIL_FRACTION) < 0.01  # the tail: ~10 % run to max_len (short ones almost never do)
    short = [n for n in lengths if n < 384]
    assert abs(sum(short) / len(short) - 384 / 16) < 1.5  # the rest ~Exp(mean max_len / 16)
    with pytest.raises(ValueError, match="fixed, longtail"):
        completion_length("uniform", 384, rng)


@pytest.mark.vllm
def test_overlap_bench_reports_consistent_limits(vllm_server, tiny_qwen3, tmp_path):
    out = tmp_path / "overlap.json"
    proc = subprocess.run(
        [sys.executable, str(REPO / "scripts/gpu_overlap.py"), "--server", vllm_server.base_url, "--model",
         str(tiny_qwen3), "--workload", "longtail", "--max-len", "12", "--prompt-len", "8", "--token-budget", "256",
         "--in-flight", "2", "--reps", "2", "--warmup", "1", "--json", str(out)],
        capture_output=True, text=True, timeout=600, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    r = json.loads(out.read_text())
    for key in ("G", "T", "G_c", "T_c"):
        assert math.isfinite(r[key]) and r[key] > 0, (key, r[key])
    assert r["L"] == pytest.approx((r["G"] + r["T"]) / max(r["G"], r["T"])) and 1 <= r["L"] <= 2
    assert r["L_c"] == pytest.approx((r["G"] + r["T"]) / max(r["G_c"], r["T_c"]))
    assert r["rollouts_per_step"] > 0 and 0 < r["completion_tokens_per_step"] <= 12 * r["rollouts_per_step"]
    for phase in ("gen_alone", "train_alone", "gen_concurrent", "train_concurrent"):
        assert r["phases"][phase]["steady_n"] >= 1  # every phase timed at least one repetition after its warm-up
    assert "OVERLAP longtail" in proc.stdout
