"""The `nccl` weight transport: every alive server's workers and rank 0 of the trainer in one NCCL group; the
manifest goes to each server's /update_weights while the packed chunks are broadcast once (grpo/nccl_broadcast.py).
A change in the set of servers re-forms the group over the survivors before the transfer; a server that dies during
the broadcast itself fails the sync (the collective cannot finish)."""

from __future__ import annotations

import logging
import socket
from urllib.parse import urlparse

from grpo.sync_deadline import finish_quietly, join_within, start_thread, wait_phase
from grpo.vllm_server import free_port

log = logging.getLogger("grpo.weight_sync")


def local_address_towards(base_url: str) -> str:
    """The address of this host on the route to the server (a UDP connect sends nothing)."""
    host = urlparse(base_url).hostname or "127.0.0.1"
    if host in ("localhost", "::1") or host.startswith("127."):
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((host, 9))
        return s.getsockname()[0]


class NcclTransport:
    name, pauses = "nccl", True

    def __init__(self, session):
        self.session = session
        self.group = None
        self.members: tuple[int, ...] = ()

    def open(self, model, infos) -> None:
        self._form_group()

    def _form_group(self) -> None:
        """One group over the alive servers' workers (world size read from each server: TP x PP x DP). The workers
        block in /init_weight_transfer_engine until rank 0 joins: the HTTP calls run beside it."""
        from grpo.nccl_broadcast import NcclGroup, nccl_rank_offsets

        s, config = self.session, self.session.config
        if self.group is not None:
            self.group.close()
        members = s.alive()
        offsets, world = nccl_rank_offsets([s.controls[i].world_size() for i in members])
        address = config.master_address or local_address_towards(s.urls[members[0]])
        port = free_port("")  # every interface: the vLLM workers connect to master_address
        calls = []
        for i, offset in zip(members, offsets):
            init_info = {"master_address": address, "master_port": port, "rank_offset": offset, "world_size": world,
                         "packed": True, "packed_buffer_size_bytes": config.buffer_size_bytes,
                         "packed_num_buffers": config.num_buffers}
            control = s.controls[i]
            calls.append((i, *start_thread(
                lambda c=control, info=init_info: c.init_weight_transfer_engine(info, timeout=config.timeout),
                f"vllm-init-{i}")))
        self.group = NcclGroup(address, port, rank=0, world_size=world, timeout=config.timeout)
        for i, thread, result in calls:
            join_within(thread, result, config.timeout, f"POST {s.urls[i]}/init_weight_transfer_engine")
        self.members = tuple(members)

    def send(self, model, version: int) -> dict[str, float]:
        """All alive servers in one broadcast; the group is re-formed first when the set of servers changed."""
        s = self.session
        members = s.alive()
        started = []
        try:
            if tuple(members) != self.members:
                log.warning("re-forming the NCCL weight-transfer group over %d servers", len(members))
                self._form_group()
            for i in members:
                s._phase(i, "start", version, s.controls[i].start_weight_update)
                started.append(i)
            self._broadcast(members, version)
            for i in members:
                s._phase(i, "finish", version,
                         lambda c=s.controls[i]: c.finish_weight_update(weight_version=str(version)))
        except Exception as exc:
            for i in started:
                finish_quietly(s.controls[i], s.phase_deadline)
            raise s.transfer_error([s.urls[i] for i in members], version, exc) from exc
        return {}

    def _broadcast(self, members: list[int], version: int) -> None:
        from grpo.nccl_broadcast import packed_broadcast_send

        s, config = self.session, self.session.config
        manifest = s.plan.manifest
        calls = [(i, *start_thread(lambda c=s.controls[i]: c.update_weights(manifest, timeout=config.timeout),
                                    f"vllm-update-{i}")) for i in members]
        for _, thread, result in calls:
            thread.join(0.05)  # an update rejected before any NCCL call fails fast: surface it instead of broadcasting
            if not thread.is_alive() and "error" in result:
                raise result["error"]
        packed_broadcast_send(self.group, s.plan.iter_tensors(self.group.device), manifest,
                              config.buffer_size_bytes, config.num_buffers, drain_before_next=s.plan.has_dtensors)
        for i, thread, result in calls:
            wait_phase(thread, result, s.urls[i], "transfer", version, s.phase_deadline, config.progress_every)

    def close(self) -> None:
        if self.group is not None:
            self.group.close()
            self.group = None
