"""The multi-node launch recipes (scripts/slurm_multinode.sbatch, scripts/two_hosts.sh) are shell that this machine
cannot run for real (no SLURM, no second host): they must parse (`bash -n`), and under DRY_RUN=1 the server and
trainer commands they build must parse with the project's own CLIs (rollout.py serve, torchrun, train.py) and carry
the intended topology: one server URL per inference host, the rendezvous on the first trainer host, HSDP."""

from __future__ import annotations

import os
import shlex
import subprocess

import pytest

from conftest import REPO

SBATCH, TWO_HOSTS = REPO / "scripts" / "slurm_multinode.sbatch", REPO / "scripts" / "two_hosts.sh"


def several_urls_supported() -> bool:
    from grpo.config import AsyncGRPOConfig

    return "tuple" in str(AsyncGRPOConfig.__annotations__["vllm_server_base_url"])


def dry_run(script, *args, env: dict, tmp_path) -> list[list[str]]:
    """The commands the script would run, one argv per line."""
    out = subprocess.run(["bash", str(script), *args], env=os.environ | {"DRY_RUN": "1"} | env, cwd=tmp_path,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return [shlex.split(line) for line in out.stdout.splitlines() if line.strip()]


def after(argv: list[str], marker: str) -> list[str]:
    return argv[argv.index(marker) + 1:]


def parse_serve(argv: list[str]):
    import tyro
    from rollout import Command

    from grpo.vllm_server import serve_command

    cmd = tyro.cli(Command, args=after(argv, "rollout.py"))
    return cmd.server, serve_command(cmd.server)[0]


def parse_train(argv: list[str]):
    import tyro
    from torch.distributed.run import get_args_parser
    from grpo.config import config_class

    torchrun = get_args_parser().parse_args(argv[argv.index("torch.distributed.run") + 1:])
    assert torchrun.training_script == "train.py"
    cls, args = config_class(after(argv, "train.py"))
    config = tyro.cli(cls, args=args)
    raw = config.vllm_server_base_url
    return torchrun, config, (raw,) if isinstance(raw, str) else tuple(raw)


@pytest.mark.parametrize("script", [SBATCH, TWO_HOSTS])
def test_recipes_are_valid_bash(script):
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0


@pytest.mark.parametrize("infer_nodes", [1, 2])
def test_slurm_template_builds_commands_the_clis_accept(tmp_path, infer_nodes):
    if infer_nodes > 1 and not several_urls_supported():
        pytest.skip("several --vllm-server-base-url values need the multi-server config (issue 14 part A)")
    hosts = ["gpu01", "gpu02", "gpu03", "gpu04"]
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "scontrol").write_text("#!/bin/sh\nprintf '%s\\n' " + " ".join(hosts) + "\n")
    (fake / "scontrol").chmod(0o755)
    env = {"PATH": f"{fake}:{os.environ['PATH']}", "SLURM_JOB_ID": "42", "SLURM_SUBMIT_DIR": str(REPO),
           "INFER_NODES": str(infer_nodes), "GPUS_PER_NODE": "4", "MODEL": "Qwen/Qwen3-8B",
           "TRAIN_ARGS": "--max-steps 7 --save-steps 5"}
    lines = dry_run(SBATCH, env=env, tmp_path=tmp_path)
    assert len(lines) == infer_nodes + 1
    for host, line in zip(hosts, lines[:infer_nodes]):
        assert line[0] == "srun" and f"--nodelist={host}" in line
        server, vllm_argv = parse_serve(line)
        assert (server.model, server.host, server.port, server.dtype) == ("Qwen/Qwen3-8B", "0.0.0.0", 8000, "float32")
        assert vllm_argv[:3] == ["vllm", "serve", "Qwen/Qwen3-8B"] and "--data-parallel-size=4" in vllm_argv
    train_hosts = hosts[infer_nodes:]
    assert f"--nodelist={','.join(train_hosts)}" in lines[-1]
    torchrun, config, urls = parse_train(lines[-1])
    assert (torchrun.nnodes, torchrun.nproc_per_node, torchrun.rdzv_backend, torchrun.rdzv_endpoint) == (
        str(len(train_hosts)), "4", "c10d", f"{train_hosts[0]}:29500")
    assert urls == tuple(f"http://{h}:8000" for h in hosts[:infer_nodes])
    assert (config.model, config.hsdp_replicas, config.max_steps, config.save_steps) == ("Qwen/Qwen3-8B", "auto", 7, 5)
    assert config.output_dir == str(REPO / "outputs" / "grpo-42")


@pytest.mark.parametrize("role", ["a", "b"])
def test_two_host_recipe_builds_commands_the_clis_accept(tmp_path, role):
    if not several_urls_supported():
        pytest.skip("several --vllm-server-base-url values need the multi-server config (issue 14 part A)")
    env = {"HOST_A": "10.0.0.1", "HOST_B": "10.0.0.2", "OUTPUT_DIR": "/nfs/run1", "TRAIN_ARGS": "--max-steps 3"}
    serve_line, train_line = dry_run(TWO_HOSTS, role, env=env, tmp_path=tmp_path)
    assert "CUDA_VISIBLE_DEVICES=0,1,2,3" in serve_line and "CUDA_VISIBLE_DEVICES=4,5,6,7" in train_line
    server, vllm_argv = parse_serve(serve_line)
    assert server.host == "0.0.0.0" and "--data-parallel-size=4" in vllm_argv
    torchrun, config, urls = parse_train(train_line)
    assert (torchrun.nnodes, torchrun.nproc_per_node, torchrun.rdzv_endpoint) == ("2", "4", "10.0.0.1:29500")
    assert urls == ("http://10.0.0.1:8000", "http://10.0.0.2:8000")
    assert (config.hsdp_replicas, config.output_dir, config.max_steps) == ("auto", "/nfs/run1", 3)
