"""scripts/gpu_e2e_check.py --report: the one-GPU summary computed from a gpu_e2e.sh output folder (steady state
after the warm-up steps, S = sync step / async step, S/L and S/L_c against the overlap bench, PASS/FAIL lines and
the exit code). Runs on CPU on a folder written here."""

from __future__ import annotations

import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))

from gpu_e2e_check import report  # noqa: E402


def write_run(folder: Path, step_s: list[float], sync_s: float, check_ok: bool = True) -> None:
    folder.mkdir(parents=True)
    rows = [{"step": i + 1, "perf/step_s": s, "perf/rollout_wait_s": 0.1, "perf/fwd_bwd_s": 0.5,
             "perf/optimizer_s": 0.1, "perf/weight_sync_s": sync_s, "perf/weight_sync_pause_s": sync_s / 2,
             "perf/weight_sync_update_s": sync_s / 4, "perf/weight_sync_finish_s": sync_s / 8}
            for i, s in enumerate(step_s)]
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    verdict = "PASS" if check_ok else "FAIL"
    (folder.parent / f"check_{folder.name}.log").write_text(f"{verdict} server == trainer after the last sync: x\n")


def write_bench(folder: Path, G: float, T: float, G_c: float, T_c: float) -> None:
    bench = {"rollouts_per_step": 10, "completion_tokens_per_step": 100, "in_flight": 4, "num_sampler_logprobs": 8,
             "G": G, "T": T, "G_c": G_c, "T_c": T_c, "L": (G + T) / max(G, T), "L_c": (G + T) / max(G_c, T_c),
             "phases": {"gen_alone": {"warmup_s": [9.0]}}}
    (folder / "overlap.json").write_text(json.dumps(bench))


def test_report_steady_state_speedup_and_targets(tmp_path, capsys):
    (tmp_path / "setup.json").write_text(json.dumps({"mps": "split"}))
    # warm-up steps (30 s, 20 s) are left out of the steady state: async 1.0 s, sync 2.0 s -> S = 2
    write_run(tmp_path / "fixed/async", [30, 20, 1.0, 1.0, 1.0], sync_s=0.1)
    write_run(tmp_path / "fixed/sync", [30, 20, 2.0, 2.0, 2.0], sync_s=0.1)
    write_bench(tmp_path / "fixed", G=1.0, T=1.0, G_c=1.2, T_c=1.1)  # L 2.0, L_c 2/1.2
    write_run(tmp_path / "longtail/async", [30, 20, 2.0, 2.0], sync_s=0.1)
    write_run(tmp_path / "longtail/sync", [30, 20, 2.5, 2.5], sync_s=0.1)  # S 1.25 < 1.5
    assert report(tmp_path, warmup=2, sync_target_s=0.15) == 1
    text = capsys.readouterr().out
    assert "S = sync step / async step = 2.00" in text and "S = sync step / async step = 1.25" in text
    assert "S/L = 1.00, S/L_c = 1.20" in text and "PASS fixed, MPS split: S/L_c 1.20 >= 0.9" in text
    assert "FAIL longtail: S 1.25 >= 1.5" in text
    assert "report: 1 target(s) missed" in text  # the long tail's S; every sync (0.1 s) and check passed


def test_report_fails_on_slow_sync_a_failed_check_or_an_empty_folder(tmp_path, capsys):
    write_run(tmp_path / "fixed/async", [30, 1.0, 1.0], sync_s=0.4, check_ok=False)
    assert report(tmp_path, warmup=1, sync_target_s=0.15) == 1
    text = capsys.readouterr().out
    assert "FAIL async: weight sync 0.400 s per sync <= 0.15 s" in text and "report: 2 target(s) missed" in text
    assert "(of it the transfer, start to finish: 0.150 s)" in text  # update + finish, not the pause
    empty = tmp_path / "empty"
    empty.mkdir()
    assert report(empty, warmup=1, sync_target_s=0.15) == 1
    assert "no run and no overlap bench" in capsys.readouterr().out
