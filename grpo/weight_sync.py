"""Trainer -> vLLM weight sync: the only module that touches the trainer<->server transfer group.

One `WeightSync` per trainer rank. `init(model)` once (rendezvous), then `sync(model, version)` every
`weight_sync_steps` optimizer steps, and once before rollouts start (the cold sync, so the first rollouts are
version 1 [TRL]). The caller publishes `version` after `sync` returns. The protocol (docs/design.md §14.3):

    rank 0: POST /pause?mode=keep      (clears the prefix cache, preempting in-flight requests)
    all:    barrier
    rank 0: POST /start_weight_update  (no body: TRL #7103)
    all:    gather one layer group at a time (FSDP2 `full_tensor()`, the same order on every rank)
    rank 0: POST /update_weights with the manifest while broadcasting packed chunks (nccl), or with a safetensors
            file path (cpu_file, this project's CPU plugin backend, grpo/vllm_plugin.py)
    rank 0: POST /finish_weight_update {"weight_version": str(version)}
    all:    barrier;  rank 0: POST /resume

A PEFT policy is sent merged: each LoRA delta (scale x B @ A) is added to its gathered base weight as it is sent,
so the server serves exactly the trained policy and the trainer's own weights are never modified (PEFT's in-place
merge is wrong on FSDP2 shards). Unless `adapter` is given (grpo/lora.py): then each sync writes the adapter in PEFT
format and registers it through vLLM's runtime LoRA route as `<name>-v<version>`, without pausing generation
(running requests keep the adapter they named), and unloads the version that left the staleness window.

Names are HF checkpoint names, what vLLM's `load_weights` expects: wrapper prefixes are stripped and transformers'
in-memory conversions (e.g. fused MoE experts `mlp.experts.gate_up_proj`) are reverted with the same
`revert_weight_conversion` that `save_pretrained` uses. Frozen parameters (a VLM's vision tower) are not sent; the
server keeps them as loaded. Floating tensors are cast to the server dtype before sending (fp32 -> bf16 halves the
bytes), and the manifest declares that dtype.
"""

from __future__ import annotations

import os
import re
import socket
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Literal
from urllib.parse import urlparse

import torch
from torch import nn

from grpo.vllm_server import free_port

_WRAPPER_PARTS = {"_checkpoint_wrapped_module", "_orig_mod", "_fsdp_wrapped_module", "base_layer"}
_LEADING_WRAPPERS = ("module.", "base_model.model.")


class WeightSyncError(RuntimeError):
    """A weight sync failed; the server may hold partial weights and stay paused: restart it."""


@dataclass(frozen=True)
class WeightSyncConfig:
    mode: Literal["nccl", "cpu_file"] = "nccl"
    """`nccl`: packed NCCL broadcast to the vLLM workers (GPU). `cpu_file`: safetensors file on a shared
    filesystem, read by the project's vLLM plugin backend (CPU servers)."""
    timeout: float = 1800.0
    """Seconds for each HTTP call, the rendezvous and the transfer; past it the sync raises instead of hanging."""
    buffer_size_bytes: int = 1 << 30
    """NCCL packed chunk size; travels in init_info so the workers cut the same chunks."""
    num_buffers: int = 2
    """NCCL chunks in flight (double buffering); travels in init_info."""
    server_dtype: str | None = None
    """Dtype to send floating weights in ("bfloat16", ...); None = the server's, from /server_info."""
    master_address: str | None = None
    """Address the vLLM workers reach this trainer on for the NCCL rendezvous; None = the local address of the
    route to the server."""
    tmp_dir: str | None = None
    """cpu_file: where the safetensors file goes; None = /dev/shm when present (tmpfs), else the temp dir."""


# ---- names ------------------------------------------------------------------------------------------------------
def checkpoint_name(name: str) -> str:
    """`module._orig_mod.model.layers.0._checkpoint_wrapped_module.mlp.up_proj.base_layer.weight` ->
    `model.layers.0.mlp.up_proj.weight` (DDP, torch.compile, activation checkpointing, FSDP1, PEFT wrappers)."""
    changed = True
    while changed:
        changed = False
        for prefix in _LEADING_WRAPPERS:
            if name.startswith(prefix):
                name, changed = name[len(prefix):], True
    return ".".join(part for part in name.split(".") if part not in _WRAPPER_PARTS)


def is_adapter_param(name: str) -> bool:
    """PEFT adapter tensors (`lora_A`, `lora_B`, `lora_embedding_*`, `lora_magnitude_vector`): merged, never sent."""
    return any(part.startswith("lora_") for part in name.split("."))


def _hf_model(model: nn.Module) -> nn.Module | None:
    """The transformers model inside any wrapper: its `_weight_conversions` say how to revert to checkpoint form."""
    from transformers import PreTrainedModel

    return next((m for m in model.modules() if isinstance(m, PreTrainedModel)), None)


def _group_key(name: str) -> str:
    """Parameters converted together live under one numbered module (`model.layers.3.`); the rest by parent."""
    match = re.match(r"^(.*?\.\d+)\.", name)
    return match.group(1) if match else name.rsplit(".", 1)[0]


@dataclass
class _Group:
    params: list[tuple[str, nn.Parameter]]
    """(in-memory checkpoint-style name, parameter), in model order."""
    names: list[str] = field(default_factory=list)
    shapes: list[list[int]] = field(default_factory=list)
    dtypes: list[torch.dtype] = field(default_factory=list)
    """What this group becomes after reverting transformers' conversions (checkpoint names, in send order)."""
    lora: dict = field(default_factory=dict)
    """in-memory checkpoint-style name -> LoRA terms merged into it when sent (grpo.lora.LoraTerm)."""


def _revert(hf_model: nn.Module | None, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    if hf_model is None:
        return tensors
    from transformers.core_model_loading import revert_weight_conversion

    return revert_weight_conversion(hf_model, tensors)


@dataclass
class SendPlan:
    """What every rank iterates (groups, for the gathers) and what rank 0 declares (the manifest)."""

    groups: list[_Group]
    hf_model: nn.Module | None
    send_dtype: torch.dtype | None
    has_dtensors: bool
    peft_merge: bool = False
    """The adapter is not plain LoRA: merge it into the model with PEFT around the transfer (one process only)."""

    @property
    def manifest(self) -> dict:
        names, dtypes, shapes = [], [], []
        for group in self.groups:
            names += group.names
            shapes += group.shapes
            dtypes += [str(self._wire_dtype(d)).removeprefix("torch.") for d in group.dtypes]
        return {"names": names, "dtype_names": dtypes, "shapes": shapes}

    def _wire_dtype(self, dtype: torch.dtype) -> torch.dtype:
        return self.send_dtype if self.send_dtype is not None and dtype.is_floating_point else dtype

    def iter_tensors(self, device: torch.device | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """(checkpoint name, full tensor in the wire dtype) in manifest order. Every rank must run it to the end:
        materialising a DTensor is a collective."""
        with torch.no_grad():
            for group in self.groups:
                full = {name: _materialize(param) for name, param in group.params}
                for name, terms in group.lora.items():
                    full[name] = full[name] + sum(t.delta(_materialize) for t in terms).to(full[name].dtype)
                reverted = _revert(self.hf_model, full)
                for name, dtype in zip(group.names, group.dtypes):
                    tensor = reverted[name].to(dtype=self._wire_dtype(dtype))
                    yield name, (tensor if device is None else tensor.to(device))


def _materialize(param: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return param.full_tensor() if isinstance(param, DTensor) else param.detach()


def build_plan(model: nn.Module, send_dtype: torch.dtype | None = None) -> SendPlan:
    """Group the parameters to send and work out their checkpoint names and shapes from meta tensors (no gather:
    a DTensor's shape is global). Frozen parameters are skipped unless the model carries PEFT adapters, whose
    frozen base weights are exactly what a merged sync sends."""
    from torch.distributed.tensor import DTensor

    hf_model = _hf_model(model)
    named = list((hf_model or model).named_parameters())
    peft = any(is_adapter_param(name) for name, _ in named)
    terms = {}
    if peft:
        from grpo.lora import lora_terms

        terms = lora_terms(hf_model or model)
    groups: dict[str, _Group] = {}
    for raw_name, param in named:
        if is_adapter_param(raw_name) or not (param.requires_grad or peft):
            continue
        name = checkpoint_name(raw_name)
        group = groups.setdefault(_group_key(name), _Group(params=[]))
        group.params.append((name, param))
        if terms and raw_name in terms:
            group.lora[name] = terms[raw_name]
    if not groups:
        raise ValueError("no parameter to send: every parameter is frozen (requires_grad=False)")

    def meta(group_params):
        return {n: torch.empty(p.shape, dtype=p.dtype, device="meta") for n, p in group_params}

    for group in groups.values():
        reverted = _revert(hf_model, meta(group.params))
        group.names = list(reverted)
        group.shapes = [list(t.shape) for t in reverted.values()]
        group.dtypes = [t.dtype for t in reverted.values()]
    everything = _revert(hf_model, meta([p for g in groups.values() for p in g.params]))
    per_group = {n: s for g in groups.values() for n, s in zip(g.names, g.shapes)}
    if per_group != {n: list(t.shape) for n, t in everything.items()}:
        # A conversion spans groups: revert the whole model at once (more memory, still correct).
        merged = _Group(params=[p for g in groups.values() for p in g.params], names=list(everything),
                        shapes=[list(t.shape) for t in everything.values()],
                        dtypes=[t.dtype for t in everything.values()],
                        lora={n: t for g in groups.values() for n, t in g.lora.items()})
        groups = {"": merged}
    has_dtensors = any(isinstance(p, DTensor) for g in groups.values() for _, p in g.params)
    if terms is None and has_dtensors:
        raise ValueError("merged sync of a sharded PEFT model supports plain LoRA linears only (no DoRA, embedding or "
                         "convolution adapters, no other PEFT methods): change the peft_config")
    return SendPlan(list(groups.values()), hf_model, send_dtype, has_dtensors, peft_merge=terms is None)


# ---- the protocol -----------------------------------------------------------------------------------------------
def _dist_rank_world() -> tuple[int, int]:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


def _barrier() -> None:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.barrier()


def _dtype_from_server_info(info: dict) -> torch.dtype | None:
    dtype = (info.get("vllm_config") or {}).get("model_config", {}).get("dtype")
    if not isinstance(dtype, str):
        return None
    return getattr(torch, dtype.removeprefix("torch."), None)


def local_address_towards(base_url: str) -> str:
    """The address of this host on the route to the server (a UDP connect sends nothing)."""
    host = urlparse(base_url).hostname or "127.0.0.1"
    if host in ("localhost", "::1") or host.startswith("127."):
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((host, 9))
        return s.getsockname()[0]


def _start_thread(fn, what: str) -> tuple[threading.Thread, dict]:
    """Run `fn` on a daemon thread, joined with a deadline (`_join`): a stuck call must not hang the trainer."""
    result: dict = {}

    def target():
        try:
            result["value"] = fn()
        except BaseException as exc:  # surfaced to the caller below
            result["error"] = exc

    thread = threading.Thread(target=target, daemon=True, name=what)
    thread.start()
    return thread, result


def _join(thread: threading.Thread, result: dict, timeout: float, what: str):
    thread.join(timeout)
    if thread.is_alive():
        raise TimeoutError(f"{what} did not return within {timeout:.0f} s")
    if "error" in result:
        raise result["error"]
    return result.get("value")


class WeightSync:
    """Trainer side of the weight sync; create one on every rank (only rank 0 talks to the server)."""

    def __init__(self, base_url: str, config: WeightSyncConfig = WeightSyncConfig(), adapter=None):
        self.base_url, self.config = base_url, config
        self.adapter = adapter  # grpo.lora.AdapterVersions: adapter-only sync to an --enable-lora server
        self.rank, self.world_size = _dist_rank_world()
        self.control = None
        self.group = None
        self.plan: SendPlan | None = None
        if self.rank == 0:
            from grpo.vllm_client import VLLMControl

            self.control = VLLMControl(base_url, timeout=config.timeout)

    def init(self, model: nn.Module) -> None:
        """Once, on every rank, before the first sync: plan the tensors and open the transfer channel."""
        if self.adapter is not None:
            self._init_adapter()
            return
        send_dtype = None
        if self.rank == 0:
            send_dtype = (getattr(torch, self.config.server_dtype) if self.config.server_dtype
                          else _dtype_from_server_info(self.control.server_info()))
        self.plan = build_plan(model, send_dtype)
        if self.rank == 0:
            if self.config.mode == "nccl":
                self._init_nccl()
            else:
                self.control.init_weight_transfer_engine({}, timeout=self.config.timeout)
        _barrier()

    def _init_nccl(self) -> None:
        """The workers block in /init_weight_transfer_engine until rank 0 joins: run the HTTP call beside it."""
        from grpo.nccl_broadcast import NcclGroup

        workers = self.control.world_size()
        address = self.config.master_address or local_address_towards(self.base_url)
        port = free_port("")  # every interface: the vLLM workers connect to master_address
        init_info = {"master_address": address, "master_port": port, "rank_offset": 1, "world_size": workers + 1,
                     "packed": True, "packed_buffer_size_bytes": self.config.buffer_size_bytes,
                     "packed_num_buffers": self.config.num_buffers}
        thread, result = _start_thread(
            lambda: self.control.init_weight_transfer_engine(init_info, timeout=self.config.timeout), "vllm-init")
        self.group = NcclGroup(address, port, rank=0, world_size=workers + 1, timeout=self.config.timeout)
        _join(thread, result, self.config.timeout, "POST /init_weight_transfer_engine")

    def sync(self, model: nn.Module, version: int) -> dict[str, float]:
        """Push the current weights; the server serves `version` afterwards. Returns perf/weight_sync_* seconds."""
        if self.adapter is not None:
            return self._sync_adapter(model, version)
        if self.plan is None:
            raise RuntimeError("WeightSync.sync before init(model): call init once on every rank first")
        t0 = time.perf_counter()
        if self.rank == 0:
            self._control_call("pause", version, lambda: self.control.pause(mode="keep"))
        t_paused = time.perf_counter()
        _barrier()
        t_barrier = time.perf_counter()
        merged = self.plan.peft_merge and _merge_adapter(model)
        try:
            self._transfer(version)
        finally:
            if merged:
                model.unmerge_adapter()
        t_sent = time.perf_counter()
        _barrier()
        if self.rank == 0:
            self._control_call("resume", version, self.control.resume)
        return {"perf/weight_sync_s": time.perf_counter() - t0,
                "perf/weight_sync_pause_s": t_paused - t0,
                "perf/weight_sync_barrier_s": t_barrier - t_paused,
                "perf/weight_sync_transfer_s": t_sent - t_barrier}

    def _control_call(self, what: str, version: int, call) -> None:
        """POST /pause or /resume; any failure becomes a WeightSyncError naming the URL and the fix."""
        try:
            call()
        except Exception as exc:
            raise WeightSyncError(f"weight sync to {self.base_url} (version {version}): POST /{what} failed: "
                                  f"{type(exc).__name__}: {exc}\n  Check that the server is up and reachable "
                                  f"(GET {self.base_url}/health); a server left paused is resumed by the next run's "
                                  f"cold sync, or restart it.") from exc

    def _transfer(self, version: int) -> None:
        """start -> update -> finish on rank 0, gathers on every rank; on error finish best-effort and raise."""
        if self.rank != 0:
            for _ in self.plan.iter_tensors():
                pass
            return
        started = False
        try:
            self.control.start_weight_update()
            started = True
            if self.config.mode == "nccl":
                self._send_nccl()
            else:
                self._send_file()
            self.control.finish_weight_update(weight_version=str(version))
        except Exception as exc:
            if started:
                try:
                    self.control.finish_weight_update(weight_version=None)
                except Exception:  # the server is usually dead or wedged by now; the original error matters
                    pass
            raise WeightSyncError(f"weight sync to {self.base_url} (version {version}) failed: {exc}\n  The server "
                                  "may hold partial weights and stay paused: restart it before training on.") from exc

    def _send_nccl(self) -> None:
        from grpo.nccl_broadcast import packed_broadcast_send

        manifest = self.plan.manifest
        thread, result = _start_thread(
            lambda: self.control.update_weights(manifest, timeout=self.config.timeout), "vllm-update")
        thread.join(0.05)  # an update rejected before any NCCL call fails fast: surface it instead of broadcasting
        if not thread.is_alive() and "error" in result:
            raise result["error"]
        packed_broadcast_send(self.group, self.plan.iter_tensors(self.group.device), manifest,
                              self.config.buffer_size_bytes, self.config.num_buffers,
                              drain_before_next=self.plan.has_dtensors)
        _join(thread, result, self.config.timeout, "POST /update_weights")

    def _send_file(self) -> None:
        from safetensors.torch import save_file

        state = {name: tensor.to("cpu").clone() for name, tensor in self.plan.iter_tensors()}
        tmp_dir = self.config.tmp_dir or ("/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir())
        fd, path = tempfile.mkstemp(prefix="grpo_weights_", suffix=".safetensors", dir=tmp_dir)
        os.close(fd)
        try:
            save_file(state, path)
            del state
            self.control.update_weights({"path": path}, timeout=self.config.timeout)
        finally:
            os.unlink(path)

    def _init_adapter(self) -> None:
        """Unload this name's adapters an earlier run left registered, and their directories."""
        if self.rank == 0:
            prefix = f"{self.adapter.name}-v"
            for name in self.control.lora_adapters():
                if name.startswith(prefix):
                    self.control.unload_lora_adapter(name)
            self.adapter.clear()
        _barrier()

    def _sync_adapter(self, model: nn.Module, version: int) -> dict[str, float]:
        """Gather the adapter (every rank), write `<name>-v<version>/`, load it, then unload the version that left
        the window. No pause: the weights a running request uses never change."""
        from grpo.lora import adapter_tensors

        t0 = time.perf_counter()
        tensors = adapter_tensors(model)
        t_gathered = time.perf_counter()
        if self.rank == 0:
            try:
                path = self.adapter.write(version, tensors, model.peft_config[model.active_adapter])
                self.control.load_lora_adapter(self.adapter.served_name(version), str(path))
                for old in self.adapter.loaded_version(version):
                    self.control.unload_lora_adapter(self.adapter.served_name(old))
            except Exception as exc:
                raise WeightSyncError(f"adapter sync to {self.base_url} (version {version}) failed: {exc}") from exc
        t_sent = time.perf_counter()
        _barrier()
        return {"perf/weight_sync_s": time.perf_counter() - t0, "perf/weight_sync_pause_s": 0.0,
                "perf/weight_sync_transfer_s": t_sent - t_gathered}

    def close(self) -> None:
        if self.group is not None:
            self.group.close()
            self.group = None
        if self.control is not None:
            self.control.close()


def _merge_adapter(model: nn.Module) -> bool:
    """A PEFT adapter that is not plain LoRA is merged by PEFT for the transfer and unmerged after."""
    if callable(getattr(model, "merge_adapter", None)) and callable(getattr(model, "unmerge_adapter", None)):
        model.merge_adapter()
        return True
    return False
