"""Advantage estimators and per-step batch transforms: two registries, each entry with its own options dataclass.

An estimator is a pure function `fn(rewards [G], options) -> advantages [G]` over the scored rewards of one prompt
group (NaN rewards, unscorable rollouts, are taken out before it and get advantage 0). It runs in the rollout
worker. Select one with `advantage:NAME --advantage.OPTION VALUE` on the CLI or `advantage=Options(...)` (or the
registered name) in Python; add one with `@register_estimator("name", Options())` in a module named by
$GRPO_PLUGIN_MODULES (grpo/plugins.py). Options may define `check(config)` to reject a setting at start (e.g. pass@k
with k > num_generations).

A batch transform sees the advantages of every rollout of one optimizer step (all micro-batches, all ranks' rows)
and returns new ones; it runs in the trainer on every rank (each holds the whole step's plan), after the estimator.
Select with `--advantage-batch-transforms NAME ...`; add one with `@register_batch_transform("name")` over a
function `fn(batch: AdvantageBatch) -> advantages [N]` or a class (instantiated once per run, so it can keep
state across steps, e.g. an EMA). DAPO's overlong reward shaping is applied before the estimator when
`overlong_buffer_length > 0`. docs/losses.md has the recipe.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, make_dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np

EstimatorFn = Callable[["np.ndarray", Any], "np.ndarray"]
ESTIMATORS: dict[str, Any] = {}
"""Registered estimators: name -> default options instance."""
ESTIMATOR_DESCRIPTIONS: dict[str, str] = {}
_ESTIMATOR_FNS: dict[type, EstimatorFn] = {}
BATCH_TRANSFORMS: dict[str, Callable] = {}
"""Registered batch transforms: name -> function or class."""
BATCH_TRANSFORM_DESCRIPTIONS: dict[str, str] = {}
STD_EPS = 1e-8
"""Added to the group std before dividing (a group of equal rewards has std 0)."""


def _first_line(obj: Any, fallback: str) -> str:
    return (inspect.getdoc(obj) or fallback).strip().splitlines()[0]


def register_estimator(name: str, options: Any = None, description: str | None = None):
    """Decorator: `fn(rewards, options)` estimates advantages for `type(options)`, selected as `advantage:name`.

    Without options (the earlier one-argument form `fn(rewards)`), an empty options class is made for it."""

    def add(fn: Callable) -> Callable:
        if name in ESTIMATORS:
            raise ValueError(f"advantage estimator {name!r} is already registered")
        opts, call = options, fn
        if opts is None:
            cls = make_dataclass(f"{name.title().replace('_', '')}EstimatorOptions", [], frozen=True)
            cls.__doc__ = f"Options of the {name} estimator (none)."
            opts = cls()
            call = lambda rewards, _options: fn(rewards)  # noqa: E731
        cls = type(opts)
        if cls in _ESTIMATOR_FNS:
            raise ValueError(f"options class {cls.__name__} already belongs to another estimator; give {name!r} its "
                             f"own options dataclass")
        _ESTIMATOR_FNS[cls] = call
        ESTIMATORS[name] = opts
        ESTIMATOR_DESCRIPTIONS[name] = description or _first_line(fn, name)
        return fn

    return add


def register_batch_transform(name: str, description: str | None = None):
    """Decorator: a function `fn(batch: AdvantageBatch) -> advantages [N]`, or a class whose instances are such
    callables (one instance per run), selected by `--advantage-batch-transforms name`."""

    def add(obj: Callable) -> Callable:
        if name in BATCH_TRANSFORMS:
            raise ValueError(f"advantage batch transform {name!r} is already registered")
        BATCH_TRANSFORMS[name] = obj
        BATCH_TRANSFORM_DESCRIPTIONS[name] = description or _first_line(obj, name)
        return obj

    return add


def registered_estimators() -> dict[str, Any]:
    """Every registered estimator: the built-in modules plus the plug-in modules (grpo/plugins.py)."""
    from grpo.plugins import import_plugins

    import_plugins()
    return ESTIMATORS


def registered_batch_transforms() -> dict[str, Callable]:
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


def check_advantage_config(config) -> None:
    """At start, before any model loads: the estimator and the batch transforms exist and accept the run."""
    options = estimator_options(config.advantage)
    if (check := getattr(options, "check", None)) is not None:
        check(config)
    batch_transforms(config.advantage_batch_transforms)


def overlong_penalty(lengths: np.ndarray, max_length: int, buffer: int, factor: float) -> np.ndarray:
    """DAPO soft overlong punishment (arXiv 2503.14476 eq. 13): 0 up to max - buffer, then linear down to
    -factor at max_length (and beyond)."""
    import numpy as np

    if buffer <= 0:
        return np.zeros(len(lengths), dtype=np.float64)
    excess = np.asarray(lengths, dtype=np.float64) - (max_length - buffer)
    return -factor * np.clip(excess / buffer, 0.0, 1.0)


def estimate_advantages(estimator: Any, rewards: np.ndarray, lengths: np.ndarray | None = None, max_length: int = 0,
                        overlong_buffer: int = 0, overlong_factor: float = 1.0) -> np.ndarray:
    """Advantages [G] of one group by the estimator (options instance or registered name); NaN rewards get 0 and
    are left out of the statistics."""
    import numpy as np

    options = estimator_options(estimator)
    rewards = np.asarray(rewards, dtype=np.float64)
    if overlong_buffer > 0 and lengths is not None:
        rewards = rewards + overlong_penalty(lengths, max_length, overlong_buffer, overlong_factor)
    advantages = np.zeros_like(rewards)
    scored = ~np.isnan(rewards)
    if scored.any():
        advantages[scored] = _ESTIMATOR_FNS[type(options)](rewards[scored], options)
    return advantages


# ---- the per-step batch transform hook --------------------------------------------------------------------------

@dataclass
class AdvantageBatch:
    """One optimizer step's rollouts (N), each once (a multi-turn rollout's several samples share one entry)."""

    advantages: np.ndarray  # [N] from the estimator (or the previous transform)
    rewards: np.ndarray  # [N] total reward (NaN = unscored)
    group_ids: np.ndarray  # [N] prompt group of each rollout
    step: int  # the optimizer step being built (1-based)


def batch_transforms(names: tuple[str, ...] | str) -> list[Callable]:
    """Instances of the named transforms, in order (a class is instantiated once, here)."""
    transforms = registered_batch_transforms()
    names = (names,) if isinstance(names, str) else names
    out = []
    for name in names:
        if name not in transforms:
            raise ValueError(f"unknown advantage batch transform {name!r}: use one of {sorted(transforms)}, or "
                             f"register yours with @register_batch_transform (docs/losses.md)")
        obj = transforms[name]
        out.append(obj() if isinstance(obj, type) else obj)
    return out


def apply_batch_transforms(transforms: list[Callable], samples: list, step: int) -> int:
    """Rewrite `sample.advantage` of the step's training samples (padding samples, group_id < 0, left out) by each
    transform in turn; returns the number of rollouts seen. Every rank calls it on the same samples."""
    import numpy as np

    if not transforms:
        return 0
    keys, index = [], {}
    for sample in samples:
        if sample.group_id < 0:
            continue
        key = (sample.group_id, sample.rollout_id)
        if key not in index:
            index[key] = len(keys)
            keys.append((key, sample))
    if not keys:
        return 0
    batch = AdvantageBatch(advantages=np.array([s.advantage for _, s in keys], dtype=np.float64),
                           rewards=np.array([s.reward for _, s in keys], dtype=np.float64),
                           group_ids=np.array([k[0] for k, _ in keys]), step=step)
    for transform in transforms:
        new = np.asarray(transform(batch), dtype=np.float64)
        if new.shape != batch.advantages.shape or not np.isfinite(new).all():
            raise ValueError(f"advantage batch transform {transform!r} returned shape {new.shape} with "
                             f"{int((~np.isfinite(new)).sum())} non-finite values; it must return [N] finite values "
                             f"(N = {len(keys)} rollouts)")
        batch.advantages = new
    for sample in samples:
        if sample.group_id >= 0:
            sample.advantage = float(batch.advantages[index[(sample.group_id, sample.rollout_id)]])
    return len(keys)


# ---- the built-in estimators --------------------------------------------------------------------------------------

@dataclass(frozen=True)
class GroupStdOptions:
    """Options of group_std."""

    std_eps: float = STD_EPS
    """Added to the group's population std before dividing."""


@register_estimator("group_std", GroupStdOptions())
def group_std(rewards: np.ndarray, opts: GroupStdOptions) -> np.ndarray:
    """GRPO (DeepSeekMath, arXiv 2402.03300): (r - mean) / (population std + 1e-8)."""
    return (rewards - rewards.mean()) / (rewards.std() + opts.std_eps)


@dataclass(frozen=True)
class NoStdOptions:
    """Options of no_std (none)."""


@register_estimator("no_std", NoStdOptions())
def no_std(rewards: np.ndarray, opts: NoStdOptions) -> np.ndarray:
    """Dr. GRPO (arXiv 2503.20783): r - mean, no division by the std (which up-weights easy and hard prompts)."""
    return rewards - rewards.mean()


@dataclass(frozen=True)
class RlooOptions:
    """Options of rloo (none)."""


@register_estimator("rloo", RlooOptions())
def rloo(rewards: np.ndarray, opts: RlooOptions) -> np.ndarray:
    """RLOO (Ahmadian et al., arXiv 2402.14740): r_i - mean of the other rewards = G / (G - 1) (r_i - mean)."""
    import numpy as np

    n = len(rewards)
    if n < 2:
        return np.zeros_like(rewards)
    return (rewards - rewards.mean()) * n / (n - 1)


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
            f"after the estimator. Registered: {described or 'none'}")
    return Annotated[tuple[Literal[names], ...] if names else tuple[str, ...], tyro.conf.arg(help=text)]
