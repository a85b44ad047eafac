"""Advantage estimators and per-step batch transforms: two registries, each entry with its own options dataclass.

An estimator is a pure function `fn(group: AdvantageGroup, options) -> advantages [G]` over one prompt group:
its rewards, completion lengths, trained tokens, turns and prompt id (rollouts whose reward is NaN, unscorable, are
taken out before it and get advantage 0). It runs in the rollout worker. Select one with
`advantage:NAME --advantage.OPTION VALUE` on the CLI or `advantage=Options(...)` (or the registered name) in Python;
add one with `@register_estimator("name", Options())` in a module named by $GRPO_PLUGIN_MODULES (grpo/plugins.py).
The earlier form `fn(rewards [G], options)` (first parameter named `rewards`) is still accepted.

A batch transform sees every rollout of one optimizer step (all micro-batches, all ranks' rows) as an
`AdvantageBatch` (the same per-rollout fields, plus the group of each) and returns new advantages [N]; it runs in
the trainer on every rank (each holds the whole step's plan), after the estimator. Add one with
`@register_batch_transform("name", Options())` over `fn(batch, options)`, or over a class built once per run as
`Cls(options)` whose instances are called `(batch)` (state across steps, e.g. an EMA). Select with
`--advantage-batch-transforms NAME ...`, set its options with `--transform.NAME.OPTION VALUE` (one nested group per
registered transform, shown in `--help`); in Python, an options instance may stand in the tuple for its name.

Options (of either kind) may define `check(config)` or `check(config, inputs)`; `inputs` is the run's resolved
`RunInputs` (the Python API's `loop_cls`, datasets, reward functions), checked before any model loads. Class
attributes declare what the test kit (grpo/advantage_kit.py) may expect: `equal_rewards_give_zero` (estimators,
default True), `keeps_zero_advantages` (transforms, default True). DAPO's overlong reward shaping is applied before
the estimator when `overlong_buffer_length > 0`. docs/losses.md has the recipes.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, field, make_dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np

ESTIMATORS: dict[str, Any] = {}
"""Registered estimators: name -> default options instance."""
ESTIMATOR_DESCRIPTIONS: dict[str, str] = {}
_ESTIMATOR_FNS: dict[type, Callable] = {}
BATCH_TRANSFORMS: dict[str, Any] = {}
"""Registered batch transforms: name -> default options instance."""
BATCH_TRANSFORM_DESCRIPTIONS: dict[str, str] = {}
_TRANSFORM_OBJS: dict[type, tuple[Callable, bool]] = {}  # options class -> (function or class, takes options)
STD_EPS = 1e-8
"""Added to the group std before dividing (a group of equal rewards has std 0)."""


def _first_line(obj: Any, fallback: str) -> str:
    return (inspect.getdoc(obj) or fallback).strip().splitlines()[0]


def _empty_options(name: str, kind: str) -> Any:
    cls = make_dataclass(f"{name.title().replace('_', '')}{kind.title()}Options", [], frozen=True)
    cls.__doc__ = f"Options of the {name} {kind} (none)."
    globals()[cls.__name__] = cls  # importable by name: a config holding it is pickled into the rollout worker
    return cls()


def _claim(registry: dict, name: str, kind: str) -> None:
    if name in registry:
        raise ValueError(f"advantage {kind} {name!r} is already registered")
    if kind == "batch transform" and not name.isidentifier():
        raise ValueError(f"advantage {kind} name {name!r} must be a Python identifier: it names the config field "
                         f"of its options (`--transform.NAME.OPTION`)")


# ---- what an estimator sees: one group -------------------------------------------------------------------------

@dataclass(frozen=True, eq=False)
class AdvantageGroup:
    """One prompt group's scored rollouts (G of them); every array has one entry per rollout."""

    rewards: np.ndarray  # [G] float64 total reward (overlong shaping applied)
    completion_lengths: np.ndarray  # [G] int64 generated tokens over all turns (tool results not counted)
    trained_tokens: np.ndarray  # [G] int64 tokens the trainer trains (over the rollout's training samples)
    turns: np.ndarray  # [G] int64 sampling requests of the rollout
    prompt_id: int = -1
    """Dataset row index of the prompt (-1: not from a dataset, e.g. a test)."""

    @classmethod
    def of(cls, rewards, completion_lengths=None, trained_tokens=None, turns=None, prompt_id: int = -1):
        """A group from rewards alone or with some of the other fields (absent: lengths 0, one turn each)."""
        import numpy as np

        rewards = np.asarray(rewards, dtype=np.float64)
        ints = lambda v, d: np.full(len(rewards), d, np.int64) if v is None else np.asarray(v, np.int64)  # noqa: E731
        return cls(rewards, ints(completion_lengths, 0), ints(trained_tokens, 0), ints(turns, 1), prompt_id)

    def subset(self, keep: np.ndarray) -> AdvantageGroup:
        return AdvantageGroup(self.rewards[keep], self.completion_lengths[keep], self.trained_tokens[keep],
                              self.turns[keep], self.prompt_id)

    def __len__(self) -> int:
        return len(self.rewards)


def register_estimator(name: str, options: Any = None, description: str | None = None):
    """Decorator: `fn(group: AdvantageGroup, options)` estimates advantages for `type(options)`, selected as
    `advantage:name`. Also accepted: `fn(rewards, options)` (first parameter named `rewards`) and, without
    options, `fn(rewards)` (an empty options class is made for it)."""

    def add(fn: Callable) -> Callable:
        _claim(ESTIMATORS, name, "estimator")
        opts, call = options, fn
        if opts is None:
            opts = _empty_options(name, "estimator")
            call = lambda group, _options: fn(group.rewards)  # noqa: E731
        elif next(iter(inspect.signature(fn).parameters), None) == "rewards":
            call = lambda group, o: fn(group.rewards, o)  # noqa: E731
        cls = type(opts)
        if cls in _ESTIMATOR_FNS:
            raise ValueError(f"options class {cls.__name__} already belongs to another estimator; give {name!r} its "
                             f"own options dataclass")
        _ESTIMATOR_FNS[cls] = call
        ESTIMATORS[name] = opts
        ESTIMATOR_DESCRIPTIONS[name] = description or _first_line(fn, name)
        return fn

    return add


def register_batch_transform(name: str, options: Any = None, description: str | None = None):
    """Decorator: `fn(batch: AdvantageBatch, options) -> advantages [N]`, or a class built once per run as
    `Cls(options)` whose instances are called `(batch)`; selected by `--advantage-batch-transforms name`, options
    `--transform.name.OPTION`. Without options (the earlier form): `fn(batch)` or `Cls()`."""

    def add(obj: Callable) -> Callable:
        _claim(BATCH_TRANSFORMS, name, "batch transform")
        opts = _empty_options(name, "transform") if options is None else options
        if type(opts) in _TRANSFORM_OBJS:
            raise ValueError(f"options class {type(opts).__name__} already belongs to another batch transform; give "
                             f"{name!r} its own options dataclass")
        _TRANSFORM_OBJS[type(opts)] = (obj, options is not None)
        BATCH_TRANSFORMS[name] = opts
        BATCH_TRANSFORM_DESCRIPTIONS[name] = description or _first_line(obj, name)
        return obj

    return add


def registered_estimators() -> dict[str, Any]:
    """Every registered estimator: the built-in modules plus the plug-in modules (grpo/plugins.py)."""
    from grpo.plugins import import_plugins

    import_plugins()
    return ESTIMATORS


def registered_batch_transforms() -> dict[str, Any]:
    """Every registered batch transform: name -> default options."""
    from grpo.plugins import import_plugins

    import_plugins()
    return BATCH_TRANSFORMS


def estimator_options(value: Any) -> Any:
    """An options instance from an instance, a registered name, or `pkg.module:OptionsClass`; errors name the fix."""
    estimators = registered_estimators()
    if isinstance(value, str):
        if value in estimators:
            return estimators[value]
        if ":" not in value:
            raise ValueError(f"unknown advantage estimator {value!r}: use one of {sorted(estimators)} "
                             f"(`advantage:NAME` on the CLI), or register yours (docs/losses.md)")
        from grpo.imports import resolve_import

        value = resolve_import(value, "advantage estimator")()
    if type(value) not in _ESTIMATOR_FNS:
        raise ValueError(f"no advantage estimator is registered for options {type(value).__name__}; decorate its "
                         f"function with @register_estimator(name, {type(value).__name__}()) in a plug-in module")
    return value


def estimator_name(options: Any) -> str:
    """The registered name whose options class is `type(options)` (the first one)."""
    return next((n for n, o in registered_estimators().items() if type(o) is type(options)), type(options).__name__)


def transform_name(options: Any) -> str:
    """The registered name of a batch transform's options."""
    return next((n for n, o in registered_batch_transforms().items() if type(o) is type(options)),
                type(options).__name__)


def transform_options(entries: Any, per_name: Any = None) -> list[Any]:
    """The options of each selected transform, in order: a name takes `per_name.<name>` (the config's `transform`
    group: the CLI's `--transform.NAME.OPTION` values) or the registered default; an options instance is itself."""
    transforms = registered_batch_transforms()
    entries = (entries,) if isinstance(entries, str) or not isinstance(entries, (tuple, list)) else entries
    out = []
    for entry in entries:
        if isinstance(entry, str):
            if entry not in transforms:
                raise ValueError(f"unknown advantage batch transform {entry!r}: use one of {sorted(transforms)}, or "
                                 f"register yours with @register_batch_transform (docs/losses.md)")
            out.append(getattr(per_name, entry, transforms[entry]))
        elif type(entry) in _TRANSFORM_OBJS:
            out.append(entry)
        else:
            raise ValueError(f"advantage_batch_transforms entry {entry!r} is neither a registered name "
                             f"({sorted(transforms)}) nor the options of one (@register_batch_transform)")
    return out


def _run_check(options: Any, config, inputs) -> None:
    """options.check(config) always; options.check(config, inputs) once the run's inputs are resolved."""
    check = getattr(options, "check", None)
    if check is None:
        return
    if len(inspect.signature(check).parameters) >= 2:
        if inputs is not None:
            check(config, inputs)
    else:
        check(config)


def check_advantage_config(config, inputs=None) -> None:
    """At start, before any model loads: the estimator and the batch transforms exist and accept the run. `inputs`
    (grpo.inputs.RunInputs, once resolved) reaches the options' two-argument `check(config, inputs)`."""
    _run_check(estimator_options(config.advantage), config, inputs)
    for options in transform_options(config.advantage_batch_transforms, getattr(config, "transform", None)):
        _run_check(options, config, inputs)


def overlong_penalty(lengths: np.ndarray, max_length: int, buffer: int, factor: float) -> np.ndarray:
    """DAPO soft overlong punishment (arXiv 2503.14476 eq. 13): 0 up to max - buffer, then linear down to
    -factor at max_length (and beyond)."""
    import numpy as np

    if buffer <= 0:
        return np.zeros(len(lengths), dtype=np.float64)
    excess = np.asarray(lengths, dtype=np.float64) - (max_length - buffer)
    return -factor * np.clip(excess / buffer, 0.0, 1.0)


def estimate_advantages(estimator: Any, group: Any, lengths: np.ndarray | None = None, max_length: int = 0,
                        overlong_buffer: int = 0, overlong_factor: float = 1.0) -> np.ndarray:
    """Advantages [G] of one group (an AdvantageGroup, or its rewards with `lengths` the completion lengths) by the
    estimator (options instance or registered name); NaN rewards get 0 and are left out of the statistics."""
    import dataclasses

    import numpy as np

    options = estimator_options(estimator)
    if not isinstance(group, AdvantageGroup):
        group = AdvantageGroup.of(group, lengths)
    if overlong_buffer > 0:
        shaped = group.rewards + overlong_penalty(group.completion_lengths, max_length, overlong_buffer,
                                                  overlong_factor)
        group = dataclasses.replace(group, rewards=shaped)
    advantages = np.zeros_like(group.rewards)
    scored = ~np.isnan(group.rewards)
    if scored.any():
        advantages[scored] = _ESTIMATOR_FNS[type(options)](group.subset(scored), options)
    return advantages


# ---- the per-step batch transform hook --------------------------------------------------------------------------

@dataclass
class AdvantageBatch:
    """One optimizer step's rollouts (N), each once (a multi-turn rollout's several samples share one entry)."""

    advantages: np.ndarray  # [N] from the estimator (or the previous transform)
    rewards: np.ndarray  # [N] total reward (NaN = unscored)
    group_ids: np.ndarray  # [N] prompt group of each rollout
    step: int  # the optimizer step being built (1-based)
    completion_lengths: np.ndarray = field(default=None)  # [N] generated tokens over all turns
    trained_tokens: np.ndarray = field(default=None)  # [N] trained tokens over the rollout's samples in this step
    turns: np.ndarray = field(default=None)  # [N] sampling requests of the rollout
    prompt_ids: np.ndarray = field(default=None)  # [N] dataset row index of each rollout's prompt

    def __post_init__(self) -> None:
        import numpy as np

        n = len(self.advantages)
        for name, default in (("completion_lengths", 0), ("trained_tokens", 0), ("turns", 1), ("prompt_ids", -1)):
            value = getattr(self, name)
            setattr(self, name, np.full(n, default, np.int64) if value is None else np.asarray(value, np.int64))


class _BoundTransform:
    """A registered transform with its options: `(batch) -> advantages [N]`; a class is built here, once."""

    def __init__(self, options: Any):
        obj, takes_options = _TRANSFORM_OBJS[type(options)]
        self.name, self.options = transform_name(options), options
        if isinstance(obj, type):
            self.call = obj(options) if takes_options else obj()
        else:
            self.call = (lambda batch: obj(batch, options)) if takes_options else obj

    def __call__(self, batch: AdvantageBatch):
        return self.call(batch)

    def __repr__(self) -> str:
        return f"{self.name}({self.options!r})"


def batch_transforms(entries: Any, per_name: Any = None) -> list[Callable]:
    """The selected transforms bound to their options, in order (a class is instantiated once, here). `entries`:
    names or options instances; `per_name`: the config's `transform` group (options by name)."""
    return [_BoundTransform(options) for options in transform_options(entries, per_name)]


def apply_batch_transforms(transforms: list[Callable], samples: list, step: int) -> int:
    """Rewrite `sample.advantage` of the step's training samples (padding samples, group_id < 0, left out) by each
    transform in turn; returns the number of rollouts seen. Every rank calls it on the same samples."""
    import numpy as np

    if not transforms:
        return 0
    index: dict[tuple, int] = {}
    firsts, trained = [], []
    for sample in samples:
        if sample.group_id < 0:
            continue
        key = (sample.group_id, sample.rollout_id)
        if key not in index:
            index[key] = len(firsts)
            firsts.append(sample)
            trained.append(0)
        trained[index[key]] += sample.num_trained
    if not firsts:
        return 0
    batch = AdvantageBatch(advantages=np.array([s.advantage for s in firsts], dtype=np.float64),
                           rewards=np.array([s.reward for s in firsts], dtype=np.float64),
                           group_ids=np.array([s.group_id for s in firsts]), step=step,
                           completion_lengths=[getattr(s, "completion_length", 0) for s in firsts],
                           trained_tokens=trained, turns=[getattr(s, "turns", 1) for s in firsts],
                           prompt_ids=[s.row_index for s in firsts])
    for transform in transforms:
        new = np.asarray(transform(batch), dtype=np.float64)
        if new.shape != batch.advantages.shape or not np.isfinite(new).all():
            raise ValueError(f"advantage batch transform {transform!r} returned shape {new.shape} with "
                             f"{int((~np.isfinite(new)).sum())} non-finite values; it must return [N] finite values "
                             f"(N = {len(firsts)} rollouts)")
        batch.advantages = new
    for sample in samples:
        if sample.group_id >= 0:
            sample.advantage = float(batch.advantages[index[(sample.group_id, sample.rollout_id)]])
    return len(firsts)


def estimator_cli_union() -> Any:
    """The tyro type of the `advantage` field: one `advantage:<name>` subcommand per registered estimator."""
    from typing import Annotated, Union

    import tyro

    members = tuple(Annotated[type(options), tyro.conf.subcommand(name, default=options,
                                                                  description=ESTIMATOR_DESCRIPTIONS[name])]
                    for name, options in registered_estimators().items())
    return Union[members]  # noqa: UP007 (a runtime-built union)


def batch_transform_cli_type() -> Any:
    """The tyro type of `advantage_batch_transforms`: the registered names, each described in --help."""
    from typing import Annotated, Literal

    import tyro

    names = tuple(registered_batch_transforms())
    described = "; ".join(f"{n}: {BATCH_TRANSFORM_DESCRIPTIONS[n].rstrip('.')}" for n in names)
    text = (f"Per-step transforms of the advantages over every rollout of the step (all ranks), applied in order "
            f"after the estimator; options: --transform.NAME.OPTION. Registered: {described or 'none'}")
    return Annotated[tuple[Literal[names], ...] if names else tuple[str, ...], tyro.conf.arg(help=text)]


def transform_options_class(module: str) -> type:
    """The config's `transform` group: one field per registered transform, holding its options (its defaults);
    on the CLI `--transform.NAME.OPTION VALUE`, each field described by the transform's docstring. `module` must
    bind the class as `TransformOptions` (a config crosses into the spawned rollout worker by pickle)."""
    from typing import Annotated

    import tyro

    fields = [(name, Annotated[type(opts), tyro.conf.arg(help=BATCH_TRANSFORM_DESCRIPTIONS[name])],
               field(default=opts)) for name, opts in registered_batch_transforms().items()]
    cls = make_dataclass("TransformOptions", fields, frozen=True)
    cls.__doc__ = "Options of every registered advantage batch transform, by name (used when the name is selected)."
    cls.__module__ = module
    return cls
