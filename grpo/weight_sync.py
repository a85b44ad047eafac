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
sending to a dropped server and marks the ones it finds dead, so the next sync skips them. With NCCL a change of
the set re-forms the group over the survivors before the transfer; a server that dies during the broadcast itself
fails the sync (the collective cannot finish).

This module holds the servers and the frame; each transport (nccl, ipc, cpu_file, adapter) is its own module
behind the protocol in grpo/sync_transport.py (docs/design.md §14.6). When `probe` is set (train.py), a sync
ends with the sync probe (grpo/sync_probe.py, §14.7): server == trainer log-probs, or the run stops.

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
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from grpo.rejoin import Rejoiner, RejoinMixin
from grpo.send_plan import SendPlan, build_plan, checkpoint_name, is_adapter_param  # noqa: F401 (public names)
from grpo.sync_deadline import call_phase
from grpo.sync_errors import WeightSyncError  # also the name tests and callers catch from here
from grpo.sync_nccl import local_address_towards  # noqa: F401 (public name)
from grpo.sync_transport import Transport, make_transport

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


class WeightSync(RejoinMixin):
    """Trainer side of the weight sync; create one on every rank (only rank 0 talks to the servers). The servers,
    the phases and the pause/resume frame live here; how the tensors travel is `transport`'s business
    (grpo/sync_transport.py)."""

    def __init__(self, base_url: str | Sequence[str], config: WeightSyncConfig = WeightSyncConfig(), adapter=None):
        self.urls = [base_url] if isinstance(base_url, str) else list(base_url)
        self.base_url, self.config = self.urls[0], config
        self.adapter = adapter  # grpo.lora.AdapterVersions: adapter-only sync to an --enable-lora server
        self.rank, self.world_size = _dist_rank_world()
        self.alive_flags = [1] * len(self.urls)
        """0/1 per server; train.py swaps in the array it shares with the rollout worker."""
        self.controls: list = []
        self.plan: SendPlan | None = None
        self.mode = config.mode
        self.transport: Transport = make_transport(
            "adapter" if adapter is not None else config.mode if config.mode in ("nccl", "ipc") else "cpu_file", self)
        """`auto` starts as cpu_file and is resolved at `init`."""
        self.probe = None
        """grpo.sync_probe.SyncProbe: server == trainer check after syncs (train.py sets it)."""
        self.rejoiner = Rejoiner(self.urls, config.rejoin_interval_s)
        """`rejoiner.probe = fn(url) -> None | reason` (train.py) enables rejoin."""
        self._joining: set[int] = set()  # dropped servers taking part in this sync; alive after it
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

    @property
    def ipc(self):
        """The CUDA-IPC channel (grpo.ipc_transfer.IpcChannel) when the transport is ipc, else None."""
        return getattr(self.transport, "channel", None)

    @property
    def group(self):
        """The NCCL group when the transport is nccl, else None."""
        return getattr(self.transport, "group", None)

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
        """Once, on every rank, before the first sync: plan the tensors and open the transport."""
        if not self.transport.pauses:
            self.transport.open(model, {})
            _barrier()
            return
        send_dtype = infos = None
        views = []
        if self.rank == 0:
            infos = {i: self.controls[i].server_info() for i in self.alive()}
            send_dtype = (getattr(torch, self.config.server_dtype) if self.config.server_dtype
                          else _dtype_from_server_info(infos[self.alive()[0]]))
            if self.config.mode in ("auto", "ipc"):
                self.mode, views = self._choose_mode(model, infos)
        self.mode = _broadcast_str(self.mode)
        if self.mode != self.transport.name:
            self.transport = make_transport(self.mode, self)
        self.transport.views = views
        self.plan = build_plan(model, send_dtype)
        if self.rank == 0:
            self.transport.open(model, infos)
        _barrier()

    def _choose_mode(self, model: nn.Module, infos: dict) -> tuple[str, list]:
        """Rank 0: `auto` resolved from the servers (or `ipc` validated), with the reason in the log; the servers'
        views (grpo.ipc_placement.ServerView) the ipc transport opens its channel with."""
        from grpo.ipc_transfer import choose_transfer, device_uuid, nvml_uuids, server_view, trainer_visible_device

        on_cuda = torch.cuda.is_available() and any(p.is_cuda for p in model.parameters())
        uuid = device_uuid(torch.cuda.current_device()) if on_cuda else None
        spec = trainer_visible_device(torch.cuda.current_device()) if on_cuda else ""
        uuids = nvml_uuids() if on_cuda else []
        views = [server_view(self.urls[i], infos[i], self.controls[i].world_size(), uuid, spec, uuids)
                 for i in self.alive()]
        choice = choose_transfer(self.config.mode, on_cuda, views)
        if choice.mode == "ipc" and views[0].same_gpu is None:
            log.warning("ipc: cannot tell whether %s runs on this trainer's GPU (%s); vLLM's engine checks the GPU "
                        "UUID at the first update", views[0].url, views[0].detail)
        log.info("weight transfer: %s (%s)", choice.mode, choice.reason)
        return choice.mode, views

    @property
    def _views(self) -> list:
        return getattr(self.transport, "views", [])

    def sync(self, model: nn.Module, version: int) -> dict[str, float]:
        """Push the current weights; the servers serve `version` afterwards. Returns perf/weight_sync_* seconds
        (and the sync probe's metrics when it ran: grpo/sync_probe.py)."""
        if not self.transport.pauses:
            t0 = time.perf_counter()
            times = self.transport.send(model, version)
            _barrier()
            return {"perf/weight_sync_s": time.perf_counter() - t0, **times, **self._check(model, version)}
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
            times = self._transfer(model, version)
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
                "perf/weight_sync_transfer_s": t_sent - t_barrier, **times, **self._check(model, version)}

    def _check(self, model: nn.Module, version: int) -> dict[str, float]:
        return self.probe.after_sync(self, model, version) if self.probe is not None else {}

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

    def _transfer(self, model: nn.Module, version: int) -> dict[str, float]:
        """The transport's send on rank 0, gathers on every rank; on error the transport finishes best-effort and
        raises."""
        if self.rank != 0 or (not self.alive() and self.mode != "cpu_file"):
            for _ in self.plan.iter_tensors():  # the gathers are collective: rank 0 takes part with no server
                pass
            return {}
        return self.transport.send(model, version)

    def transfer_error(self, urls: list[str], version: int, exc: BaseException) -> WeightSyncError:
        return WeightSyncError(f"weight sync to {', '.join(urls)} (version {version}) failed: {exc}\n  The server "
                               "may hold partial weights and stay paused: restart it before training on.")

    def close(self) -> None:
        self.transport.close()
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
