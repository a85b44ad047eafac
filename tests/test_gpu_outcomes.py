"""scripts/gpu_outcomes.sh, dry run on CPU: every stage of the GPU plan resolves, the stages hand each other the same
paths (what model_b writes is what train and trl load), and each device call's carry fits the 64 MiB a call takes."""

import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
STAGES = ("prepare", "model_a", "model_b", "train", "all", "trl_a", "trl", "shape", "report")
CALL_LIMIT = 64 * 2**20


def dry(stage: str, tmp_path: Path) -> str:
    result = subprocess.run(["bash", str(REPO / "scripts" / "gpu_outcomes.sh"), stage], capture_output=True,
                            text=True, timeout=30, env={"DRY_RUN": "1", "OUT": str(tmp_path), "PATH": "/usr/bin:/bin"})
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


def test_stages_hand_each_other_the_same_paths(tmp_path):
    out = {stage: dry(stage, tmp_path) for stage in STAGES}
    written = re.search(r"get_smollm2.py --gguf (\S+) --out (\S+)", out["model_b"])
    assert written, out["model_b"]
    joined = re.search(r"cat (\S+) (\S+) > (\S+)", out["model_b"]).group(3)
    assert written.group(1) == joined
    assert re.search(r"cp \S+/gguf.part0 (\S+)/", out["model_a"]).group(1) + "/gguf.part0" in out["model_b"]
    model = written.group(2)
    assert f"vllm_serve {model} " in out["train"] and out["train"].count(f"--model {model} ") == 2
    assert "--max-staleness 4" in out["train"] and "--max-staleness 0" in out["train"]
    assert f"--side trl --model {model} " in out["trl"]
    assert "eval_heldout.py" in out["train"] and f"--baseline {tmp_path}/baseline.json" in out["train"]
    assert "--side ours" in out["shape"] and "--side trl" in out["shape"]
    stash = re.search(r"cp \S+ (\S+)/trl_wheels/", out["trl_a"]).group(1)
    assert f"{stash}/trl_wheels/*.whl" in out["trl"]
    # `all`: the baseline, async, sync, our server stopped, then TRL on the freed card, then the report
    order = [out["all"].index(mark) for mark in ("eval_heldout.py", "--max-staleness 4", "--max-staleness 0",
                                                  "vllm_stop", "--side trl", "--report")]
    assert order == sorted(order), out["all"]
    assert out["all"].count(f"--model {model} ") == 3


def test_each_call_carries_under_the_limit():
    carry = REPO / ".models" / "carry"
    if not carry.exists():
        pytest.skip("run `bash scripts/gpu_outcomes.sh prepare` first (it needs PyPI)")
    tree = sum(int(line.split("\t")[0]) for line in subprocess.run(
        ["bash", "-c", "git ls-files -z | xargs -0 du -b"], cwd=REPO, capture_output=True, text=True).stdout.splitlines())
    for piece in carry.iterdir():
        size = sum(f.stat().st_size for f in piece.rglob("*") if f.is_file())
        assert size + tree < CALL_LIMIT, f"{piece.name}: {size + tree} bytes with the working tree"
