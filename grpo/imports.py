"""Import paths `pkg.module:Name` -> objects: the one resolver behind every `--reward-funcs`, `--tools`,
`--environment-factory`, `--loop-cls` and loss/advantage plug-in on the command line."""

from __future__ import annotations

import importlib
from typing import Any


def resolve_import(path: str, kind: str = "object") -> Any:
    """`pkg.module:Name` (or `pkg.module:Outer.Inner`) -> the object; errors say what was looked for and where.

    `kind` names what the caller wanted (`reward`, `loss`, `tool`, ...) so the message points at the right flag.
    """
    module_name, sep, attribute = path.partition(":")
    if not sep or not module_name or not attribute:
        raise ValueError(f"{kind} import path {path!r} must look like 'pkg.module:Name'")
    try:
        obj = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(import_error_message(kind, module_name, exc)) from exc
    for part in attribute.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"{kind} {path!r}: {obj.__name__ if hasattr(obj, '__name__') else obj!r} has no "
                             f"attribute {part!r}")
        obj = getattr(obj, part)
    return obj


def import_error_message(kind: str, module_name: str, exc: ImportError) -> str:
    """The real cause: the module itself is missing (PYTHONPATH), or importing it failed inside (its own import of
    something missing, or a cycle), named with the file and line where it failed."""
    missing = getattr(exc, "name", None)
    if isinstance(exc, ModuleNotFoundError) and missing and module_name.startswith(missing):
        return f"cannot import {kind} module {module_name!r}: no module named {missing!r}; is it on PYTHONPATH?"
    where = _failing_line(exc, module_name)
    if "partially initialized module" in str(exc):
        return (f"importing {kind} module {module_name!r} failed{where}: {exc}. This is an import cycle: a plug-in "
                f"module is imported while grpo.config builds its CLI from the registries, so it must not import "
                f"grpo.config (or a module that does) at module level; import it inside the function that needs it, "
                f"or under `if TYPE_CHECKING:` for annotations")
    return f"importing {kind} module {module_name!r} failed{where}: {type(exc).__name__}: {exc}"


def _failing_line(exc: BaseException, module_name: str) -> str:
    """` at FILE:LINE` of the innermost frame of the traceback inside the plug-in's own file, if any."""
    import traceback

    frames = traceback.extract_tb(exc.__traceback__)
    tail = module_name.replace(".", "/") + ".py"
    own = [f for f in frames if f.filename.replace("\\", "/").endswith(tail)]
    frame = (own or frames[-1:] or [None])[-1]
    return f" at {frame.filename}:{frame.lineno}" if frame is not None else ""
