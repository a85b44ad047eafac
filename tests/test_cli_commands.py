"""Every `train.py ...` command the README and docs show, and every command `scripts/ablate.py --dry-run` prints,
parses with the real CLI (train.py's own steps: `config_class`, which also reorders argv (grpo/cli_order.py), then
tyro). Templates (`loss:NAME`, `--advantage.OPT V`) and `--help` lines are left out; `...` stands for options
left out and is dropped.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import ablate
import pytest
import tyro

from grpo.config import AsyncGRPOConfig, config_class

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
TEMPLATE = re.compile(r"(?<![A-Za-z0-9])(NAME|OPTION|OPT|VALUE|V|N|K|URL|PATH|pkg\.module|mypkg)(?![A-Za-z0-9])")


def parse_train_argv(argv: list[str]) -> AsyncGRPOConfig:
    """What `python train.py ARGV` does before main: config_class, then tyro; SystemExit becomes a failure."""
    cls, args = config_class(list(argv))
    try:
        return tyro.cli(cls, args=args)
    except SystemExit as exc:
        raise AssertionError(f"train.py {shlex.join(argv)} does not parse (exit {exc.code})") from None


def _tokens_after_train_py(command: str) -> list[str] | None:
    command = command.split(" #", 1)[0].replace("[", " ").replace("]", " ")
    try:
        tokens = shlex.split(command)
    except ValueError:
        return None
    if "train.py" not in tokens:
        return None
    return [t for t in tokens[tokens.index("train.py") + 1:] if t != "..." and not t.startswith("$")]  # $SHELL_VARS


def documented_commands() -> list[tuple[str, list[str]]]:
    """(where, argv after train.py) of each command in fenced blocks (continuations joined) and inline spans."""
    found = []
    for path in DOCS:
        text = path.read_text()
        for block in re.findall(r"```[a-z]*\n(.*?)```", text, flags=re.S):
            for line in block.replace("\\\n", " ").splitlines():
                if "train.py" in line and (argv := _tokens_after_train_py(line)) is not None:
                    found.append((f"{path.name}: {line.strip()[:80]}", argv))
        # inline spans paired left to right, so the prose between two spans is never taken for one
        for span in re.findall(r"`([^`\n]*)`", re.sub(r"```.*?```", "", text, flags=re.S)):
            if "train.py" in span and (argv := _tokens_after_train_py(span)) is not None:
                found.append((f"{path.name}: {span[:80]}", argv))
    return [(where, argv) for where, argv in found  # a bare `train.py` is a mention, not a command
            if argv and "--help" not in argv and not any(TEMPLATE.search(t) for t in argv)]


COMMANDS = documented_commands()


def test_the_docs_show_commands_to_parse():
    assert len(COMMANDS) >= 5, COMMANDS


@pytest.mark.parametrize("where,argv", COMMANDS, ids=[w for w, _ in COMMANDS])
def test_documented_train_command_parses(where, argv):
    parse_train_argv(argv)


def ablate_dry_run(argv: list[str], capsys) -> list[list[str]]:
    """The train.py argv of every run `ablate.py ARGV --dry-run` prints."""
    ablate.main(tyro.cli(ablate.Args, args=[*argv, "--dry-run"]))
    lines = capsys.readouterr().out.strip().splitlines()
    return [shlex.split(line)[2:] for line in lines]  # python train.py ...


def test_documented_ablate_commands_print_commands_that_parse(capsys):
    shown = []
    for path in DOCS:
        for block in re.findall(r"```[a-z]*\n(.*?)```", path.read_text(), flags=re.S):
            for line in block.replace("\\\n", " ").splitlines():
                if "scripts/ablate.py" in line:
                    tokens = shlex.split(line.split(" #", 1)[0])
                    shown.append([t for t in tokens[tokens.index("scripts/ablate.py") + 1:] if t != "--dry-run"])
    assert shown
    for argv in shown:
        for train_argv in ablate_dry_run(argv, capsys):
            parse_train_argv(train_argv)


MIXED = ("dapo+loss.epsilon_high=0.3+loss.epsilon=0.1",  # loss options
         "grpo+advantage=pass_at_k+advantage.k=2",  # estimator options
         "dr_grpo+advantage=no_std+advantage_batch_transforms=batch_std",  # the variant
         "cispo+advantage_batch_transforms=batch_std+transform.batch_std.std_eps=0.001+drop_equal_reward_groups=false",
         "gspo+advantage=rloo+advantage_batch_transforms=batch_std,batch_std+loss.epsilon=0.05")


def test_ablate_dry_run_of_mixed_variants_parses_as_meant(capsys, tmp_path):
    argvs = ablate_dry_run(["--variants", *MIXED, "--seeds", "0", "--out", str(tmp_path),
                            "--set", "max_steps=5", "report_to=none,tensorboard"], capsys)
    configs = [parse_train_argv(argv) for argv in argvs]
    assert len(configs) == 5 and all(c.max_steps == 5 and c.report_to == ("none", "tensorboard") for c in configs)
    dapo, pass_k, dr, cispo, gspo = configs
    assert (dapo.loss.epsilon, dapo.loss.epsilon_high) == (0.1, 0.3)
    assert type(pass_k.advantage).__name__ == "PassAtKOptions" and pass_k.advantage.k == 2
    assert dr.advantage_batch_transforms == ("batch_std",) and type(dr.advantage).__name__ == "NoStdOptions"
    assert cispo.transform.batch_std.std_eps == 0.001 and cispo.drop_equal_reward_groups is False
    assert gspo.advantage_batch_transforms == ("batch_std", "batch_std") and gspo.loss.epsilon == 0.05


@pytest.mark.parametrize("argv", [
    ["--advantage-batch-transforms", "batch_std", "loss:dr_grpo", "advantage:no_std"],  # the README's order
    ["loss:dr_grpo", "advantage:no_std", "--advantage-batch-transforms", "batch_std", "--seed", "3"],
    ["--reward-funcs", "accuracy", "loss:dapo", "--loss.epsilon-high", "0.3", "--transform.batch-std.std-eps", "0.5"],
])
def test_natural_orders_parse(argv):
    config = parse_train_argv(argv)
    assert config.loss is not None and config.transform.batch_std.std_eps in (1e-8, 0.5)


def test_reordering_keeps_the_last_occurrence_last():
    from grpo.cli_order import hoist_variadic_flags

    argv = ["--reward-funcs", "a", "--seed", "1", "--reward-funcs", "b", "loss:grpo", "--loss.epsilon", "0.1"]
    assert hoist_variadic_flags(AsyncGRPOConfig, argv) == [
        "--reward-funcs", "a", "--reward-funcs", "b", "--seed", "1", "loss:grpo", "--loss.epsilon", "0.1"]
    assert parse_train_argv(argv).reward_funcs == ("b",)
