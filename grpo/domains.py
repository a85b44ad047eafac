"""Config domains: what values each config field accepts, checked in one place before anything starts.

Every field of `AsyncGRPOConfig` is given a `Domain` in `grpo/config.py` (`FIELD_DOMAINS`, beside the fields);
`check_config` walks every field of the config's class against it, then the `CrossRule`s that tie two fields
together, and raises one `ConfigValueError` listing every bad value with its flag and the fix. A value outside the
ordinary range is accepted only where the domain names its meaning (`special`, e.g. `max_steps=-1` = stop by
epochs), and that meaning is written in the field's docstring (tests/test_config_domains.py sweeps every numeric
field with 0, -1, NaN and a huge value, and a field without a domain fails it).
"""

from __future__ import annotations

import dataclasses
import math
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

MAX_WAIT_S = 1e9
"""Upper bound of every duration field: `threading` waits overflow past ~9.2e9 s (31 years is already forever)."""


class ConfigValueError(ValueError):
    """Config values outside their domains; `fields` names them (each line of the message names the fix)."""

    def __init__(self, problems: list[tuple[str, Any, str]]):
        self.fields = tuple(name for name, _, _ in problems)
        lines = "\n".join(f"  {flag(name)} {value!r}: {text}" for name, value, text in problems)
        super().__init__(f"{len(problems)} config value(s) out of range, checked before anything starts:\n{lines}")


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


@dataclass(frozen=True)
class Domain:
    """Base: `problem(value, config)` -> None when accepted, else what is wrong and what to pass instead."""

    none: str | None = None
    """Meaning of None; None = the field does not take None."""
    hint: str = ""
    """Why the range is what it is, appended to the error (e.g. what temperature 0 would do to a group)."""

    def problem(self, value: Any, config: Any) -> str | None:
        if value is None:
            text = None if self.none is not None else f"None is not accepted; {self.describe()}"
        else:
            text = self.value_problem(value, config)
        return f"{text} ({self.hint})" if text and self.hint else text

    def value_problem(self, value: Any, config: Any) -> str | None:
        return None

    def meaning(self, value: Any) -> str | None:
        """The documented meaning of a special value (None: an ordinary value of the range)."""
        return self.none if value is None else None

    def describe(self) -> str:
        return "any value"


@dataclass(frozen=True)
class Num(Domain):
    """A finite int or float in [lo, hi] (open ends with `lo_open` / `hi_open`), or one of `special`'s values."""

    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False
    hi_open: bool = False
    integer: bool = False
    special: dict = field(default_factory=dict)
    """value -> its meaning (documented in the field's docstring); e.g. {0: "off"}."""

    def value_problem(self, value: Any, config: Any) -> str | None:
        if isinstance(value, bool) or not isinstance(value, int | float):
            return f"a {type(value).__name__}; {self.describe()}"
        if value in self.special:
            return None
        if self.integer and not isinstance(value, int):
            return f"not an integer; {self.describe()}"
        if not math.isfinite(value):
            return self.describe()
        below = self.lo is not None and (value <= self.lo if self.lo_open else value < self.lo)
        above = self.hi is not None and (value >= self.hi if self.hi_open else value > self.hi)
        return self.describe() if below or above else None

    def meaning(self, value: Any) -> str | None:
        if value is None:
            return self.none
        return self.special.get(value) if not isinstance(value, bool) and isinstance(value, int | float) else None

    def describe(self) -> str:
        lo = "" if self.lo is None else f"{self.lo:g} {'<' if self.lo_open else '<='} "
        hi = "" if self.hi is None else f" {'<' if self.hi_open else '<='} {self.hi:g}"
        kind = "an integer" if self.integer else "a finite number"
        text = f"pass {kind} with {lo}value{hi}" if lo or hi else f"pass {kind}"
        extra = [f"{k} = {v}" for k, v in self.special.items()] + ([f"None = {self.none}"] if self.none else [])
        return text + (f" ({'; '.join(extra)})" if extra else "")


@dataclass(frozen=True)
class Text(Domain):
    """A non-empty string."""

    def value_problem(self, value: Any, config: Any) -> str | None:
        if not isinstance(value, str) or not value.strip():
            return self.describe()
        return None

    def describe(self) -> str:
        return "pass a non-empty string" + (f" (None = {self.none})" if self.none else "")


@dataclass(frozen=True)
class Texts(Domain):
    """A tuple (or list) of non-empty strings."""

    def value_problem(self, value: Any, config: Any) -> str | None:
        if isinstance(value, str) or not isinstance(value, tuple | list) or \
                not all(isinstance(v, str) and v.strip() for v in value):
            return self.describe()
        return None

    def describe(self) -> str:
        return "pass a list of non-empty strings" + (f" (None = {self.none})" if self.none else "")


@dataclass(frozen=True)
class Flag(Domain):
    """True or False."""

    def value_problem(self, value: Any, config: Any) -> str | None:
        return None if isinstance(value, bool) else self.describe()

    def describe(self) -> str:
        return "pass true or false" + (f" (None = {self.none})" if self.none else "")


@dataclass(frozen=True)
class Choice(Domain):
    """One of the `Literal` values of the field's annotation (each element of a tuple, for a tuple of them)."""

    values: tuple = ()

    def value_problem(self, value: Any, config: Any) -> str | None:
        items = value if isinstance(value, tuple | list) else (value,)
        bad = [v for v in items if v not in self.values]
        return self.describe() if bad else None

    def describe(self) -> str:
        return f"pass one of {', '.join(map(str, self.values))}"


@dataclass(frozen=True)
class Checked(Domain):
    """A field whose value is checked by the code that owns it (`check(value, config)` raises ValueError naming the
    fix): the loss and estimator options, the URLs, the batch transforms."""

    check: Callable[[Any, Any], None] | None = None
    what: str = ""

    def value_problem(self, value: Any, config: Any) -> str | None:
        if self.check is None:
            return None
        try:
            self.check(value, config)
        except (ValueError, TypeError) as exc:
            return str(exc)
        return None

    def describe(self) -> str:
        return self.what


LITERAL = Choice()
"""Placeholder: the values come from the field's `Literal[...]` annotation (`domains_of` fills them in)."""


@dataclass(frozen=True)
class CrossRule:
    """A rule between fields: `problem(config)` -> what is wrong and the fix, or None; `fields` are named."""

    fields: tuple[str, ...]
    problem: Callable[[Any], str | None]


def literal_values(annotation: Any) -> tuple:
    """The values of a `Literal[...]` annotation, also inside `tuple[Literal[...], ...]` or `X | None`."""
    if typing.get_origin(annotation) is typing.Literal:
        return typing.get_args(annotation)
    return tuple(v for arg in typing.get_args(annotation) for v in literal_values(arg))


def domains_of(cls: type) -> dict[str, Domain]:
    """Field name -> Domain for every field of `cls` that has one: the `FIELD_DOMAINS` of `cls` and of each base
    class (a subclass adds its own table), `LITERAL` resolved from the annotation."""
    table: dict[str, Domain] = {}
    for klass in reversed(cls.__mro__):
        table |= vars(klass).get("FIELD_DOMAINS", {})
    hints = typing.get_type_hints(cls)
    return {name: (Choice(values=literal_values(hints[name]), none=d.none) if d is LITERAL else d)
            for name, d in table.items()}


def check_config(config: Any, base: type) -> list[str]:
    """Every field against its domain, then the cross-field rules: one `ConfigValueError` naming every bad value.
    A field of `base` without a domain is an error (its author forgot to declare one); a subclass's own fields
    without one (a `FIELD_DOMAINS` class attribute on the subclass) are returned, unchecked, for a log line."""
    table = domains_of(type(config))
    base_fields = {f.name for f in dataclasses.fields(base)}
    problems, unchecked = [], []
    for f in dataclasses.fields(config):
        domain = table.get(f.name)
        if domain is None and f.name in base_fields:
            problems.append((f.name, getattr(config, f.name), f"has no declared domain; add it to "
                             f"{base.__name__}.FIELD_DOMAINS (grpo/config.py, domain kinds in grpo/domains.py)"))
            continue
        if domain is None:
            unchecked.append(f.name)
            continue
        text = domain.problem(getattr(config, f.name), config)
        if text:
            problems.append((f.name, getattr(config, f.name), text))
    bad = {name for name, _, _ in problems}
    for rule in getattr(type(config), "CROSS_RULES", ()):
        if not bad & set(rule.fields) and (text := rule.problem(config)):  # each field in range first
            problems.append((rule.fields[0], getattr(config, rule.fields[0]), text))
    if problems:
        raise ConfigValueError(problems)
    return unchecked


# ---- AsyncGRPOConfig's compound fields and cross-field rules (used by its FIELD_DOMAINS / CROSS_RULES) -------------
def server_urls(value, config) -> None:
    config.vllm_server_urls  # raises ValueError naming the fix


def hsdp(value, config) -> None:
    if value != "auto" and not (isinstance(value, str) and value.isdigit() and int(value) >= 1):
        raise ValueError("pass 1 (plain FSDP2), auto (one replica per node) or a replica count N >= 1")


def loss_options(value, config) -> None:
    from grpo.losses import loss_function

    try:
        loss_function(value)
    except KeyError as exc:
        raise ValueError(str(exc)) from exc


def estimator(value, config) -> None:
    from grpo.advantages import estimator_options

    try:
        estimator_options(value)
    except KeyError as exc:
        raise ValueError(str(exc)) from exc


def chat_kwargs(value, config) -> None:
    if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
        raise ValueError("pass a mapping of apply_chat_template keyword names to values")


def budget_fits_a_sample(config) -> str | None:
    if config.token_budget is not None and config.token_budget <= config.max_completion_length:
        return (f"<= --max-completion-length {config.max_completion_length}: a sample (at least "
                f"one prompt token plus its completion) would not fit a row and be dropped; pass --token-budget above "
                f"max_completion_length (or leave it unset: the server's max_model_len)")
    return None


def buffer_inside_completion(config) -> str | None:
    if config.overlong_buffer_length >= config.max_completion_length:
        return (f">= --max-completion-length {config.max_completion_length}: the "
                f"penalty would start before the first token; pass a buffer shorter than max_completion_length")
    return None


def warmup_inside_steps(config) -> str | None:
    if 0 < config.max_steps < config.warmup_steps:
        return (f"> --max-steps {config.max_steps}: the run would end before the learning rate "
                f"reached its value; pass --warmup-steps <= max_steps")
    return None


def schedule_has_an_end(config) -> str | None:
    if config.lr_scheduler_type != "constant" and config.max_steps <= 0:
        return (f"decays over max_steps, which is unknown when the run stops by epochs; pass --max-steps N or "
                f"--lr-scheduler-type constant")
    return None
