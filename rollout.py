"""Generation side: `python rollout.py serve ...` prints and runs the exact `vllm serve` command the trainer's
features need; `python rollout.py sample ...` runs the rollout loop standalone and writes groups as JSONL."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from typing import Annotated

import tyro

from grpo.vllm_server import ServeConfig


@dataclass(frozen=True)
class Serve:
    server: ServeConfig
    dry_run: bool = False
    """Only print the command."""


def serve(cmd: Serve) -> int:
    from grpo.vllm_server import format_command, serve_command

    argv, env = serve_command(cmd.server)
    print(format_command(argv, env), flush=True)
    if cmd.dry_run:
        return 0
    return subprocess.call(argv, env=os.environ | env)


Command = Annotated[Serve, tyro.conf.subcommand("serve")]

if __name__ == "__main__":
    cmd = tyro.cli(Command, description=__doc__)
    sys.exit(serve(cmd))
