"""Plug-in modules (grpo/plugins.py): one file may define a rollout loop, estimators, transforms and losses; no
import cycle through grpo.config, deferred imports included; an import error names its real cause."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

from grpo.imports import resolve_import

REPO = Path(__file__).resolve().parents[1]
PLUGIN_SURFACE = ("grpo.rollout_loop", "grpo.advantages", "grpo.advantage_kit", "grpo.losses", "grpo.loss_kit",
                  "grpo.samples", "grpo.plugins", "grpo.imports")
"""What a plug-in module imports to define its pieces."""


def grpo_imports(module: str) -> set[str]:
    """Every `grpo.*` module the file imports, at module level or inside functions (deferred imports count), but not
    under `if TYPE_CHECKING:` (never executed)."""
    path = REPO / (module.replace(".", "/") + ".py")
    if not path.exists():
        path = REPO / module.replace(".", "/") / "__init__.py"
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("grpo"):
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("grpo"))
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text()))
    return found


def path_to(start: str, target: str) -> list[str] | None:
    parents: dict[str, str | None] = {start: None}
    todo = [start]
    while todo:
        module = todo.pop()
        for dep in sorted(grpo_imports(module)):
            if dep not in parents:
                parents[dep] = module
                todo.append(dep)
    if target not in parents:
        return None
    chain = [target]
    while parents[chain[-1]] is not None:
        chain.append(parents[chain[-1]])
    return chain[::-1]


@pytest.mark.parametrize("module", PLUGIN_SURFACE)
def test_what_a_plugin_imports_never_reaches_the_config(module):
    # grpo.config imports the plug-ins to build its CLI: a path back to it is a cycle
    assert path_to(module, "grpo.config") is None, " -> ".join(path_to(module, "grpo.config"))


def test_one_plugin_file_defines_a_loop_an_estimator_a_transform_and_a_loss(tmp_path):
    def body(name: str) -> str:  # the example file without its docstring and __future__ line
        text = (REPO / "tests" / name).read_text().split('"""', 2)[2]
        return text.replace("from __future__ import annotations\n", "")

    (tmp_path / "fork_all.py").write_text((REPO / "tests" / "example_length_estimator.py").read_text()
                                          + body("example_token_transform.py") + body("example_cov_loss.py"))
    env = os.environ | {"GRPO_PLUGIN_MODULES": "fork_all", "PYTHONPATH": os.pathsep.join([str(tmp_path), str(REPO)])}
    script = ("import runpy, sys\nfrom grpo.imports import resolve_import\n"
              "print('loop base:', resolve_import('fork_all:ConciseLoop').__mro__[1].__name__)\n"
              f"sys.argv = ['train.py', '--help']\nrunpy.run_path({str(REPO / 'train.py')!r}, run_name='__main__')\n")
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "loop base: AsyncRolloutLoop" in out.stdout  # the loop subclass, defined first: no cycle
    assert "advantage:length-penalized" in out.stdout and "loss:kl-cov" in out.stdout
    assert "--transform.token-whiten.center" in out.stdout


def test_an_import_error_names_its_real_cause(tmp_path, monkeypatch):
    (tmp_path / "broken_plugin.py").write_text("import os\nfrom grpo.no_such_module import thing\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ValueError, match=r"broken_plugin.py:2: ModuleNotFoundError: No module named "
                                         r"'grpo.no_such_module'") as info:
        resolve_import("broken_plugin:thing", "plug-in")
    assert "PYTHONPATH" not in str(info.value)  # the module was found: its own import failed
    with pytest.raises(ValueError, match="no module named 'absent_plugin'; is it on PYTHONPATH"):
        resolve_import("absent_plugin:thing", "plug-in")
