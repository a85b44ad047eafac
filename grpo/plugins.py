"""Plug-in modules: importing a module is what registers its losses, advantage estimators and batch transforms.

The built-in ones are listed in `BUILTIN_MODULES`; a fork adds its own without editing the core by naming modules
in `$GRPO_PLUGIN_MODULES` (comma separated, importable from PYTHONPATH). `$GRPO_LOSS_MODULES`, the earlier name, is
read too (an alias: both lists are imported). Set it before `grpo.config` is imported: the CLI's `loss:NAME` and
`advantage:NAME` subcommands are built from the registries at that import.
"""

from __future__ import annotations

import os

PLUGIN_MODULES_ENV = "GRPO_PLUGIN_MODULES"
"""Environment variable naming extra modules (comma separated) whose registrations join the registries, CLI, tests."""
LEGACY_PLUGIN_MODULES_ENV = "GRPO_LOSS_MODULES"
"""The earlier name of PLUGIN_MODULES_ENV, still read."""
BUILTIN_MODULES = ("grpo.score_centering", "grpo.clipped_losses", "grpo.importance_sampling",
                   "grpo.group_estimators", "grpo.pass_at_k", "grpo.batch_std")
"""Modules whose import registers the built-in losses (score centering first: it is the default) and estimators."""


def plugin_modules() -> list[str]:
    """The extra modules named by $GRPO_PLUGIN_MODULES and $GRPO_LOSS_MODULES, in that order, without repeats."""
    names: list[str] = []
    for var in (PLUGIN_MODULES_ENV, LEGACY_PLUGIN_MODULES_ENV):
        for name in os.environ.get(var, "").split(","):
            if name.strip() and name.strip() not in names:
                names.append(name.strip())
    return names


def import_plugins() -> None:
    """Import the built-in modules and every plug-in module (already imported ones cost nothing)."""
    from grpo.imports import resolve_import

    for module in (*BUILTIN_MODULES, *plugin_modules()):
        resolve_import(f"{module}:__name__", f"plug-in (${PLUGIN_MODULES_ENV})")
