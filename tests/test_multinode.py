"""Two "nodes" on one machine: two torchrun launches (`--nnodes 2 --node-rank 0/1`, c10d rendezvous on localhost,
gloo on CPU) train the fixed batches of tests/multinode_step.py with FSDP2 (`--hsdp-replicas 1`) and HSDP
(`--hsdp-replicas auto`, a (nodes, ranks per node) mesh). Both give one process's gradients and parameters, the
weight-sync gather over the mesh gives the full parameters, a checkpoint of the 2-node run resumes exactly on one
node, and an output_dir the nodes do not share fails at start, naming the blind rank."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from conftest import REPO

PY = sys.executable
TOL = dict(atol=1e-6, rtol=0)


def launch_two_nodes(model_dir, out, nproc_per_node: int, resume) -> None:
    """Two torchrun launches meeting at a c10d rendezvous, as on two hosts (here both on 127.0.0.1)."""
    from grpo.vllm_server import free_port

    endpoint = f"127.0.0.1:{free_port()}"
    out.mkdir(parents=True)
    procs = []
    for node in range(2):
        cmd = [PY, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(node), "--nproc-per-node",
               str(nproc_per_node), "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", out.name,
               str(REPO / "tests" / "multinode_step.py"), str(model_dir), str(out), "--resume", str(resume)]
        log = open(out / f"node{node}.log", "w")
        procs.append((subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT), log))
    try:
        for proc, log in procs:
            proc.wait(timeout=400)
    finally:
        for proc, log in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            log.close()
    for node, (proc, _) in enumerate(procs):
        assert proc.returncode == 0, (out / f"node{node}.log").read_text()[-5000:]


@pytest.fixture(scope="module")
def one_process(tiny_qwen3, tmp_path_factory):
    """The reference: the same two steps in this process, unsharded (its checkpoint: `one_process_checkpoint`)."""
    from multinode_step import run

    from grpo.distributed import init_distributed

    out = tmp_path_factory.mktemp("one")
    return run(str(tiny_qwen3), out, "1", init_distributed()) | {"checkpoint": out / "1" / "checkpoint-1"}


@pytest.fixture(scope="module", params=[1, 2], ids=["2x1", "2x2"])
def two_nodes(request, tiny_qwen3, tmp_path_factory, one_process):
    """2 nodes x 1 process (HSDP mesh 2x1), and 2 nodes x 2 processes (HSDP mesh 2x2: sharded in a node); each
    launch also resumes the one-process checkpoint."""
    out = tmp_path_factory.mktemp(f"nodes{request.param}") / "run"
    launch_two_nodes(tiny_qwen3, out, request.param, one_process["checkpoint"])
    return out, request.param


def _assert_close(got: dict, want: dict, what: str, **tol) -> None:
    assert got.keys() == want.keys(), what
    for name, t in want.items():
        torch.testing.assert_close(got[name], t, **(tol or TOL), msg=f"{what}: {name}")


@pytest.mark.parametrize("sharding", ["1", "auto"])
def test_two_nodes_match_one_process(two_nodes, one_process, sharding):
    out, per_node = two_nodes
    got = torch.load(out / f"{sharding}.pt")
    assert (got["world"], got["nodes"]) == (2 * per_node, 2)
    assert got["mesh"] == ((2 * per_node,) if sharding == "1" else (2, per_node))
    for step in ("step1", "step2"):
        _assert_close(got[step]["grads"], one_process[step]["grads"], f"{step} gradients")
        # compared at lr 1e-4, adam_epsilon 1e-6: tests/multinode_step.py says why
        _assert_close(got[step]["params"], one_process[step]["params"], f"{step} parameters")
    assert any(g.abs().max() > 1e-3 for g in one_process["step1"]["grads"].values())
    # the weight sync's gather (DTensor.full_tensor over every mesh dim) yields the full trained parameters
    params = {name.removeprefix("model."): p for name, p in got["step2"]["params"].items()}
    assert got["synced"].keys() == params.keys()
    _assert_close(got["synced"], params, "synced weights", atol=0, rtol=0)


@pytest.mark.parametrize("sharding", ["1", "auto"])
def test_two_node_checkpoint_resumes_on_one_node(two_nodes, tiny_qwen3, tmp_path, sharding):
    """The exact-resume checks of test_checkpoint.py (weights and Adam state bit-identical after the load), then
    the next step matches the 2-node run's."""
    from multinode_step import run

    from grpo.distributed import init_distributed

    out, _ = two_nodes
    got = torch.load(out / f"{sharding}.pt")
    resumed = run(str(tiny_qwen3), tmp_path, "1", init_distributed(), resume=str(out / sharding / "checkpoint-1"))
    assert {k: resumed["state"][k] for k in ("prompt_index", "model_version", "step")} == {
        "prompt_index": 4, "model_version": 1, "step": 1}
    assert resumed["scheduler_epoch"] == 1
    _assert_close(resumed["loaded"], got["step1"]["params"], "loaded weights", atol=0, rtol=0)
    _assert_close(resumed["loaded_exp_avg"], got["exp_avg"], "loaded exp_avg", atol=0, rtol=0)
    _assert_close(resumed["step2"]["params"], got["step2"]["params"], "the step after resume")


@pytest.mark.parametrize("sharding", ["1", "auto"])
def test_one_node_checkpoint_resumes_on_two_nodes(two_nodes, one_process, sharding):
    """Loading a full checkpoint into the sharded model (DTensors over the 1-D or 2-D mesh) is exact."""
    out, _ = two_nodes
    resumed = torch.load(out / f"resume-{sharding}.pt")
    assert resumed["state"]["step"] == 1 and resumed["scheduler_epoch"] == 1
    _assert_close(resumed["loaded"], one_process["step1"]["params"], "loaded weights", atol=0, rtol=0)
    _assert_close(resumed["loaded_exp_avg"], one_process["exp_avg"], "loaded exp_avg", atol=0, rtol=0)
    _assert_close(resumed["step2"]["params"], one_process["step2"]["params"], "the step after resume")


def test_output_dir_not_shared_fails_naming_the_rank(two_nodes):
    out, per_node = two_nodes
    message = torch.load(out / "1.pt")["not_shared_error"]
    assert message is not None and "is not shared by every node" in message
    assert [f"rank {r} on " in message for r in range(2 * per_node)] == [False] + [True] * (2 * per_node - 1)


def test_hsdp_replicas_setting():
    from grpo.distributed import DistInfo, hsdp_replicas

    def info(world, local, nodes):
        return DistInfo(0, world, 0, torch.device("cpu"), local, nodes)

    assert hsdp_replicas("1", info(8, 4, 2)) == 1
    assert hsdp_replicas("auto", info(8, 4, 2)) == 2
    assert hsdp_replicas("auto", info(1, 1, 1)) == 1
    assert hsdp_replicas("4", info(8, 8, 1)) == 4
    for setting, world, local, nodes in (("3", 8, 4, 2), ("0", 8, 4, 2), ("two", 8, 4, 2), ("auto", 8, 6, 2)):
        with pytest.raises(ValueError, match="hsdp-replicas"):
            hsdp_replicas(setting, info(world, local, nodes))
