"""The import graph of grpo/, scripts/, train.py and rollout.py has no cycle and no upward edge.

The graph is read with `ast`, every import statement counted wherever it sits (a function-level, deferred import is
still a dependency: it only hides a cycle from the interpreter, not from a reader). Relative imports are resolved
against the importing module; a script's bare `import bench_x` names the sibling scripts/bench_x.py (scripts put
their own folder on sys.path).

Allowed layering, lowest floor first; an import may only point to its own floor or one below:
  1. `grpo.kernels.*`: kernels nobody edits for research (GDN scans, split attention, log-prob kernels). They import
     each other and only the flat modules in `KERNEL_MAY_IMPORT` (the packed-row data type, the shared row context
     and a progress heartbeat), never the research modules (losses, trainer step, tree attention wrapper, ...).
  2. `grpo.*` (flat): what a researcher reads. May import `grpo.kernels` and each other; never scripts or the entry
     points.
  3. `scripts.*`: benchmarks and tools; may import grpo and each other.
  4. `train`, `rollout`: the recipes; import anything below.
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
KERNEL_MAY_IMPORT = {"grpo.trie", "grpo.row_context", "grpo.progress"}


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def source_files(root: Path) -> dict[str, Path]:
    files = [*root.glob("grpo/**/*.py"), *root.glob("scripts/*.py"), root / "train.py", root / "rollout.py"]
    return {module_name(p, root): p for p in files if p.exists()}


def resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The project module `name` refers to (`grpo.gdn.x` -> `grpo.gdn` when x is an attribute), or None."""
    while name:
        if name in modules:
            return name
        name = name.rpartition(".")[0]
    return None


def imported_names(tree: ast.AST, module: str, is_package: bool, modules: dict[str, Path]) -> set[str]:
    """Every project module the file imports, wherever the import statement sits."""
    names: set[str] = set()
    package = module if is_package else module.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            candidates = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1] if package else []
                stem = ".".join([*base, node.module] if node.module else base)
            else:
                stem = node.module or ""
            # `from pkg import sub` depends on pkg.sub (and pkg's __init__ runs, but that is pkg's own edge list)
            candidates = [f"{stem}.{a.name}" if f"{stem}.{a.name}" in modules else stem for a in node.names]
        else:
            continue
        for name in candidates:
            if module.startswith("scripts.") and "." not in name and f"scripts.{name}" in modules:
                name = f"scripts.{name}"  # scripts import their siblings by bare name
            target = resolve(name, modules)
            if target is not None and target != module:
                names.add(target)
    return names


def import_graph(root: Path) -> dict[str, set[str]]:
    modules = source_files(root)
    return {m: imported_names(ast.parse(p.read_text(), str(p)), m, p.name == "__init__.py", modules)
            for m, p in modules.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def floor(module: str) -> int:
    if module.startswith("grpo.kernels"):
        return 1
    if module.startswith("grpo"):
        return 2
    if module.startswith("scripts"):
        return 3
    return 4


def upward_edges(graph: dict[str, set[str]]) -> list[str]:
    bad = []
    for source, targets in sorted(graph.items()):
        for target in sorted(targets):
            if floor(source) == 1 and floor(target) == 2:
                if target not in KERNEL_MAY_IMPORT:
                    bad.append(f"{source} -> {target} (a kernel importing a research module)")
            elif floor(target) > floor(source):
                bad.append(f"{source} -> {target}")
    return bad


def test_no_import_cycles():
    found = cycles(import_graph(REPO))
    assert not found, ("import cycles (move the shared part into a module below both, or invert the call with a "
                       f"registration hook): {found}")


def test_no_upward_imports():
    bad = upward_edges(import_graph(REPO))
    assert not bad, f"imports against the layering in this test's docstring (move the shared part down): {bad}"


def write(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root


def test_a_planted_deferred_relative_cycle_is_found(tmp_path):
    root = write(tmp_path, {
        "grpo/__init__.py": "",
        "grpo/a.py": "def f():\n    from .b import g\n",
        "grpo/b.py": "import grpo.a\n",
        "grpo/c.py": "from grpo import a\n",
        "scripts/s1.py": "def f():\n    import s2\n",
        "scripts/s2.py": "from s1 import f\n",
    })
    assert cycles(import_graph(root)) == [["grpo.a", "grpo.b"], ["scripts.s1", "scripts.s2"]]


def test_planted_upward_imports_are_found(tmp_path):
    root = write(tmp_path, {
        "grpo/__init__.py": "",
        "grpo/trie.py": "",
        "grpo/losses.py": "",
        "grpo/kernels/__init__.py": "from . import scan\n",
        "grpo/kernels/scan.py": "from grpo.trie import PackedRow\ndef f():\n    from ..losses import x\n",
        "grpo/step.py": "import train\n",
        "train.py": "from grpo.kernels import scan\n",
    })
    assert upward_edges(import_graph(root)) == [
        "grpo.kernels.scan -> grpo.losses (a kernel importing a research module)", "grpo.step -> train"]
