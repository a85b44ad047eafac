"""Run fla-core's Triton kernels in Triton's interpreter on CPU: shared by the scripts the FLA tests run in a
subprocess (tests/fla_interpret_dqkwg.py, tests/fla_interpret_tree.py). `interpret_fla` must run before anything
imports triton: it sets TRITON_INTERPRET=1, puts a temporary copy of fla (from the folder fla-core was installed
into with --target) and the repository first on sys.path, and makes every autotuned kernel run its first
configuration (the interpreter cannot time kernels).

The interpreter hands a kernel's `for` loop variables over as Python ints, which have no `.to`: the copy's state
kernels read `tl.full([], i_t, tl.int64)` where FLA writes `i_t.to(tl.int64)` (the same value).
"""

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FLA_SITE = Path(os.environ.get("GRPO_FLA_SITE", REPO / ".venv" / "fla-cpu"))


def run_interpreted(script: str) -> dict:
    """Test side: run tests/`script` (which calls `interpret_fla`) in a subprocess and return the JSON of its last
    output line; skips when Triton or the side folder with fla-core (`scripts/install.sh cpu` fills it) is absent."""
    import pytest

    pytest.importorskip("triton")
    if not (FLA_SITE / "fla").is_dir():
        pytest.skip(f"no fla-core in {FLA_SITE}: bash scripts/install.sh cpu (or set GRPO_FLA_SITE)")
    proc = subprocess.run([sys.executable, str(REPO / "tests" / script), str(REPO), str(FLA_SITE)],
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def interpret_fla(repo: str, fla_site: str) -> Path:
    """Set up as above; returns the temporary copy's folder (the caller removes it)."""
    os.environ["TRITON_INTERPRET"] = "1"
    copy = Path(tempfile.mkdtemp(prefix="fla-interpret-"))
    shutil.copytree(Path(fla_site) / "fla", copy / "fla")
    state_kernels = copy / "fla" / "ops" / "common" / "chunk_delta_h.py"
    source = state_kernels.read_text()
    assert "i_t.to(tl.int64)" in source, "this fla-core's state kernels changed: update the interpreter fix"
    state_kernels.write_text(source.replace("i_t.to(tl.int64)", "tl.full([], i_t, tl.int64)"))
    sys.path[:0] = [str(copy), repo]

    import triton.runtime.autotuner as autotuner

    run = autotuner.Autotuner.run

    def first_config(self, *args, **kwargs):
        self.configs = self.configs[:1]
        return run(self, *args, **kwargs)

    autotuner.Autotuner.run = first_config
    return copy
