"""The docs stay true to the code.

- Pointers resolve: every repository path (`grpo/x.py`, `path:line`, `tests/t.py::test_name`), markdown link (and
  its #anchor), `§N` and "`name` in `path`" code pointer in README.md and docs/*.md; the `docs/design.md §N` and
  README "Section" references in the code.
- docs/design.md's module map has a row for every module and script.
- The README's metrics glossary lists exactly the metrics the trainer and the rollout worker can log, as read from
  the code's syntax trees (`metric_names_in`: no list of prefixes, so a new loss's metric needs a glossary row).
- The README's test command is the one .ci/run runs.
Each checker also runs on planted mistakes, so it can fail.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TOP = ("grpo", "tests", "scripts", "docs", ".ci")
TOP_FILES = ("train.py", "rollout.py", "README.md", "pyproject.toml", "requirements.txt", "requirements-cpu.txt")
PATH = re.compile(r"(?<![\w/.<>-])((?:" + "|".join(re.escape(t) for t in TOP) + r")/[\w./*-]*|"
                  + "|".join(re.escape(f) for f in TOP_FILES) + r")(?::(\d+)(?:-(\d+))?)?(?:::(\w+))?")
LINK = re.compile(r"\]\(([^)\s]+)\)")
SECTION = re.compile(r"§(\d+(?:\.\d+)?)")
NAMES = r"`[\w./]+`(?:\s*(?:/|,|and)\s*`[\w./]+`)*"
CODE_IN = re.compile(r"(" + NAMES + r") in `([\w./-]+\.py)`")
CODE_AFTER = re.compile(r"`([\w./-]+\.py)` \((" + NAMES + r")\)")


def doc_files(root: Path) -> list[Path]:
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]


def design_sections(root: Path) -> set[str]:
    """Section numbers of docs/design.md: `## 6. Losses` -> 6, `### 6.2 Score centering` -> 6.2."""
    text = (root / "docs" / "design.md").read_text()
    return set(re.findall(r"^#{2,4} (\d+(?:\.\d+)?)\.? ", text, flags=re.M))


def anchors(markdown: str) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation other than '-' and '_' dropped, spaces -> '-'."""
    prose = re.sub(r"^```.*?^```", "", markdown, flags=re.M | re.S)  # a `# comment` in a code block is no heading
    headings = re.findall(r"^#{1,6} (.+?)\s*$", prose, flags=re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


def defines(path: Path, name: str) -> bool:
    """`name` (or each part of `Class.method`, `a/b`) is defined in the Python file: def, class or assignment."""
    text = path.read_text()
    parts = [p for p in re.split(r"[./]", name) if p]
    return all(re.search(rf"^\s*(?:async\s+def|def|class)\s+{re.escape(p)}\b|^\s*(?:self\.)?{re.escape(p)}\s*[:=]",
                         text, flags=re.M) for p in parts)


def check_path(root: Path, token: str, line: str | None, line_end: str | None, test: str | None) -> str | None:
    token = token.rstrip(".")
    matches = sorted(root.glob(token.rstrip("/"))) if "*" in token else [root / token.rstrip("/")]
    if not matches or not all(m.exists() for m in matches):
        return f"{token}: no such file or folder"
    target = matches[0]
    if line is not None:
        n = len(target.read_text().splitlines())
        if not 1 <= int(line) <= int(line_end or line) <= n:
            return f"{token}:{line}{'-' + line_end if line_end else ''}: the file has {n} lines"
    if test is not None and not defines(target, test):
        return f"{token}::{test}: not defined there"
    return None


def text_pointers(root: Path, text: str, doc_dir: Path, where: str) -> list[str]:
    """The pointers of one document's text that do not resolve (links relative to `doc_dir`)."""
    sections, bad = design_sections(root), []
    for m in PATH.finditer(text):
        if (why := check_path(root, *m.groups())) is not None:
            bad.append(f"{where}: {why}")
    for target in LINK.findall(text):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue
        file, _, anchor = target.partition("#")
        if not (doc_dir / file).exists():
            bad.append(f"{where}: link ({target}) does not resolve from {doc_dir.relative_to(root)}/")
        elif anchor and file.endswith(".md") and anchor not in anchors((doc_dir / file).read_text()):
            bad.append(f"{where}: link ({target}): no heading of {file} has the anchor #{anchor}")
    for number in SECTION.findall(text):
        if number not in sections:
            bad.append(f"{where}: §{number} is not a section of docs/design.md")
    for names, path in CODE_IN.findall(text) + [(n, p) for p, n in CODE_AFTER.findall(text)]:
        for name in re.findall(r"`([\w./]+)`", names):
            if (root / path).is_file() and not name.endswith((".py", ".md")) and not defines(root / path, name):
                bad.append(f"{where}: `{name}` is not defined in {path}")
    return bad


def bad_pointers(root: Path) -> list[str]:
    """Every pointer of README.md and docs/*.md, and every `docs/design.md §N` the code cites, that does not
    resolve."""
    bad = []
    for doc in doc_files(root):
        bad += text_pointers(root, doc.read_text(), doc.parent, str(doc.relative_to(root)))
    sections = design_sections(root)
    for source in code_files(root):
        for number in re.findall(r"docs/design\.md,? §(\d+(?:\.\d+)?)", source.read_text()):
            if number not in sections:
                bad.append(f"{source.relative_to(root)}: cites docs/design.md §{number}, which does not exist")
    headings = readme_headings((root / "README.md").read_text())
    for source in code_files(root, "*.py", "*.sh", "*.sbatch", "*.md"):
        for title in re.findall(r'README "([^"]+)"', source.read_text()):
            if not any(h.startswith(title.lower()) for h in headings):
                bad.append(f'{source.relative_to(root)}: README "{title}" is no heading of README.md')
    return bad


def readme_headings(readme: str) -> list[str]:
    prose = re.sub(r"^```.*?^```", "", readme, flags=re.M | re.S)
    return [h.lower() for h in re.findall(r"^#{2,4} (.+?)\s*$", prose, flags=re.M)]


def code_files(root: Path, *patterns: str) -> list[Path]:
    """Tracked files matching `patterns` (default: Python), or a glob when this is not a git checkout."""
    patterns = patterns or ("*.py",)
    listed = subprocess.run(["git", "ls-files", *patterns], cwd=root, capture_output=True, text=True).stdout.split()
    if not listed:
        found = {p for pattern in patterns for p in root.glob(f"**/{pattern}") if ".venv" not in p.parts}
        return sorted(found - {Path(__file__).resolve()})  # this file plants bad pointers on purpose
    return [root / p for p in listed if (root / p).is_file() and root / p != Path(__file__).resolve()]


def test_every_doc_pointer_resolves():
    bad = bad_pointers(REPO)
    assert not bad, "stale doc pointers (fix the doc, or the code it names):\n" + "\n".join(bad)


@pytest.mark.parametrize("planted, expected", [
    ("see `grpo/no_such_module.py`", "no such file"),
    ("see grpo/trie.py:999999", "the file has"),
    ("the test tests/test_trie.py::test_that_does_not_exist", "not defined there"),
    ("the map in [the design](no_such_doc.md)", "does not resolve"),
    ("the staleness rule (docs/design.md §99)", "§99 is not a section"),
    ("*Code: `NoSuchClass.get` in `grpo/rollout_worker.py`.*", "`NoSuchClass.get` is not defined in grpo/rollout_worker.py"),
    ("*Code: `grpo/trie.py` (`pack_samples`, `no_such_packer`).*", "`no_such_packer` is not defined"),
    ("[normalisers](losses.md#no-such-heading)", "no heading of losses.md has the anchor"),
])
def test_a_planted_bad_pointer_is_reported(planted, expected):
    text = f"# planted\n\nGood: `grpo/trie.py`, grpo/trie.py:1, [losses](losses.md), §4. Bad: {planted}\n"
    bad = text_pointers(REPO, text, REPO / "docs", "docs/planted.md")
    assert len(bad) == 1 and expected in bad[0], bad


def test_a_planted_readme_section_reference_is_reported(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "design.md").write_text("## 1. One\n")
    (tmp_path / "README.md").write_text("# x\n\n## Failure policy\n\n```bash\n# Not a heading\n```\n")
    (tmp_path / "a.py").write_text('# README "Failure policy" fine; README "Not a heading", README "Gone" not\n')
    assert bad_pointers(tmp_path) == ['a.py: README "Not a heading" is no heading of README.md',
                                      'a.py: README "Gone" is no heading of README.md']


def test_the_module_map_names_every_module_and_script():
    """docs/design.md's module map: every module of grpo/, every script, and the two entry points have a row."""
    from fnmatch import fnmatchcase

    text = (REPO / "docs" / "design.md").read_text()
    table = text.split("## Module map", 1)[1].split("\n## ", 1)[0]
    listed = [e for name in re.findall(r"`([^`]+)`", table) for e in expand(name)]
    files = [p for p in code_files(REPO, "grpo/*.py", "scripts/*", "train.py", "rollout.py")
             if p.name != "__init__.py"]
    missing = [str(p.relative_to(REPO)) for p in files
               if not any(fnmatchcase(str(p.relative_to(REPO)), pattern) for pattern in listed)]
    assert not missing, f"not in docs/design.md's module map: {missing}"


def test_the_readme_test_command_is_what_ci_runs():
    """.ci/run runs "the README's test command": its install line and its pytest line, joined, are in the README."""
    ci = (REPO / ".ci" / "run").read_text()
    install = re.search(r"^(bash scripts/install\.sh[^|\n]*?)\s*\|\|", ci, flags=re.M).group(1).strip()
    pytest_line = re.search(r"^(\.venv/bin/python -m pytest[^\n]*)$", ci, flags=re.M).group(1).strip()
    command = f"{install} && {pytest_line}"
    assert re.search(rf"^{re.escape(command)}(\s+#.*)?$", (REPO / "README.md").read_text(), flags=re.M), command


# ---- the metrics glossary ---------------------------------------------------------------------------------------

NOT_METRICS = {  # slash-shaped string literals in the code that are no metric names
    "broadcast_from/*/*": "a torch.distributed store key (grpo/distributed.py)",
    "outputs/run": "the default output_dir",
    "outputs/samples.jsonl": "a file name in a help text",
}
SLASH_NAME = re.compile(r"^[a-z][a-z_]*(?:/[\w{}.@*-]*[\w}*])+$")  # `perf/step_s`, `rewards/{name}/mean`
BARE_NAME = re.compile(r"^[a-z][a-z0-9_]*$")  # `loss`, `grad_norm`


def expand(name: str) -> list[str]:
    """`a/{x,y}_s` -> a/x_s, a/y_s; a placeholder without a comma (`{fn}`, `{s.index}`) -> `*`."""
    match = re.search(r"\{([^{}]*)\}", name)
    if match is None:
        return [name]
    options = [o.strip() for o in match.group(1).split(",")] if "," in match.group(1) else ["*"]
    return [e for o in options for e in expand(name[:match.start()] + o + name[match.end():])]


def literal(node) -> str | None:
    """A string constant, an f-string (`{...}` kept as a placeholder) or a `"a/" + x + "_b"` concatenation."""
    import ast

    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return "".join(v.value if isinstance(v, ast.Constant) else "{x}" for v in node.values)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        left, right = literal(node.left), literal(node.right)
        if left is not None or right is not None:
            return (left if left is not None else "{x}") + (right if right is not None else "{x}")
    return None


def metric_names_in(source: str) -> set[str]:
    """The metric names one module can log, from its syntax tree, with no list of prefixes: every slash-shaped
    string literal (`perf/step_s`, f"rewards/{name}/mean"), and every bare key (`loss`, `grad_norm`) of a dict or
    (name, value) list that also holds a slash-shaped name, or that is assigned to, merged into, subscripted on or
    returned as something called `*metric*`."""
    import ast

    def metricish(node) -> bool:
        name = node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else ""
        return "metric" in name.lower() or (isinstance(node, ast.Subscript) and metricish(node.value))

    def keys(node) -> list:
        if isinstance(node, ast.Dict):
            return [literal(k) for k in node.keys if k is not None]
        if isinstance(node, (ast.List, ast.Tuple, ast.Set)):
            return [literal(e.elts[0]) for e in node.elts if isinstance(e, ast.Tuple) and e.elts]
        if isinstance(node, ast.BinOp):
            return keys(node.left) + keys(node.right)
        return []

    tree, names = ast.parse(source), set()
    pieces = {id(v) for n in ast.walk(tree) if isinstance(n, ast.JoinedStr) for v in n.values}  # not names alone
    for node in ast.walk(tree):
        if id(node) not in pieces and (text := literal(node)) is not None and SLASH_NAME.match(text):
            names.add(text)
        group = keys(node) if isinstance(node, (ast.Dict, ast.List)) else []
        if any(k and SLASH_NAME.match(k) for k in group):
            names |= {k for k in group if k and BARE_NAME.match(k)}
        if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(metricish(t) for t in targets):
                names |= {k for k in keys(node.value) if k and BARE_NAME.match(k)}
                names |= {literal(t.slice) for t in targets if isinstance(t, ast.Subscript) and literal(t.slice)}
        if isinstance(node, ast.BinOp) and (metricish(node.left) or metricish(node.right)):
            names |= {k for k in keys(node) if k and BARE_NAME.match(k)}
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and "metric" in node.name:
            for inner in ast.walk(node):  # its returned dict keys and its (name, value) items
                if isinstance(inner, ast.Return) and inner.value is not None:
                    names |= {k for k in keys(inner.value) if k and BARE_NAME.match(k)}
                first = literal(inner.elts[0]) if isinstance(inner, ast.Tuple) and len(inner.elts) == 2 else None
                if first and BARE_NAME.match(first):
                    names.add(first)
    return names


def emitted_metrics(root: Path) -> set[str]:
    """Metric names the trainer and the rollout worker can log (`metric_names_in` over every module)."""
    from fnmatch import fnmatchcase

    sources = [root / "train.py", root / "rollout.py", *sorted((root / "grpo").rglob("*.py"))]
    names = {e for path in sources for name in metric_names_in(path.read_text()) for e in expand(name)}
    return {n for n in names if not any(fnmatchcase(n, pattern) for pattern in NOT_METRICS)}


def glossary_metrics(readme: str) -> set[str]:
    """The backticked names in the first column of the README's metrics table."""
    table = readme.split("## Metrics", 1)[1].split("\n## ", 1)[0]
    rows = [line.split("|")[1] for line in table.splitlines() if line.startswith("| `")]
    return {e for row in rows for name in re.findall(r"`([^`]+)`", row) for e in expand(name)}


def glossary_gaps(emitted: set[str], glossary: set[str]) -> tuple[set[str], set[str]]:
    """(emitted but not explained, explained but never emitted); `*` matches one name part."""
    from fnmatch import fnmatchcase

    def covered(name, patterns):
        return any(fnmatchcase(name, p) or fnmatchcase(p, name) for p in patterns)

    return ({m for m in emitted if not covered(m, glossary)}, {g for g in glossary if not covered(g, emitted)})


def test_the_metrics_glossary_lists_every_logged_metric_and_only_those():
    missing, unknown = glossary_gaps(emitted_metrics(REPO), glossary_metrics((REPO / "README.md").read_text()))
    assert not missing, f"logged but missing from the README's metrics glossary: {sorted(missing)}"
    assert not unknown, f"in the README's metrics glossary but logged nowhere: {sorted(unknown)}"


def test_the_glossary_check_sees_a_missing_and_an_invented_metric():
    emitted = {"perf/step_s", "rollout/dropped_*_count", "tools/*/latency_s"}
    glossary = {"perf/step_s", "rollout/dropped_filtered_count", "tools/*/latency_s"}
    assert glossary_gaps(emitted, glossary) == (set(), set())
    assert glossary_gaps(emitted | {"perf/new_s"}, glossary | {"perf/invented_s"}) == ({"perf/new_s"},
                                                                                       {"perf/invented_s"})
    assert expand("a/{x,y}_s") == ["a/x_s", "a/y_s"] and expand("r/{fn}/mean") == ["r/*/mean"]


def test_a_new_metric_of_any_name_is_seen():
    """A loss's new metric under a new prefix, a bare one merged in, one set by key, one in (name, value) items."""
    source = """
def my_loss(inputs, opts):
    metrics = {"kl/mean": 0.0}
    metrics["my_penalty"] = 1.0
    return LossOutput(terms, "token", kept, metrics | {"my_bonus": 2.0} | standard_metrics(x))

def my_metrics(group):
    items = [("my_group_stat", 1.0)]
    return items + [(f"my_tool/{name}/calls", 1) for name in group]

config = {"model_config": {"dtype": "bf16"}, "world_size": 1}
"""
    assert metric_names_in(source) == {"kl/mean", "my_penalty", "my_bonus", "my_group_stat",
                                       "my_tool/{x}/calls"}
    missing, _ = glossary_gaps({e for n in metric_names_in(source) for e in expand(n)}, {"kl/mean"})
    assert missing == {"my_penalty", "my_bonus", "my_group_stat", "my_tool/*/calls"}
