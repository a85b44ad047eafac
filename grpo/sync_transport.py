"""How one weight sync's tensors reach the servers: the small protocol every transport implements, and the choice.

`WeightSync` (grpo/weight_sync.py) owns the servers (the alive set, the phases under their deadlines, dropping a
failing server) and the pause -> barrier -> transfer -> barrier -> resume frame. A transport moves the tensors
inside that frame, on rank 0, while every other rank takes part in the gathers:

    nccl      grpo/sync_nccl.py     one packed NCCL broadcast into a group over every alive server's workers
    ipc       grpo/sync_ipc.py      CUDA-IPC buckets to the one server on the trainer's own GPU
    cpu_file  grpo/sync_file.py     one safetensors file, loaded by each alive server in turn (CPU servers)
    adapter   grpo/sync_adapter.py  a PEFT adapter registered through vLLM's LoRA routes (no pause, no frame)

A transport reads its settings from the session's `WeightSyncConfig` (the one place the sync's configuration
lives; grpo/server_facts.py `sync_config` builds it from the run's config).
"""

from __future__ import annotations

from typing import Protocol

from torch import nn


class Transport(Protocol):
    name: str
    """`nccl`, `ipc`, `cpu_file` or `adapter`: what the logs, errors and the sync probe call this path."""
    pauses: bool
    """True: `send` runs on rank 0 inside WeightSync's pause/resume frame. False (adapter): `send` is the whole
    sync, on every rank, without pausing generation."""

    def open(self, model: nn.Module, infos: dict[int, dict]) -> None:
        """Once, at init, after the send plan exists: rank 0 (every rank when not `pauses`); `infos` maps each
        alive server to its /server_info (rank 0)."""

    def send(self, model: nn.Module, version: int) -> dict[str, float]:
        """Move the weights of `version` to every alive server (start -> update -> finish on each); extra timing
        metrics. A failure raises WeightSyncError or drops the server through the session."""

    def close(self) -> None:
        """Release the channel (group, buffers, kept files)."""


def make_transport(mode: str, session) -> Transport:
    """The transport for a resolved mode (`auto` is resolved by WeightSync.init first); `session` is the
    grpo.weight_sync.WeightSync it serves (its servers, config, plan and phases)."""
    if mode == "adapter":
        from grpo.sync_adapter import AdapterTransport

        return AdapterTransport(session)
    if mode == "nccl":
        from grpo.sync_nccl import NcclTransport

        return NcclTransport(session)
    if mode == "ipc":
        from grpo.sync_ipc import IpcTransport

        return IpcTransport(session)
    if mode == "cpu_file":
        from grpo.sync_file import FileTransport

        return FileTransport(session)
    raise ValueError(f"unknown weight transfer {mode!r}: choose nccl, ipc, cpu_file or auto")
