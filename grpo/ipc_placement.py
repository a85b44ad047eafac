"""Where a vLLM server runs relative to this trainer, and what that allows: loopback-only ipc, the same-GPU test
(device UUIDs), the transfer `auto` picks (with the reason it logs), and the one-GPU memory plan. The sender that
uses them is grpo/ipc_transfer.py.
"""

from __future__ import annotations

import ipaddress
import logging
import math
import os
from dataclasses import dataclass
from urllib.parse import urlparse

import torch

log = logging.getLogger("grpo.ipc_transfer")

BACKEND = "ipc"
IPC_BACKENDS = (BACKEND, "ipc_inplace")
"""Server backends that take the ipc sender's updates: vLLM's own, and the same receiver loading in place
(grpo/vllm_ipc_inplace.py)."""
CUDA_CONTEXT_BYTES = 1 << 30
"""The trainer process's CUDA context, cuBLAS/NCCL workspaces: on the GPU but outside the allocator's counts."""


class OneGpuMemoryError(RuntimeError):
    """The vLLM server's memory share and the trainer's measured peak do not fit on their one GPU."""


# ---- where the server runs ------------------------------------------------------------------------------------
def is_loopback(url: str) -> bool:
    host = urlparse(url).hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def require_loopback(url: str) -> None:
    if not is_loopback(url):
        raise ValueError(f"ipc weight transfer refused for {url}: the CUDA-IPC handles travel pickled and the server "
                         "unpickles them (VLLM_ALLOW_INSECURE_SERIALIZATION=1), so it must listen on loopback only. "
                         "Start it with --host 127.0.0.1 and pass --vllm-server-base-url http://127.0.0.1:PORT")


def device_uuid(device: torch.device) -> str:
    """The key vLLM's ipc engine looks its device up by: `str(get_device_properties(i).uuid)` (no "GPU-")."""
    return str(torch.cuda.get_device_properties(device).uuid)


def nvml_uuids() -> list[str]:
    """UUIDs ("GPU-...") of every GPU NVML sees, in NVML order (what vLLM maps CUDA_VISIBLE_DEVICES indices
    through); [] when NVML is not there. torch's helper is private, so it is feature-detected."""
    raw = getattr(torch.cuda, "_raw_device_uuid_nvml", None)
    try:
        return list(raw() or []) if raw is not None else []
    except Exception:  # no driver library on this host
        return []


def _norm(uuid: str) -> str:
    return uuid.strip().lower().removeprefix("gpu-")


def server_visible_device(info: dict) -> str | None:
    """The first entry of the server's CUDA_VISIBLE_DEVICES ("0", "GPU-8f2...", "0" when unset), read from the
    environment `/server_info` reports (`system_env.env_vars`); None when it reports none."""
    env_text = (info.get("system_env") or {}).get("env_vars")
    if not isinstance(env_text, str):
        return None
    for line in env_text.splitlines():
        key, _, value = line.partition("=")
        if key.strip() == "CUDA_VISIBLE_DEVICES":
            return value.split(",")[0].strip()
    return "0"


def trainer_visible_device(index: int) -> str:
    """This process's device `index` as CUDA_VISIBLE_DEVICES names it (the physical index or UUID)."""
    entries = os.environ.get("CUDA_VISIBLE_DEVICES")
    if entries is None:
        return str(index)
    names = [e.strip() for e in entries.split(",")]
    return names[index] if index < len(names) else str(index)


def same_gpu(info: dict, url: str, trainer_uuid: str, trainer_spec: str, uuids: list[str]) -> tuple[bool | None, str]:
    """Whether the server's (first) worker runs on the trainer's GPU: True / False / None (cannot tell), and why.

    The trainer's UUID is exact; the server's comes from its CUDA_VISIBLE_DEVICES (a UUID, or an index resolved
    through NVML). Equal visible-device names count only for a loopback URL (same host)."""
    device = str(((info.get("vllm_config") or {}).get("device_config") or {}).get("device", ""))
    if device == "cpu":
        return False, "the server runs on CPU"
    spec = server_visible_device(info)
    if spec is None:
        return None, "its /server_info reports no CUDA_VISIBLE_DEVICES (system_env.env_vars)"
    if spec == "":
        return False, "its CUDA_VISIBLE_DEVICES is empty"
    server_uuid = uuids[int(spec)] if spec.isdigit() and int(spec) < len(uuids) else (
        spec if spec.lower().startswith("gpu-") else None)
    if server_uuid is not None:
        a, b = _norm(server_uuid), _norm(trainer_uuid)
        return (a.startswith(b) or b.startswith(a)), f"server GPU {server_uuid}, trainer GPU {trainer_uuid}"
    if is_loopback(url) and spec == trainer_spec:
        return True, f"both use device {spec} of this host (CUDA_VISIBLE_DEVICES)"
    if is_loopback(url) and spec.isdigit() and trainer_spec.isdigit():
        return False, f"server device {spec}, trainer device {trainer_spec} (CUDA_VISIBLE_DEVICES)"
    return None, f"its device {spec!r} cannot be resolved to a UUID here (no NVML)"


# ---- which transfer -------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ServerView:
    """What the choice needs to know about one server."""

    url: str
    backend: str | None
    """`--weight-transfer-config` backend from /server_info (None: not reported)."""
    world_size: int
    same_gpu: bool | None
    detail: str


def server_view(url: str, info: dict, world_size: int, trainer_uuid: str | None, trainer_spec: str,
                uuids: list[str]) -> ServerView:
    backend = ((info.get("vllm_config") or {}).get("weight_transfer_config") or {}).get("backend")
    if trainer_uuid is None:  # auto never picks ipc for a CPU trainer; an explicit ipc is left to the engine
        verdict, detail = None, "the trainer is not on a GPU"
    else:
        verdict, detail = same_gpu(info, url, trainer_uuid, trainer_spec, uuids)
    return ServerView(url, backend, world_size, verdict, detail)


def check_ipc_servers(servers: list[ServerView]) -> None:
    """What ipc needs of the server side, whatever chose it; raises ValueError naming the fix."""
    if len(servers) != 1:
        raise ValueError(f"ipc weight transfer serves one vLLM server on the trainer's GPU, got {len(servers)}: use "
                         "nccl for several servers")
    (server,) = servers
    require_loopback(server.url)
    if server.world_size != 1:
        raise ValueError(f"ipc weight transfer sends to one vLLM worker; {server.url} has {server.world_size} "
                         "(tensor/pipeline/data parallel): serve with one GPU, or put the trainer on other GPUs and "
                         "use nccl")
    if server.backend not in (None, *IPC_BACKENDS):
        raise ValueError(f"the vLLM server at {server.url} runs the {server.backend!r} weight-transfer backend; ipc "
                         "needs --weight-transfer-config '{\"backend\": \"ipc\"}' and VLLM_ALLOW_INSECURE_SERIALIZATION=1")
    if server.same_gpu is False:
        raise ValueError(f"ipc needs the vLLM server on the trainer's GPU, and {server.url} is not ({server.detail}); "
                         "use nccl")


@dataclass(frozen=True)
class TransferChoice:
    mode: str
    reason: str


def choose_transfer(requested: str, trainer_on_cuda: bool, servers: list[ServerView]) -> TransferChoice:
    """`auto`: ipc when the (one) server runs on the trainer's GPU or was started for ipc; else the servers'
    backend (nccl / cpu_file), by the trainer's device when they do not say. An explicit mode is validated only
    for ipc. A same-GPU server on the nccl backend raises: NCCL cannot put two ranks on one GPU."""
    if requested == BACKEND:
        check_ipc_servers(servers)
        return TransferChoice(BACKEND, "asked for (--weight-transfer ipc)")
    if requested != "auto":
        return TransferChoice(requested, f"asked for (--weight-transfer {requested})")
    if not trainer_on_cuda:
        return TransferChoice("cpu_file", "the trainer runs on CPU")
    first = servers[0]
    if first.same_gpu and len(servers) == 1:
        if first.backend == "cpu_file":
            return TransferChoice("cpu_file", f"the server shares this GPU ({first.detail}) but serves the cpu_file "
                                              "backend; restart it with the ipc backend for the fast path")
        if first.backend in (None, *IPC_BACKENDS):
            check_ipc_servers(servers)
            return TransferChoice(BACKEND, f"the server runs on this trainer's GPU ({first.detail})"
                                           f"{_inplace_hint(first)}")
        raise ValueError(f"the vLLM server at {first.url} runs on this trainer's GPU ({first.detail}) with the "
                         f"{first.backend!r} weight-transfer backend: NCCL cannot put two ranks on one GPU. Restart "
                         "it with --weight-transfer-config '{\"backend\": \"ipc\"}' and "
                         "VLLM_ALLOW_INSECURE_SERIALIZATION=1 (or pass --weight-transfer cpu_file)")
    if any(s.backend in IPC_BACKENDS for s in servers):
        check_ipc_servers(servers)  # started for ipc: only a one-server, loopback, one-worker setup makes sense
        return TransferChoice(BACKEND, f"the server was started with the {first.backend} backend ({first.detail})"
                                       f"{_inplace_hint(first)}")
    if all(s.backend == "cpu_file" for s in servers):
        return TransferChoice("cpu_file", "the servers serve the cpu_file backend")
    why = first.detail if len(servers) == 1 else f"{len(servers)} servers"
    return TransferChoice("nccl", f"the server is not on this trainer's GPU or cannot be told to be ({why})")


def _inplace_hint(server: ServerView) -> str:
    """vLLM's own `ipc` engine reloads layer by layer: on an unquantized model `ipc_inplace` updates ~3x faster
    (Qwen3-0.6B shape on an H200: 0.04 s against 0.14-0.15 s, docs/results.md)."""
    if server.backend != BACKEND:
        return ""
    return ("; an unquantized model updates ~3x faster with the server backend 'ipc_inplace' "
            "(`rollout.py serve --server.weight-transfer-backend ipc_inplace`)")


# ---- one-GPU memory plan --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class OneGpuMemoryPlan:
    """Server and trainer on one GPU fit by construction: vLLM may use `server_fraction` of the whole device
    (`--gpu-memory-utilization`: its weights, activations and KV cache), the trainer needs its measured peak plus
    the sync's transients and its CUDA context."""

    total_bytes: int
    server_fraction: float
    trainer_peak_bytes: int
    transfer_bytes: int
    context_bytes: int = CUDA_CONTEXT_BYTES

    @property
    def trainer_bytes(self) -> int:
        return self.trainer_peak_bytes + self.transfer_bytes + self.context_bytes

    @property
    def max_server_fraction(self) -> float:
        """The largest --gpu-memory-utilization that still leaves the trainer its share (floored to 0.01)."""
        return math.floor(100 * (self.total_bytes - self.trainer_bytes) / self.total_bytes) / 100

    def check(self) -> None:
        server = self.server_fraction * self.total_bytes
        if server + self.trainer_bytes <= self.total_bytes:
            return
        gib = 2**30
        hint = (f"restart the server with --gpu-memory-utilization {self.max_server_fraction:.2f} or lower"
                if self.max_server_fraction > 0 else "the trainer alone does not fit beside any server")
        raise OneGpuMemoryError(
            f"the vLLM server and the trainer do not fit on their one GPU ({self.total_bytes / gib:.1f} GiB): the "
            f"server may use gpu_memory_utilization {self.server_fraction:.2f} x {self.total_bytes / gib:.1f} = "
            f"{server / gib:.1f} GiB and the trainer needs {self.trainer_bytes / gib:.1f} GiB (measured peak "
            f"{self.trainer_peak_bytes / gib:.1f} GiB + {self.transfer_bytes / gib:.2f} GiB weight-sync buckets + "
            f"{self.context_bytes / gib:.1f} GiB CUDA context). Fix: {hint}, or shrink the trainer "
            "(--gradient-checkpointing true, a smaller --token-budget)")


def trainer_peak_bytes(model: torch.nn.Module, device: torch.device) -> int:
    """The trainer's footprint so far: the allocator's peak reservation (under --gradient-checkpointing auto that
    is the worst-case probe micro-batch) plus the AdamW state (2 x fp32 per local trainable element) the first
    optimizer step still has to allocate (none when a resumed optimizer already holds it)."""
    def local(p):
        return p.to_local() if hasattr(p, "to_local") else p

    params = [local(p) for p in model.parameters()]
    param_bytes = sum(p.numel() * p.element_size() for p in params)
    adam_bytes = 8 * sum(local(p).numel() for p in model.parameters() if p.requires_grad)
    already_held = torch.cuda.memory_allocated(device) - param_bytes  # a loaded optimizer state, gradients
    peak = max(torch.cuda.max_memory_reserved(device), torch.cuda.memory_reserved(device))
    return int(peak + max(0, adam_bytes - already_held))


def server_fraction(info: dict) -> float | None:
    """vLLM's --gpu-memory-utilization; None when the server sized its KV cache in bytes instead."""
    cache = (info.get("vllm_config") or {}).get("cache_config") or {}
    if cache.get("kv_cache_memory_bytes"):
        return None
    value = cache.get("gpu_memory_utilization")
    return float(value) if value is not None else None
