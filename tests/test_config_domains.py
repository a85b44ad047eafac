"""Every config field has a domain, checked at start: a sweep of boundary values over every numeric field (found by
walking the dataclass, so a new field without a domain fails here) must meet a named error before anything
starts, or a meaning the field's docstring states."""

from __future__ import annotations

import dataclasses
import math
import typing

import pytest

from grpo.config import AsyncGRPOConfig
from grpo.domains import ConfigValueError, domains_of

HUGE_INT, HUGE_FLOAT = 10**12, 1e12


def field_docstrings(cls: type) -> dict[str, str]:
    """Field name -> the docstring under it (what tyro shows as --help), read from the source."""
    import ast
    import inspect

    docs = {}
    for klass in cls.__mro__:
        if not dataclasses.is_dataclass(klass):
            continue
        body = ast.parse(inspect.getsource(klass)).body[0].body
        for node, after in zip(body, body[1:]):
            if isinstance(node, ast.AnnAssign) and isinstance(after, ast.Expr) and \
                    isinstance(getattr(after, "value", None), ast.Constant):
                docs.setdefault(node.target.id, after.value.value)
    return docs


def numeric_kind(annotation) -> type | None:
    """int or float when the field holds numbers (possibly `| None`), else None (bool is not numeric here)."""
    args = set(typing.get_args(annotation)) or {annotation}
    if float in args:
        return float
    if int in args and bool not in args:
        return int
    return None


HINTS = typing.get_type_hints(AsyncGRPOConfig)
FIELDS = [f.name for f in dataclasses.fields(AsyncGRPOConfig)]
NUMERIC = {name: kind for name in FIELDS if (kind := numeric_kind(HINTS[name]))}


def below_smallest_sample(name: str) -> list:
    """Token counts one past what the field must leave room for: a sample is at least one prompt token and one
    completion token, and a row must hold a one-token prompt with a completion of max_completion_length."""
    longest_completion = AsyncGRPOConfig().max_completion_length
    return {"token_budget": [1, longest_completion],  # a row must hold a one-token prompt and a full completion
            "max_completion_length": [0],  # a completion has at least one token
            "overlong_buffer_length": [longest_completion],  # a buffer must leave the completion a first token
            }.get(name, [])


def boundary_values(name: str, kind: type) -> list:
    values = [0, -1, HUGE_INT] if kind is int else [0.0, -1.0, HUGE_FLOAT, math.nan, math.inf]
    return values + below_smallest_sample(name)


def start_check(config: AsyncGRPOConfig) -> None:
    """What `train.build` runs first, before any model, dataset or server is touched."""
    from grpo.inputs import check_run_config

    check_run_config(config)


def test_every_field_declares_a_domain_and_a_docstring():
    table, docs = domains_of(AsyncGRPOConfig), field_docstrings(AsyncGRPOConfig)
    missing = [name for name in FIELDS if name not in table]
    undocumented = [name for name in FIELDS if not docs.get(name, "").strip()]
    assert not missing, f"fields without a domain in AsyncGRPOConfig.FIELD_DOMAINS: {missing}"
    assert not undocumented, f"fields without a docstring: {undocumented}"
    assert not set(table) - set(FIELDS), f"domains of fields that do not exist: {set(table) - set(FIELDS)}"


def test_defaults_are_inside_their_domains():
    start_check(AsyncGRPOConfig())


@pytest.mark.parametrize("name", sorted(NUMERIC))
def test_boundary_values_are_refused_by_name_or_documented(name):
    """0, -1, a huge value (NaN and inf for floats, one below the smallest sample for token fields): refused at
    start naming the flag, or accepted as a value whose meaning the docstring states. 0 and -1 may not pass as
    ordinary values: each is either refused or a documented special."""
    domain, doc = domains_of(AsyncGRPOConfig)[name], field_docstrings(AsyncGRPOConfig)[name]
    for value in boundary_values(name, NUMERIC[name]):
        config = dataclasses.replace(AsyncGRPOConfig(), **{name: value})
        try:
            start_check(config)
        except ConfigValueError as exc:
            assert name in exc.fields and f"--{name.replace('_', '-')}" in str(exc), str(exc)
            continue
        assert value not in below_smallest_sample(name), f"{name}={value} cannot hold a sample, accepted at start"
        meaning = domain.meaning(value)
        if value in (0, -1):
            assert meaning is not None, f"{name}={value} accepted at start with no declared meaning"
        if meaning is not None:
            spelled = f"{value:g}" if isinstance(value, float) else str(value)
            assert spelled in doc, f"{name}={value} means {meaning!r}, but its docstring does not say so: {doc!r}"
        assert not (isinstance(value, float) and not math.isfinite(value)), f"{name}={value} accepted"


def test_a_subclass_field_without_a_domain_is_reported_not_refused():
    @dataclasses.dataclass
    class Extra(AsyncGRPOConfig):
        threshold: float = 0.5
        """A user's field (spec: subclasses add fields)."""

    from grpo.domains import check_config

    assert check_config(Extra(), AsyncGRPOConfig) == ["threshold"]
    with pytest.raises(ConfigValueError, match="--max-steps 0"):
        check_config(Extra(max_steps=0), AsyncGRPOConfig)


def test_the_config_is_frozen_and_replace_works():
    config = AsyncGRPOConfig()
    with pytest.raises(dataclasses.FrozenInstanceError, match="dataclasses.replace"):
        config.max_steps = 3
    assert dataclasses.replace(config, max_steps=3).max_steps == 3


@pytest.mark.parametrize("overrides, flag", [
    (dict(token_budget=8), "--token-budget 8"),
    (dict(overlong_buffer_length=2048), "--overlong-buffer-length 2048"),
    (dict(warmup_steps=10, max_steps=5), "--warmup-steps 10"),
    (dict(lr_scheduler_type="cosine"), "--lr-scheduler-type 'cosine'"),
])
def test_cross_field_rules(overrides, flag):
    with pytest.raises(ConfigValueError, match=flag):
        start_check(dataclasses.replace(AsyncGRPOConfig(), **overrides))


def test_the_openai_style_url_is_the_server_root(caplog):
    config = AsyncGRPOConfig(vllm_server_base_url="http://h:8000/v1/")
    assert config.vllm_server_urls == ("http://h:8000",)
    with caplog.at_level("INFO", logger="train"):
        start_check(config)
    assert "ends in /v1" in caplog.text


# ---- the documented special values do what their docstrings say -------------------------------------------------
def test_max_grad_norm_0_means_no_clipping():
    import torch

    from grpo.step import queue_optimizer_step

    def step(max_grad_norm: float) -> torch.Tensor:
        layer = torch.nn.Linear(4, 1, bias=False)
        torch.nn.init.zeros_(layer.weight)
        optimizer = torch.optim.SGD(layer.parameters(), lr=1.0)
        (layer(torch.full((1, 4), 100.0)).sum()).backward()  # gradient 100 per weight, norm 200
        queue_optimizer_step(layer, optimizer, max_grad_norm)
        return -layer.weight.detach().flatten()

    assert torch.allclose(step(0.0), torch.full((4,), 100.0))  # unclipped
    assert torch.allclose(step(1.0).norm(), torch.tensor(1.0))  # clipped to norm 1


def test_eval_steps_0_means_only_the_final_evaluation():
    from grpo.evaluation import eval_due

    assert not any(eval_due(step, 0) for step in range(1, 1000)) and eval_due(50, 50)


def test_max_nonfinite_steps_0_means_never_stop():
    from grpo.step import NonFiniteStepError, check_nonfinite

    in_a_row = 0
    for step in range(1, 20):
        in_a_row = check_nonfinite(False, step, [{"loss": float("nan")}], float("nan"), in_a_row, 0)
    assert in_a_row == 19
    with pytest.raises(NonFiniteStepError):
        for step in range(1, 4):
            in_a_row = check_nonfinite(False, step, [{"loss": float("nan")}], float("nan"), step - 1, 3)
