"""Trainer -> vLLM weight sync: the only module that touches the trainer<->server transfer group.

One `WeightSync` per trainer rank, for one or several vLLM servers. `init(model)` once (rendezvous), then
`sync(model, version)` every `weight_sync_steps` optimizer steps, and once before rollouts start (the cold sync, so
the first rollouts are version 1 [TRL]). The caller publishes `version` after `sync` returns. The protocol
(docs/design.md §14.3), every server in each rank-0 step:

    rank 0: POST /pause?mode=keep      (every server; clears the prefix cache, preempting in-flight requests)
    all:    barrier
    rank 0: POST /start_weight_update  (every server; no body: TRL #7103)
    all:    gather one layer group at a time (FSDP2 `full_tensor()`, the same order on every rank)
    rank 0: POST /update_weights with the manifest to every server while broadcasting packed chunks once into one
            NCCL group spanning all their workers (nccl), or with one safetensors file path per server (cpu_file,
            this project's CPU plugin backend, grpo/vllm_plugin.py), or one call per bucket of CUDA-IPC handles
            to a server on the trainer's own GPU (ipc, vLLM's engine; grpo/ipc_transfer.py)
    rank 0: POST /finish_weight_update {"weight_version": str(version)}  (every server)
    all:    barrier;  rank 0: POST /resume (every server)

Several servers (docs/design.md, "Several vLLM servers"): a server that fails its part of a sync (dead, or
answering errors) is dropped from the set with a warning when another one is left, and the run continues on the
rest; the last server's failure raises `WeightSyncError` as with one server, unless the run can wait for it to
come back (`rejoin_wait_s`, below). `alive_flags` (0/1 per server) is shared with the rollout worker, which stops
sending to a dropped server and marks the ones it finds dead, so the next sync skips them. With NCCL a change of the set re-forms the group over the survivors before the transfer;
a server that dies during the broadcast itself fails the sync (the collective cannot finish).

A PEFT policy is sent merged (grpo/send_plan.py) so the trainer's own weights are never modified (PEFT's in-place
merge is wrong on FSDP2 shards). Unless `adapter` is given (grpo/lora.py): then each sync writes the adapter in PEFT
format and registers it on every server through vLLM's runtime LoRA route as `<name>-v<version>`, without pausing
generation (running requests keep the adapter they named), and unloads the version that left the staleness window.

Deadlines and rejoin (docs/reliability.md): every server's part of every phase runs under `phase_timeout` with a
progress line naming the server and the phase (grpo/sync_deadline.py). Rank 0 probes dropped servers every
`rejoin_interval_s` (grpo/rejoin.py); one that passes joins the next sync (a cold sync of that version) and its
flag is set again only after it. With no server left, rank 0 waits up to `rejoin_wait_s` for one, and cold-syncs it
alone (`rejoin_alone`): from the model with one trainer rank, from the kept safetensors file of the last version
with cpu_file on several ranks; NCCL on several ranks and ipc cannot do that alone and raise as before.
"""

from __future__ import annotations

import logging
import os
import socket
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal
from urllib.parse import urlparse

import torch
from torch import nn

from grpo.rejoin import Rejoiner, RejoinMixin
from grpo.send_plan import SendPlan, build_plan, checkpoint_name, is_adapter_param  # noqa: F401 (public names)
from grpo.sync_deadline import call_phase, finish_quietly, join_within, start_thread, wait_phase
from grpo.sync_errors import WeightSyncError  # also the name tests and callers catch from here
from grpo.vllm_server import free_port

log = logging.getLogger("grpo.weight_sync")


@dataclass(frozen=True)
class WeightSyncConfig:
    mode: Literal["auto", "nccl", "cpu_file", "ipc"] = "nccl"
    """`nccl`: packed NCCL broadcast to the vLLM workers (GPU). `cpu_file`: safetensors file on a shared
    filesystem, read by the project's vLLM plugin backend (CPU servers). `ipc`: CUDA-IPC handles to vLLM's `ipc`
    engine on the trainer's own GPU (loopback URL only). `auto`: decided at `init` from the servers
    (grpo.ipc_transfer.choose_transfer: ipc on the trainer's GPU, else their backend) and logged."""
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
    route to the first server."""
    tmp_dir: str | None = None
    """cpu_file: where the safetensors file goes; None = /dev/shm when present (tmpfs), else the temp dir."""
    ipc_bucket_bytes: int = 256 << 20
    """ipc: bytes gathered and shared per /update_weights call (whole parameter groups; a larger group alone)."""
    phase_timeout: float | None = None
    """Deadline for each server's part of each phase (pause, start, transfer, finish, resume); None = a little past
    `timeout`."""
    progress_every: float = 30.0
    """Seconds between progress lines while a phase waits for a server."""
    keep_kv_cache: bool = False
    """Pause with clear_cache=false (`sync_keeps_kv_cache`): in-flight requests keep their KV across the sync."""
    rejoin_interval_s: float = 0.0
    """Seconds between probes of a dropped server (0 = never probed: dropped servers stay out)."""
    rejoin_wait_s: float = 0.0
    """With no server left after a sync, how long rank 0 waits for one to come back (0 = raise at once)."""


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


class WeightSync(RejoinMixin):
    """Trainer side of the weight sync; create one on every rank (only rank 0 talks to the servers)."""

    def __init__(self, base_url: str | Sequence[str], config: WeightSyncConfig = WeightSyncConfig(), adapter=None):
        self.urls = [base_url] if isinstance(base_url, str) else list(base_url)
        self.base_url, self.config = self.urls[0], config
        self.adapter = adapter  # grpo.lora.AdapterVersions: adapter-only sync to an --enable-lora server
        self.rank, self.world_size = _dist_rank_world()
        self.alive_flags = [1] * len(self.urls)
        """0/1 per server; train.py swaps in the array it shares with the rollout worker."""
        self.controls: list = []
        self.group = None
        self._group_members: tuple[int, ...] = ()
        self.plan: SendPlan | None = None
        self.mode = config.mode
        self.ipc = None  # grpo.ipc_transfer.IpcChannel (rank 0, mode ipc)
        self._transfer_times: dict[str, float] = {}  # ipc: where the last transfer's seconds went (rank 0)
        self.rejoiner = Rejoiner(self.urls, config.rejoin_interval_s)
        """`rejoiner.probe = fn(url) -> None | reason` (train.py) enables rejoin."""
        self._joining: set[int] = set()  # dropped servers taking part in this sync; alive after it
        self._kept_file: str | None = None  # cpu_file on several ranks: the last version, for a lone rejoin
        self._none_left: WeightSyncError | None = None
        if config.mode == "ipc":  # refused before anything is sent: the handles travel pickled
            from grpo.ipc_transfer import require_loopback

            if len(self.urls) != 1:
                raise ValueError(f"ipc weight transfer serves one vLLM server, got {len(self.urls)}: use nccl")
            require_loopback(self.urls[0])
        if self.rank == 0:
            from grpo.vllm_client import VLLMControl

            self.controls = [VLLMControl(url, timeout=config.timeout) for url in self.urls]

    @property
    def control(self):
        """The first server's control client (rank 0; None elsewhere)."""
        return self.controls[0] if self.controls else None

    def alive(self) -> list[int]:
        """Servers this sync goes to: alive ones and those rejoining."""
        return [i for i in range(len(self.urls)) if self.alive_flags[i] or i in self._joining]

    def dropped(self) -> list[int]:
        return [i for i in range(len(self.urls)) if not self.alive_flags[i] and i not in self._joining]

    @property
    def phase_deadline(self) -> float:
        """weight_sync_timeout; unset, a little past the HTTP timeout (so the HTTP error comes first)."""
        return self.config.phase_timeout or self.config.timeout + 5.0

    def _phase(self, i: int, phase: str, version: int, fn: Callable):
        return call_phase(fn, self.urls[i], phase, version, self.phase_deadline, self.config.progress_every)

    def init(self, model: nn.Module) -> None:
        """Once, on every rank, before the first sync: plan the tensors and open the transfer channel."""
        if self.adapter is not None:
            self._init_adapter()
            return
        send_dtype = infos = None
        if self.rank == 0:
            infos = {i: self.controls[i].server_info() for i in self.alive()}
            send_dtype = (getattr(torch, self.config.server_dtype) if self.config.server_dtype
                          else _dtype_from_server_info(infos[self.alive()[0]]))
            if self.config.mode in ("auto", "ipc"):
                self.mode = self._choose_mode(model, infos)
        self.mode = _broadcast_str(self.mode)
        self.plan = build_plan(model, send_dtype)
        if self.rank == 0:
            if self.mode == "nccl":
                self._init_nccl()
            elif self.mode == "ipc":
                from grpo.ipc_transfer import open_channel

                (i,) = self.alive()
                self.ipc = open_channel(self.controls[i], self._views[0], infos[i], self.plan, model,
                                        self.config.ipc_bucket_bytes, self.config.timeout)
            else:
                for i in self.alive():
                    self.controls[i].init_weight_transfer_engine({}, timeout=self.config.timeout)
        _barrier()

    def _choose_mode(self, model: nn.Module, infos: dict) -> str:
        """Rank 0: `auto` resolved from the servers (or `ipc` validated), with the reason in the log."""
        from grpo.ipc_transfer import choose_transfer, device_uuid, nvml_uuids, server_view, trainer_visible_device

        on_cuda = torch.cuda.is_available() and any(p.is_cuda for p in model.parameters())
        uuid = device_uuid(torch.cuda.current_device()) if on_cuda else None
        spec = trainer_visible_device(torch.cuda.current_device()) if on_cuda else ""
        uuids = nvml_uuids() if on_cuda else []
        self._views = [server_view(self.urls[i], infos[i], self.controls[i].world_size(), uuid, spec, uuids)
                       for i in self.alive()]
        choice = choose_transfer(self.config.mode, on_cuda, self._views)
        if choice.mode == "ipc" and self._views[0].same_gpu is None:
            log.warning("ipc: cannot tell whether %s runs on this trainer's GPU (%s); vLLM's engine checks the GPU "
                        "UUID at the first update", self._views[0].url, self._views[0].detail)
        log.info("weight transfer: %s (%s)", choice.mode, choice.reason)
        return choice.mode

    def _init_nccl(self) -> None:
        """One group over the alive servers' workers (world size read from each server: TP x PP x DP). The workers
        block in /init_weight_transfer_engine until rank 0 joins: the HTTP calls run beside it."""
        from grpo.nccl_broadcast import NcclGroup, nccl_rank_offsets

        if self.group is not None:
            self.group.close()
        members = self.alive()
        offsets, world = nccl_rank_offsets([self.controls[i].world_size() for i in members])
        address = self.config.master_address or local_address_towards(self.urls[members[0]])
        port = free_port("")  # every interface: the vLLM workers connect to master_address
        calls = []
        for i, offset in zip(members, offsets):
            init_info = {"master_address": address, "master_port": port, "rank_offset": offset, "world_size": world,
                         "packed": True, "packed_buffer_size_bytes": self.config.buffer_size_bytes,
                         "packed_num_buffers": self.config.num_buffers}
            control = self.controls[i]
            calls.append((i, *start_thread(
                lambda c=control, info=init_info: c.init_weight_transfer_engine(info, timeout=self.config.timeout),
                f"vllm-init-{i}")))
        self.group = NcclGroup(address, port, rank=0, world_size=world, timeout=self.config.timeout)
        for i, thread, result in calls:
            join_within(thread, result, self.config.timeout, f"POST {self.urls[i]}/init_weight_transfer_engine")
        self._group_members = tuple(members)

    def sync(self, model: nn.Module, version: int) -> dict[str, float]:
        """Push the current weights; the servers serve `version` afterwards. Returns perf/weight_sync_* seconds."""
        if self.adapter is not None:
            return self._sync_adapter(model, version)
        if self.plan is None:
            raise RuntimeError("WeightSync.sync before init(model): call init once on every rank first")
        t0 = time.perf_counter()
        if self.rank == 0:
            self._admit_rejoiners()
            self._each("pause", version, lambda c: c.pause(mode="keep", clear_cache=not self.config.keep_kv_cache))
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
            self._each("resume", version, lambda c: c.resume())
            for i in sorted(self._joining):
                self._confirm(i, version)
            if not self.alive():
                self._wait_for_rejoin(model, version)
        return {"perf/weight_sync_s": time.perf_counter() - t0,
                "perf/weight_sync_pause_s": t_paused - t0,
                "perf/weight_sync_barrier_s": t_barrier - t_paused,
                "perf/weight_sync_transfer_s": t_sent - t_barrier, **self._transfer_times}

    def _each(self, what: str, version: int, call: Callable) -> None:
        """POST /pause or /resume to every alive server; a failure becomes a WeightSyncError naming the URL and the
        fix, which drops that server when another one is left (`_drop_or_raise`)."""
        for i in self.alive():
            try:
                self._phase(i, what, version, lambda c=self.controls[i]: call(c))
            except Exception as exc:
                url = self.urls[i]
                error = WeightSyncError(
                    f"weight sync to {url} (version {version}): POST /{what} failed: {type(exc).__name__}: {exc}\n"
                    f"  Check that the server is up and reachable (GET {url}/health); a server left paused is "
                    f"resumed by the next run's cold sync, or restart it.")
                self._drop_or_raise(i, error, exc)

    def _drop_or_raise(self, i: int, error: WeightSyncError, cause: BaseException) -> None:
        if i in self._joining:  # a rejoining server that failed again stays dropped
            self._joining.discard(i)
            self.rejoiner.failed(i, error)
            return
        if not [j for j in self.alive() if j != i and j not in self._joining]:
            if not self._can_rejoin_alone():
                raise error from cause
            error.__cause__ = cause
            self._none_left = error
        self.alive_flags[i] = 0
        self.rejoiner.dropped(i)
        log.warning("dropping vLLM server %s from the run (%d left): %s", self.urls[i], len(self.alive()), error)

    def _transfer(self, version: int) -> None:
        """start -> update -> finish on rank 0, gathers on every rank; on error finish best-effort and raise."""
        if self.rank != 0 or (not self.alive() and self.mode != "cpu_file"):
            for _ in self.plan.iter_tensors():  # the gathers are collective: rank 0 takes part with no server
                pass
            return
        if self.mode == "nccl":
            self._transfer_nccl(version)
        elif self.mode == "ipc":
            self._transfer_ipc(version)
        else:
            self._transfer_file(version)

    def _transfer_error(self, urls: list[str], version: int, exc: BaseException) -> WeightSyncError:
        return WeightSyncError(f"weight sync to {', '.join(urls)} (version {version}) failed: {exc}\n  The server "
                               "may hold partial weights and stay paused: restart it before training on.")

    def _transfer_nccl(self, version: int) -> None:
        """All alive servers in one broadcast; the group is re-formed first when the set of servers changed."""
        members = self.alive()
        started = []
        try:
            if tuple(members) != self._group_members:
                log.warning("re-forming the NCCL weight-transfer group over %d servers", len(members))
                self._init_nccl()
            for i in members:
                self._phase(i, "start", version, self.controls[i].start_weight_update)
                started.append(i)
            self._send_nccl(members, version)
            for i in members:
                self._phase(i, "finish", version,
                            lambda c=self.controls[i]: c.finish_weight_update(weight_version=str(version)))
        except Exception as exc:
            for i in started:
                finish_quietly(self.controls[i], self.phase_deadline)
            raise self._transfer_error([self.urls[i] for i in members], version, exc) from exc

    def _send_nccl(self, members: list[int], version: int) -> None:
        from grpo.nccl_broadcast import packed_broadcast_send

        manifest = self.plan.manifest
        calls = [(i, *start_thread(lambda c=self.controls[i]: c.update_weights(manifest, timeout=self.config.timeout),
                                    f"vllm-update-{i}")) for i in members]
        for _, thread, result in calls:
            thread.join(0.05)  # an update rejected before any NCCL call fails fast: surface it instead of broadcasting
            if not thread.is_alive() and "error" in result:
                raise result["error"]
        packed_broadcast_send(self.group, self.plan.iter_tensors(self.group.device), manifest,
                              self.config.buffer_size_bytes, self.config.num_buffers,
                              drain_before_next=self.plan.has_dtensors)
        for i, thread, result in calls:
            wait_phase(thread, result, self.urls[i], "transfer", version, self.phase_deadline,
                       self.config.progress_every)

    def _transfer_ipc(self, version: int) -> None:
        """One server on this GPU: start, one /update_weights per bucket (each answered before the next bucket is
        gathered), finish. A dead or stuck server fails the HTTP call within the timeout."""
        (i,) = self.alive()
        control, started = self.controls[i], False
        try:
            t0 = time.perf_counter()
            control.start_weight_update()
            started = True
            t_started = time.perf_counter()
            self.ipc.send(self.plan)
            t_sent = time.perf_counter()
            control.finish_weight_update(weight_version=str(version))
            self._transfer_times = {"perf/weight_sync_start_s": t_started - t0,
                                    "perf/weight_sync_fill_s": self.ipc.fill_s,
                                    "perf/weight_sync_update_s": self.ipc.post_s,
                                    "perf/weight_sync_finish_s": time.perf_counter() - t_sent}
            if self.ipc.device is not None and self.ipc.device.type == "cuda":
                torch.cuda.ipc_collect()  # the server let go of the last bucket at finish
        except Exception as exc:
            if started:
                finish_quietly(control, self.phase_deadline)
            raise self._transfer_error([self.urls[i]], version, exc) from exc

    def _transfer_file(self, version: int) -> None:
        """One safetensors file, loaded by each alive server in turn; a server that fails is dropped if others
        are left."""
        from safetensors.torch import save_file

        state = {name: tensor.to("cpu").clone() for name, tensor in self.plan.iter_tensors()}
        tmp_dir = self.config.tmp_dir or ("/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir())
        fd, path = tempfile.mkstemp(prefix="grpo_weights_", suffix=".safetensors", dir=tmp_dir)
        os.close(fd)
        keep = self.world_size > 1 and self._can_rejoin_alone()  # rank 0 alone cannot gather: keep the file
        try:
            save_file(state, path)
            del state
            for i in self.alive():
                self._load_file(i, path, version)
        finally:
            if keep:
                if self._kept_file:
                    os.unlink(self._kept_file)
                self._kept_file = path
            else:
                os.unlink(path)

    def _load_file(self, i: int, path: str, version: int) -> None:
        """start -> update (the safetensors file) -> finish on server i; a failure drops it (or raises)."""
        control, started = self.controls[i], False
        try:
            self._phase(i, "start", version, control.start_weight_update)
            started = True
            self._phase(i, "transfer", version, lambda: control.update_weights({"path": path},
                                                                                timeout=self.config.timeout))
            self._phase(i, "finish", version, lambda: control.finish_weight_update(weight_version=str(version)))
        except Exception as exc:
            if started:
                finish_quietly(control, self.phase_deadline)
            self._drop_or_raise(i, self._transfer_error([self.urls[i]], version, exc), exc)

    def _init_adapter(self) -> None:
        """Unload this name's adapters an earlier run left registered, and their directories."""
        if self.rank == 0:
            prefix = f"{self.adapter.name}-v"
            for i in self.alive():
                for name in self.controls[i].lora_adapters():
                    if name.startswith(prefix):
                        self.controls[i].unload_lora_adapter(name)
            self.adapter.clear()
        _barrier()

    def _sync_adapter(self, model: nn.Module, version: int) -> dict[str, float]:
        """Gather the adapter (every rank), write `<name>-v<version>/`, load it on every server, then unload the
        version that left the window. No pause: the weights a running request uses never change."""
        from grpo.lora import adapter_tensors

        t0 = time.perf_counter()
        tensors = adapter_tensors(model)
        t_gathered = time.perf_counter()
        if self.rank == 0:
            try:
                path = self.adapter.write(version, tensors, model.peft_config[model.active_adapter])
            except Exception as exc:
                raise WeightSyncError(f"adapter sync (version {version}): writing the adapter failed: {exc}") from exc
            old = self.adapter.loaded_version(version)
            for i in self.alive():
                try:
                    self.controls[i].load_lora_adapter(self.adapter.served_name(version), str(path))
                    for stale in old:
                        self.controls[i].unload_lora_adapter(self.adapter.served_name(stale))
                except Exception as exc:
                    error = WeightSyncError(f"adapter sync to {self.urls[i]} (version {version}) failed: {exc}")
                    self._drop_or_raise(i, error, exc)
        t_sent = time.perf_counter()
        _barrier()
        return {"perf/weight_sync_s": time.perf_counter() - t0, "perf/weight_sync_pause_s": 0.0,
                "perf/weight_sync_transfer_s": t_sent - t_gathered}

    def close(self) -> None:
        if self._kept_file:
            os.unlink(self._kept_file)
            self._kept_file = None
        if self.group is not None:
            self.group.close()
            self.group = None
        for control in self.controls:
            control.close()


def _broadcast_str(value: str) -> str:
    """Rank 0's value on every rank (the transfer mode rank 0 chose)."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return value
    box = [value]
    torch.distributed.broadcast_object_list(box, src=0)
    return box[0]


def _merge_adapter(model: nn.Module) -> bool:
    """A PEFT adapter that is not plain LoRA is merged by PEFT for the transfer and unmerged after."""
    if callable(getattr(model, "merge_adapter", None)) and callable(getattr(model, "unmerge_adapter", None)):
        model.merge_adapter()
        return True
    return False
