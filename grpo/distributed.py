"""Process group, device and sharding. Only torchrun's environment variables are read (no accelerate).

GPUs: NCCL + FSDP2 (`fully_shard` per decoder layer, then the root). CPU: gloo + FSDP2 as well (it runs on
torch >= 2.6's CPU path), so a 2-process CPU run exercises the same sharded code as the GPU path.

Several nodes: torchrun's c10d rendezvous forms one process group over every node; nothing here is node-aware
beyond reading LOCAL_WORLD_SIZE. `replicas > 1` shards with HSDP over a 2-D mesh (replicate x shard): parameters
are sharded inside a group of `world / replicas` ranks and replicated across groups, so the per-layer all-gathers
stay on the fast intra-node links and only the gradient all-reduce crosses nodes (docs/design.md §18).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    local_world_size: int = 1  # processes on this node (torchrun's LOCAL_WORLD_SIZE)
    num_nodes: int = 1  # torchrun agents, one per node (GROUP_WORLD_SIZE)

    @property
    def is_main(self) -> bool:
        """Global rank 0: the one process that runs the rollout worker, talks to vLLM and writes shared files."""
        return self.rank == 0


def init_distributed(timeout_s: float = 1800.0) -> DistInfo:
    """Join the torchrun process group (or run as a single process when RANK is unset)."""
    rank = int(os.environ.get("RANK", 0))
    world = int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    nodes = int(os.environ.get("GROUP_WORLD_SIZE", max(1, world // local_world)))
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device = torch.device("cpu")
        backend = "gloo"
    if world > 1 and not dist.is_initialized():
        dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s),
                                device_id=device if device.type == "cuda" else None)
    return DistInfo(rank, world, local_rank, device, local_world, nodes)


def decoder_layers(model) -> list[torch.nn.Module]:
    """The repeated transformer blocks (the FSDP2 wrapping unit)."""
    for module in model.modules():
        layers = getattr(module, "layers", None)
        if isinstance(layers, torch.nn.ModuleList) and len(layers) > 0 and hasattr(module, "embed_tokens"):
            return list(layers)
    raise ValueError(f"cannot find the decoder layers of {type(model).__name__}")


def hsdp_replicas(setting: str, info: DistInfo) -> int:
    """`--hsdp-replicas` -> the number of replica groups: `1` = plain FSDP over all ranks, `auto` = one group
    per node (sharded inside a node, replicated across nodes), N = N groups of world/N ranks each."""
    if setting == "auto" and info.num_nodes * info.local_world_size != info.world_size:
        raise ValueError(f"--hsdp-replicas auto needs the same --nproc-per-node on every node ({info.num_nodes} nodes, "
                         f"{info.local_world_size} processes here, world {info.world_size}): pass --hsdp-replicas N")
    replicas = info.num_nodes if setting == "auto" else int(setting) if setting.isdigit() else 0
    if replicas < 1 or info.world_size % replicas:
        raise ValueError(f"--hsdp-replicas {setting!r}: need `auto` or a positive integer dividing the world size "
                         f"{info.world_size} (ranks per replica = world / replicas)")
    return replicas


def device_mesh(info: DistInfo, replicas: int):
    """The 2-D (replicate, shard) mesh for HSDP. Consecutive global ranks share a shard group, and torchrun
    numbers the ranks of one node consecutively, so `replicas = num_nodes` keeps every shard group on one node."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(info.device.type, (replicas, info.world_size // replicas),
                            mesh_dim_names=("replicate", "shard"))


def shard_model(model: torch.nn.Module, info: DistInfo, mixed_precision: bool, replicas: int = 1,
                one_process_fsdp: bool = False) -> torch.nn.Module:
    """FSDP2 over all ranks (`replicas == 1`), or HSDP over a (replicas, world/replicas) mesh. Parameters stay
    fp32 masters; bf16 compute when asked.

    One process without mixed precision: a no-op. One process WITH mixed precision gets FSDP2's numerics: bf16
    weights for each forward, the whole activation path (residual stream, norms, the LM head's input) in bf16
    where autocast would leave the residual stream and the head in fp32 (embeddings are not autocast), gradients
    accumulated in fp32. By default through grpo/master_weights.py (bf16 compute copies beside the fp32 masters,
    no FSDP2 machinery); with `one_process_fsdp` through FSDP2 on a 1-rank group. Same numerics on 1 GPU and on N.
    """
    if info.world_size == 1 and not mixed_precision:
        return model
    if info.world_size == 1 and not one_process_fsdp:
        from grpo.master_weights import attach

        return attach(model, torch.bfloat16)
    if info.world_size == 1 and not dist.is_initialized():
        backend = "nccl" if info.device.type == "cuda" else "gloo"
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1,
                                device_id=info.device if info.device.type == "cuda" else None)
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if mixed_precision else None
    kwargs = {"mp_policy": mp} if mp is not None else {}
    if replicas > 1:  # a 2-D mesh makes fully_shard replicate over dim 0 and shard over dim 1 (HSDP)
        kwargs["mesh"] = device_mesh(info, replicas)
    if info.world_size == 1:  # nothing to free by resharding: keep the bf16 copy for the backward (no re-cast)
        kwargs["reshard_after_forward"] = False
    for layer in decoder_layers(model):
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    return model


def all_reduce_sum(value: float, info: DistInfo) -> float:
    if info.world_size == 1:
        return float(value)
    t = torch.tensor([float(value)], dtype=torch.float64, device=info.device if info.device.type == "cuda" else "cpu")
    dist.all_reduce(t)
    return float(t.item())


def broadcast_object(obj, info: DistInfo, src: int = 0):
    """Rank `src`'s Python object on every rank (pickled)."""
    if info.world_size == 1:
        return obj
    box = [obj if info.rank == src else None]
    dist.broadcast_object_list(box, src=src, device=info.device if info.device.type == "cuda" else None)
    return box[0]


def barrier(info: DistInfo) -> None:
    if info.world_size > 1:
        dist.barrier()
