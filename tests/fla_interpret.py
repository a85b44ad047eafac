"""Run fla-core's Triton kernels in Triton's interpreter on CPU: shared by the scripts the FLA tests run in a
subprocess (tests/fla_interpret_dqkwg.py, tests/fla_interpret_tree.py). `interpret_fla` must run before anything
imports triton: it sets TRITON_INTERPRET=1, puts a temporary copy of fla (from the folder fla-core was installed
into with --target) and the repository first on sys.path, and makes every autotuned kernel run its first
configuration (the interpreter cannot time kernels).

The interpreter hands a kernel's `for` loop variables over as Python ints, which have no `.to`: the copy's state
kernels read `tl.full([], i_t, tl.int64)` where FLA writes `i_t.to(tl.int64)` (the same value).
"""

import os
import shutil
import sys
import tempfile
from pathlib import Path


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
