"""CUDA-IPC weight sync for a trainer on the vLLM server's own GPU, received by vLLM's built-in `ipc` engine.

On one GPU NCCL cannot carry the weights (it refuses two ranks on one device) and `cpu_file` moves every byte
through host memory twice (a safetensors file in /dev/shm: 1.87 s of a 2.37 s step, Qwen3-0.6B shape on an H200).
With CUDA IPC the server reads the trainer's device memory directly. One sync, on rank 0, inside weight_sync.py's
pause -> start -> ... -> finish -> resume:

    for each bucket (consecutive whole parameter groups, about `bucket_bytes`; a larger group travels alone):
        gather its groups (FSDP2 `full_tensor()` on every rank), cast to the server dtype, copy them into one
        fresh uint8 CUDA buffer
        POST /update_weights {names, dtype_names, shapes, ipc_handles_pickled[, tensor_sizes]}
        the answer means the server has loaded the bucket (vLLM's worker synchronises its device before it
        returns): drop the buffer

Wire layout, detected from what the server's engine accepts (no version numbers), best first:
- packed: `/init_weight_transfer_engine {"packed": true}` is accepted (vLLM >= 0.28, where `packed` is a wire
  parameter of the init): one IPC handle per bucket plus `tensor_sizes`; the engine clones each tensor out of it.
- packed per update: the init takes no `packed` but each update does (vLLM 0.26's engine: `packed: true` in
  update_info): the same one-handle bucket, flagged in every /update_weights. Tried on the first bucket; an
  engine that refuses the field gets that bucket again per tensor, and per tensor from then on.
- per tensor: one handle per tensor, views of the same bucket buffer (the server maps the buffer once: torch's
  IPC storage cache). Every engine that accepts `ipc_handles_pickled` reads this layout.
Each handle is `{gpu_uuid: rebuild_cuda_tensor args}` as `torch.multiprocessing.reductions.reduce_tensor` makes
them; the engine looks its own device's UUID up in it.

Lifetime: a bucket's buffer is referenced until the server has answered its /update_weights. Buckets end on group
boundaries, so each of vLLM's layers receives all its weights in one call and its layerwise reload copies them
before answering. If the server still maps a dropped buffer, torch's CUDA-IPC refcount (Note [CUDA IPC
Refcounting implementation explained]) keeps the block out of the caching allocator until the server lets go
(`torch.cuda.ipc_collect()` returns it): memory the server may read is never handed out again. So the trainer
holds one bucket and one group's gather at a time, never a second copy of the model.

Security: the handles travel as a pickle, which the server unpickles only with VLLM_ALLOW_INSECURE_SERIALIZATION=1:
anyone who can POST to that server can then run code in it. Bind the server to 127.0.0.1; the trainer refuses ipc
towards a URL whose host is not loopback.
"""

from __future__ import annotations

import base64
import logging
import pickle
import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from grpo.ipc_placement import (BACKEND, CUDA_CONTEXT_BYTES, OneGpuMemoryError, OneGpuMemoryPlan,  # noqa: F401
                                ServerView, TransferChoice, check_ipc_servers, choose_transfer, device_uuid,
                                is_loopback, nvml_uuids, require_loopback, same_gpu, server_fraction,
                                server_view, server_visible_device, trainer_peak_bytes, trainer_visible_device)

log = logging.getLogger("grpo.ipc_transfer")

DEFAULT_BUCKET_BYTES = 256 << 20
TRANSFER_BUCKETS = 4
"""Bucket-sized transients of one sync: trainer staging buffer + gather, server clone + layer materialisation."""
PER_TENSOR_ALIGN = 256
"""Byte alignment of each tensor inside a per-tensor-layout buffer (its own handle carries the offset)."""

# ---- buckets and the wire format ------------------------------------------------------------------------------
def plan_buckets(group_bytes: list[int], bucket_bytes: int) -> list[range]:
    """Consecutive whole groups per bucket: a bucket closes before the group that would take it past
    `bucket_bytes`; a group larger than that travels alone. Returns group-index ranges."""
    buckets, start, total = [], 0, 0
    for index, size in enumerate(group_bytes):
        if index > start and total + size > bucket_bytes:
            buckets.append(range(start, index))
            start, total = index, 0
        total += size
    if start < len(group_bytes):
        buckets.append(range(start, len(group_bytes)))
    return buckets


def pickle_handles(handles) -> str:
    """`ipc_handles_pickled`: base64 of the pickled handle dict(s), as vLLM's HTTP clients send them."""
    return base64.b64encode(pickle.dumps(handles)).decode("ascii")


PACKED, PACKED_PER_UPDATE, PER_TENSOR = "packed", "packed per update", "per tensor"
"""The wire layouts (module docstring), best first."""


def packed_update_info(names: list[str], dtype_names: list[str], shapes: list[list[int]], tensor_sizes: list[int],
                       handle: dict, flag: bool = False) -> dict:
    """One bucket, packed layout: one handle for the buffer, `tensor_sizes` bytes per tensor in order; `flag` adds
    `packed: true` (the layout flagged per update, for engines whose init takes no `packed`)."""
    info = {"names": names, "dtype_names": dtype_names, "shapes": shapes, "tensor_sizes": tensor_sizes,
            "ipc_handles_pickled": pickle_handles(handle)}
    return {**info, "packed": True} if flag else info


def per_tensor_update_info(names: list[str], dtype_names: list[str], shapes: list[list[int]],
                           handles: list[dict]) -> dict:
    """One bucket, per-tensor layout: one handle per tensor."""
    return {"names": names, "dtype_names": dtype_names, "shapes": shapes, "ipc_handles_pickled": pickle_handles(handles)}


def share_handle(tensor: torch.Tensor) -> tuple:
    """The `rebuild_cuda_tensor` arguments of a CUDA tensor (what vLLM's engine rebuilds it from)."""
    from torch.multiprocessing.reductions import reduce_tensor

    return reduce_tensor(tensor)[1]


def init_engine(control, timeout: float) -> str:
    """Open the server's ipc engine: PACKED when its init_info takes `packed`, else PACKED_PER_UPDATE (to be tried
    on the first bucket, `IpcChannel.send`).

    A refused `packed` answers 500 (the worker's init_info dataclass rejects the field; the server lives on). Any
    refusal but a missing route falls back to {}, so an engine whose error text differs is still detected; a
    server that refuses {} too raises that second error."""
    from grpo.vllm_client import VLLMServerError

    try:
        control.init_weight_transfer_engine({"packed": True}, timeout=timeout)
        return PACKED
    except VLLMServerError as exc:
        if exc.status == 404:  # no dev routes: the fallback cannot help, and the hint says why
            raise
        log.info("ipc engine refused init_info {'packed': true} (%s); trying `packed` per update",
                 exc.message[:200])
    _again_after_a_reset(lambda: control.init_weight_transfer_engine({}, timeout=timeout))
    return PACKED_PER_UPDATE


@dataclass
class IpcChannel:
    """Rank 0's sending side of one server's ipc engine (`open` it once, then `send` every sync)."""

    control: object
    layout: str  # PACKED, PACKED_PER_UPDATE (until an engine refuses it) or PER_TENSOR
    uuid: str
    bucket_bytes: int
    timeout: float
    device: torch.device | None
    buckets_sent: int = 0
    fill_s: float = 0.0  # of the last send: gathering + casting + copying into buckets
    post_s: float = 0.0  # of the last send: the /update_weights calls (the server rebuilds, clones and loads)

    @property
    def packed(self) -> bool:
        return self.layout != PER_TENSOR

    def send(self, plan) -> int:
        """Every tensor of `plan` in buckets, each POSTed and answered before the next is built. Returns bytes."""
        from grpo.nccl_broadcast import tensor_nbytes

        manifest = plan.manifest
        dtypes = [getattr(torch, d) for d in manifest["dtype_names"]]
        sizes = [tensor_nbytes(s, d) for s, d in zip(manifest["shapes"], dtypes)]
        starts = [0]
        for group in plan.groups:
            starts.append(starts[-1] + len(group.names))
        group_bytes = [sum(sizes[a:b]) for a, b in zip(starts, starts[1:])]
        source = plan.iter_tensors(self.device, cast=False)  # _fill casts as it copies
        sent, self.fill_s, self.post_s = 0, 0.0, 0.0
        for groups in plan_buckets(group_bytes, self.bucket_bytes):
            indices = range(starts[groups.start], starts[groups.stop])
            t0 = time.perf_counter()
            buffer, offsets = self._fill(source, manifest, indices, sizes, dtypes)
            t1 = time.perf_counter()
            self._post(buffer, offsets, manifest, indices, sizes, dtypes)
            self.fill_s += t1 - t0
            self.post_s += time.perf_counter() - t1
            sent += buffer.numel()
            self.buckets_sent += 1
            del buffer  # the server answered: it has loaded this bucket (see the module docstring on lifetime)
            if self.device is not None and self.device.type == "cuda":
                torch.cuda.ipc_collect()
        leftover = next(source, None)
        if leftover is not None:
            raise ValueError(f"weight source yielded {leftover[0]!r} beyond the manifest's {len(sizes)} entries")
        return sent

    def _post(self, buffer: torch.Tensor, offsets: list[int], manifest: dict, indices: range, sizes: list[int],
              dtypes: list[torch.dtype]) -> None:
        """POST one bucket; the first one flagged `packed` per update tells whether the engine takes that field."""
        from grpo.vllm_client import VLLMServerError

        info = self._update_info(buffer, offsets, manifest, indices, sizes, dtypes)
        if self.layout != PACKED_PER_UPDATE or self.buckets_sent:
            return self.control.update_weights(info, timeout=self.timeout)
        try:
            return self.control.update_weights(info, timeout=self.timeout)
        except VLLMServerError as exc:
            if exc.status == 404 or "packed" not in exc.message:
                raise
            log.info("ipc engine refused `packed` in update_info (%s): per-tensor layout from now on", exc.message[:200])
        self.layout = PER_TENSOR
        buffer, offsets = _realigned(buffer, offsets, [sizes[i] for i in indices])
        info = self._update_info(buffer, offsets, manifest, indices, sizes, dtypes)
        _again_after_a_reset(lambda: self.control.update_weights(info, timeout=self.timeout))

    def _fill(self, source: Iterator, manifest: dict, indices: range, sizes: list[int],
              dtypes: list[torch.dtype]) -> tuple[torch.Tensor, list[int]]:
        """Pull the bucket's tensors (this gathers them) into one fresh uint8 buffer: ([bytes], offsets). A source
        tensor in another dtype than the manifest's is cast by the copy into its typed slot of the buffer."""
        from grpo.nccl_broadcast import checked_entry

        align = 1 if self.packed else PER_TENSOR_ALIGN  # packed: vLLM cuts tensor_sizes back to back
        offsets = _offsets([sizes[i] for i in indices], align)
        buffer = torch.empty(offsets[-1] + sizes[indices[-1]] if offsets else 0, dtype=torch.uint8, device=self.device)
        for i, offset in zip(indices, offsets):
            tensor = checked_entry(next(source, None), manifest, i)  # any dtype: the copy casts
            _copy_into(buffer, offset, sizes[i], dtypes[i], tensor)
            del tensor
        if buffer.is_cuda:
            torch.cuda.current_stream(buffer.device).synchronize()
        return buffer, offsets

    def _update_info(self, buffer: torch.Tensor, offsets: list[int], manifest: dict, indices: range,
                     sizes: list[int], dtypes: list[torch.dtype]) -> dict:
        names = [manifest["names"][i] for i in indices]
        dtype_names = [manifest["dtype_names"][i] for i in indices]
        shapes = [list(manifest["shapes"][i]) for i in indices]
        if self.packed:
            return packed_update_info(names, dtype_names, shapes, [sizes[i] for i in indices],
                                      {self.uuid: share_handle(buffer)}, flag=self.layout == PACKED_PER_UPDATE)
        views = [buffer[o:o + sizes[i]].view(dtypes[i]).view(manifest["shapes"][i]) for i, o in zip(indices, offsets)]
        return per_tensor_update_info(names, dtype_names, shapes, [{self.uuid: share_handle(v)} for v in views])


def _copy_into(buffer: torch.Tensor, offset: int, size: int, dtype: torch.dtype, tensor: torch.Tensor) -> None:
    """`tensor` cast to `dtype` into the bytes [offset, offset + size) of `buffer`: one cast-copy kernel into a
    typed view, or where a packed bucket puts the tensor at an offset its dtype cannot view, cast then byte copy."""
    raw = buffer[offset:offset + size]
    if offset % dtype.itemsize == 0:
        raw.view(dtype).view(tensor.shape).copy_(tensor)
    else:
        raw.copy_(tensor.to(dtype).contiguous().view(-1).view(torch.uint8))


def _offsets(sizes: list[int], align: int) -> list[int]:
    offsets, end = [], 0
    for size in sizes:
        end = -(-end // align) * align
        offsets.append(end)
        end += size
    return offsets


def _realigned(buffer: torch.Tensor, offsets: list[int], sizes: list[int]) -> tuple[torch.Tensor, list[int]]:
    """A back-to-back bucket copied into a per-tensor one (each tensor at a PER_TENSOR_ALIGN boundary)."""
    new_offsets = _offsets(sizes, PER_TENSOR_ALIGN)
    out = torch.empty(new_offsets[-1] + sizes[-1] if sizes else 0, dtype=torch.uint8, device=buffer.device)
    for old, new, size in zip(offsets, new_offsets, sizes):
        out[new:new + size].copy_(buffer[old:old + size])
    if out.is_cuda:
        torch.cuda.current_stream(out.device).synchronize()
    return out, new_offsets


def _again_after_a_reset(call) -> None:
    """`call()`, once more on a transport error: vLLM 0.26 resets the kept-alive connection after answering a
    refused request with a 500."""
    import httpx

    try:
        call()
    except httpx.TransportError:
        call()


def open_channel(control, view: ServerView, info: dict, plan, model: torch.nn.Module, bucket_bytes: int,
                 timeout: float) -> IpcChannel:
    """Rank 0, once: refuse what cannot work (the server's serialization switch, the one-GPU memory plan), open
    the server's engine and detect its layout."""
    check_ipc_servers([view])
    insecure = (info.get("vllm_env") or {}).get("VLLM_ALLOW_INSECURE_SERIALIZATION")
    if insecure is not None and str(insecure).lower() not in ("true", "1"):
        raise ValueError(f"the vLLM server at {view.url} refuses pickled IPC handles: restart it with "
                         "VLLM_ALLOW_INSECURE_SERIALIZATION=1 (and --host 127.0.0.1)")
    from grpo.nccl_broadcast import tensor_nbytes

    manifest = plan.manifest
    sizes = [tensor_nbytes(s, getattr(torch, d)) for s, d in zip(manifest["shapes"], manifest["dtype_names"])]
    starts = [0]
    for group in plan.groups:
        starts.append(starts[-1] + len(group.names))
    largest_group = max((sum(sizes[a:b]) for a, b in zip(starts, starts[1:])), default=0)
    bucket = max(bucket_bytes, largest_group)
    on_cuda = torch.cuda.is_available() and any(p.is_cuda for p in model.parameters())
    device = torch.device("cuda", torch.cuda.current_device()) if on_cuda else None
    if on_cuda:
        fraction = server_fraction(info)
        if fraction is None:
            log.info("one-GPU memory plan skipped: the server sizes its KV cache in bytes (--kv-cache-memory-bytes)")
        else:
            memory = OneGpuMemoryPlan(torch.cuda.mem_get_info(device)[1], fraction,
                                      trainer_peak_bytes(model, device), TRANSFER_BUCKETS * bucket)
            memory.check()
            log.info("one-GPU memory plan: server %.2f x %.1f GiB + trainer %.1f GiB (peak %.1f + sync %.2f + context "
                     "%.1f) fits", fraction, memory.total_bytes / 2**30, memory.trainer_bytes / 2**30,
                     memory.trainer_peak_bytes / 2**30, memory.transfer_bytes / 2**30, memory.context_bytes / 2**30)
    uuid = device_uuid(device) if on_cuda else "cpu"
    layout = init_engine(control, timeout)
    log.info("ipc engine of %s: %s layout%s, buckets of up to %.0f MiB (%d tensors, %.0f MiB per sync)", view.url,
             layout, " (one handle per bucket)" if layout == PACKED else " to be tried on the first bucket",
             bucket / 2**20, len(sizes), sum(sizes) / 2**20)
    return IpcChannel(control, layout, uuid, bucket, timeout, device)
