"""The `ipc` weight transport: CUDA-IPC buckets to the one vLLM server on the trainer's own GPU (grpo/ipc_transfer.py
holds the channel and the wire layouts). Also serves a server started with the `ipc_inplace` backend."""

from __future__ import annotations

import time

import torch

from grpo.sync_deadline import finish_quietly


class IpcTransport:
    name, pauses = "ipc", True

    def __init__(self, session):
        self.session = session
        self.channel = None  # grpo.ipc_transfer.IpcChannel (rank 0)
        self.views: list = []  # grpo.ipc_placement.ServerView per alive server, from WeightSync's choice of mode

    def open(self, model, infos) -> None:
        from grpo.ipc_transfer import open_channel

        s = self.session
        (i,) = s.alive()
        self.channel = open_channel(s.controls[i], self.views[0], infos[i], s.plan, model, s.config.ipc_bucket_bytes,
                                    s.config.timeout)

    def send(self, model, version: int) -> dict[str, float]:
        """One server on this GPU: start, one /update_weights per bucket (each answered before the next bucket is
        gathered), finish. A dead or stuck server fails the HTTP call within the timeout."""
        s = self.session
        (i,) = s.alive()
        control, started = s.controls[i], False
        try:
            t0 = time.perf_counter()
            control.start_weight_update()
            started = True
            t_started = time.perf_counter()
            self.channel.send(s.plan)
            t_sent = time.perf_counter()
            control.finish_weight_update(weight_version=str(version))
            times = {"perf/weight_sync_start_s": t_started - t0, "perf/weight_sync_fill_s": self.channel.fill_s,
                     "perf/weight_sync_update_s": self.channel.post_s,
                     "perf/weight_sync_finish_s": time.perf_counter() - t_sent}
            if self.channel.device is not None and self.channel.device.type == "cuda":
                torch.cuda.ipc_collect()  # the server let go of the last bucket at finish
            return times
        except Exception as exc:
            if started:
                finish_quietly(control, s.phase_deadline)
            raise s.transfer_error([s.urls[i]], version, exc) from exc

    def close(self) -> None:
        self.channel = None
