"""Scenario bookkeeping for the fault suite: a deadline around every blocking call (a hang is a failure of its
own kind), a check that an error names its cause and its fix (an error that does not is "silent"), and the prompt
audit over `trained_prompts.jsonl` / `dropped_prompts.jsonl` (lost = a position below the final resume point
neither trained nor recorded as dropped; twice = trained in two runs), and the same audit per sample."""

from __future__ import annotations

import json
import threading
from pathlib import Path

SCORE = {"scenarios": 0, "passed": 0, "hangs": 0, "silent": 0, "lost": 0, "twice": 0}
SOAK_LINES: list[str] = []
"""The soak's audit lines, printed after the fault-suite line (conftest.py)."""

FIX_WORDS = ("restart", "start the server", "add ", "check", "set ", "pass ", "use ", "raise ", "put ", "define",
             "give ", "rename", "shorten", "lower", "wrap", "pick ", "make ", "py-spy", "--")


class Hang(AssertionError):
    """A scenario did not end within its deadline."""


class Silent(AssertionError):
    """An error that does not name its cause and its fix (or no error where one was due)."""


def within(seconds: float, fn, *args, **kwargs):
    """Run fn in a thread; its result or exception, or Hang after `seconds` (the thread is abandoned)."""
    box: dict = {}

    def run():
        try:
            box["value"] = fn(*args, **kwargs)
        except BaseException as exc:  # handed to the caller
            box["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        raise Hang(f"{getattr(fn, '__name__', fn)} did not end within {seconds:.0f} s")
    if "error" in box:
        raise box["error"]
    return box.get("value")


def named_error(seconds: float, fn, *needles: str, expected=Exception, **kwargs) -> BaseException:
    """fn must raise `expected` within `seconds`, with every needle and a fix in its message."""
    try:
        within(seconds, fn, **kwargs)
    except Hang:
        raise
    except expected as exc:
        text = "".join(str(e) for e in _chain(exc)).lower()
        missing = [n for n in needles if n.lower() not in text]
        if missing or not any(w in text for w in FIX_WORDS):
            raise Silent(f"error does not name {missing or 'a fix'}: {type(exc).__name__}: {exc}") from exc
        return exc
    raise Silent(f"{getattr(fn, '__name__', fn)} returned without the expected {expected}")


def _chain(exc: BaseException):
    while exc is not None:
        yield exc
        yield from getattr(exc, "__notes__", [])
        exc = exc.__cause__ or exc.__context__


def _effective(path: Path) -> list[dict]:
    """Records in file order, tagged with a run number; when a new run starts, the records of earlier runs after
    the step it resumed from are dropped (that training was rolled back with the model)."""
    kept: list[dict] = []
    if not path.exists():
        return kept
    current, run = None, -1
    for line in path.read_text().splitlines():
        record = json.loads(line)
        if record.get("run") != current:
            current, run = record.get("run"), run + 1
            kept = [r for r in kept if r["step"] <= record.get("resumed_from", 0)]
        kept.append(record | {"run": run})
    return kept


def audit(out_dir: Path, resume_point: int) -> dict:
    """Positions below `resume_point` (the final low-water mark) trained in exactly one run or dropped. A prompt
    may be trained in a later run only through samples carried from the earlier one (the rest of a partly trained
    group, docs/reliability.md); a sample generated anew for a prompt an earlier run trained is "twice"."""
    trained: dict[int, set[int]] = {}
    fresh: dict[int, set[int]] = {}  # position -> runs that trained samples they generated themselves
    for record in _effective(out_dir / "trained_prompts.jsonl"):
        for position in record["prompts"]:
            trained.setdefault(position, set()).add(record["run"])
        named = record.get("samples")
        for position in (record["prompts"] if named is None else [e[0] for e in named if not e[3:] or not e[3]]):
            fresh.setdefault(position, set()).add(record["run"])
    dropped = {p for record in _effective(out_dir / "dropped_prompts.jsonl") for p, _ in record["prompts"]}
    twice = sorted(p for p, runs in trained.items()
                   if len(fresh.get(p, set())) > 1 or (fresh.get(p) and min(runs) < min(fresh[p])))
    lost = sorted(p for p in range(resume_point) if p not in trained and p not in dropped)
    SCORE["twice"] += len(twice)
    SCORE["lost"] += len(lost)
    return {"trained": sorted(trained), "dropped": sorted(dropped), "twice": twice, "lost": lost}


def audit_samples(out_dir: Path, resume_point: int) -> dict:
    """Per sample (docs/reliability.md): twice = a sample trained in two steps that both stand, or a prompt with
    more samples trained than its group had (generated twice); lost = a prompt below `resume_point`, not dropped,
    with fewer samples trained than its group had (a partial group's rest never trained)."""
    seen: dict[str, int] = {}
    per_position: dict[int, set[str]] = {}
    sizes: dict[int, int] = {}
    carried = 0  # samples a resumed run trained from its checkpoint's carried partial groups
    for record in _effective(out_dir / "trained_prompts.jsonl"):
        for position, key, size, *flags in record.get("samples", []):
            carried += bool(flags and flags[0])
            seen[key] = seen.get(key, 0) + 1
            per_position.setdefault(position, set()).add(key)
            sizes[position] = size
    dropped = {p for record in _effective(out_dir / "dropped_prompts.jsonl") for p, _ in record["prompts"]}
    twice = sorted(k for k, n in seen.items() if n > 1)
    twice += [f"prompt {p}: {len(keys)} samples of a group of {sizes[p]}" for p, keys in sorted(per_position.items())
              if sizes[p] and len(keys) > sizes[p]]
    lost = sorted(p for p, keys in per_position.items()
                  if p < resume_point and p not in dropped and sizes[p] and len(keys) < sizes[p])
    SCORE["twice"] += len(twice)
    SCORE["lost"] += len(lost)
    return {"trained": len(seen), "twice": twice, "lost": lost, "carried": carried}
