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
        raise ValueError(f"cannot import {kind} module {module_name!r} ({exc}); is it on PYTHONPATH?") from exc
    for part in attribute.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"{kind} {path!r}: {obj.__name__ if hasattr(obj, '__name__') else obj!r} has no "
                             f"attribute {part!r}")
        obj = getattr(obj, part)
    return obj
