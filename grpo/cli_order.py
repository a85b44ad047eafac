"""The order of train.py's argv: a variadic flag's values must not swallow a subcommand.

tyro (through argparse) gives a tuple flag such as `--advantage-batch-transforms` or `--reward-funcs` every token up
to the next flag, so in `--advantage-batch-transforms batch_std loss:dr_grpo advantage:no_std` the flag takes
`loss:dr_grpo` as a transform name and fails ("invalid choice"). `hoist_variadic_flags` moves such a flag, with
the values before the subcommand, to just before the first subcommand of argv (the root scope, after every other
root flag, so a later occurrence still wins over an earlier one): the natural order parses as written.
"""

from __future__ import annotations

import dataclasses
import types
import typing

SUBCOMMAND_PREFIXES = ("loss:", "advantage:")
"""The config's subcommands (`loss:NAME`, `advantage:NAME`); no value of a variadic flag starts with these."""


def variadic_flags(cls: type) -> set[str]:
    """`--field-name` (and `--field_name`) of every tuple-typed field of the config class."""
    hints = typing.get_type_hints(cls, include_extras=False)
    flags = set()
    for f in dataclasses.fields(cls):
        hint = hints.get(f.name)
        union = typing.get_origin(hint) in (typing.Union, types.UnionType)
        members = typing.get_args(hint) if union else (hint,)
        if any(typing.get_origin(m) is tuple or m is tuple for m in members):
            flags |= {"--" + f.name.replace("_", "-"), "--" + f.name}
    return flags


def is_subcommand(token: str) -> bool:
    return token.startswith(SUBCOMMAND_PREFIXES)


def hoist_variadic_flags(cls: type, argv: list[str]) -> list[str]:
    """argv with each variadic flag whose values run into a subcommand moved before the first subcommand."""
    if not any(is_subcommand(t) for t in argv):
        return list(argv)
    flags = variadic_flags(cls)
    kept, hoisted, i = [], [], 0
    while i < len(argv):
        token = argv[i]
        if token in flags:
            j = i + 1
            while j < len(argv) and not argv[j].startswith("-") and not is_subcommand(argv[j]):
                j += 1
            if j < len(argv) and is_subcommand(argv[j]):  # the values stop at a subcommand: move them
                hoisted += argv[i:j]
            else:
                kept += argv[i:j]
            i = j
            continue
        kept.append(token)
        i += 1
    first = next(k for k, t in enumerate(kept) if is_subcommand(t))
    return kept[:first] + hoisted + kept[first:]
