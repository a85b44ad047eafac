"""The order of train.py's argv: a variadic flag's values must not swallow a subcommand.

tyro (through argparse) gives a tuple flag such as `--advantage-batch-transforms` or `--reward-funcs` every token up
to the next flag, so in `--advantage-batch-transforms batch_std loss:dr_grpo advantage:no_std` the flag takes
`loss:dr_grpo` as a transform name and fails ("invalid choice"), and tyro reads root flags only before the first
subcommand. `hoist_variadic_flags` puts the config's variadic flags (wherever they stand) first, then the other
root flags (which end them), then the subcommands with their own `--loss.*` / `--advantage.*` options: the order of
two occurrences of one flag is kept, so the last still wins, and the natural orders parse as written.
"""

from __future__ import annotations

import dataclasses
import types
import typing

SUBCOMMAND_PREFIXES = ("loss:", "advantage:")
"""The config's subcommands (`loss:NAME`, `advantage:NAME`); no value of a variadic flag starts with these."""


HELP = ("-h", "--help")


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
    """argv with the config's variadic flags (with their values) first, then its other root flags, then the
    subcommands with their own options; `--seed DEFAULT` ends the last variadic flag when no other root flag does."""
    if not any(is_subcommand(t) for t in argv):
        return list(argv)
    flags = variadic_flags(cls)
    variadic, root, rest, i = [], [], [], 0
    in_subcommand = False
    while i < len(argv):
        token = argv[i]
        in_subcommand = in_subcommand or is_subcommand(token)
        own = token.startswith(tuple("--" + p.replace(":", ".") for p in SUBCOMMAND_PREFIXES)) or token in HELP
        if token.startswith("--") and not own:  # a root flag wherever it stands (tyro wants it before the first
            j = i + 1  # subcommand); its values end at the next flag or subcommand
            while j < len(argv) and not argv[j].startswith("--") and not is_subcommand(argv[j]):
                j += 1
            (variadic if token.split("=")[0] in flags else root).extend(argv[i:j])
            i = j
            continue
        (rest if in_subcommand else root).append(token)
        i += 1
    if variadic and not root and "seed" in {f.name for f in dataclasses.fields(cls)}:
        root = ["--seed", str(next(f.default for f in dataclasses.fields(cls) if f.name == "seed"))]
    return variadic + root + rest
