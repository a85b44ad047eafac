"""The `cpu_file` weight transport: one safetensors file (tmpfs when there is one), loaded by each alive server in
turn through the project's vLLM plugin backend (grpo/vllm_plugin.py). A server that fails its load is dropped when
others are left. On several trainer ranks with rejoin enabled the last version's file is kept, so rank 0 can
cold-sync a returning server alone (grpo/rejoin.py)."""

from __future__ import annotations

import os
import tempfile

from grpo.sync_deadline import finish_quietly


class FileTransport:
    name, pauses = "cpu_file", True

    def __init__(self, session):
        self.session = session
        self.kept_file: str | None = None

    def open(self, model, infos) -> None:
        s = self.session
        for i in s.alive():
            s.controls[i].init_weight_transfer_engine({}, timeout=s.config.timeout)

    def send(self, model, version: int) -> dict[str, float]:
        from safetensors.torch import save_file

        s = self.session
        state = {name: tensor.to("cpu").clone() for name, tensor in s.plan.iter_tensors()}
        tmp_dir = s.config.tmp_dir or ("/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir())
        fd, path = tempfile.mkstemp(prefix="grpo_weights_", suffix=".safetensors", dir=tmp_dir)
        os.close(fd)
        keep = s.world_size > 1 and s._can_rejoin_alone()  # rank 0 alone cannot gather: keep the file
        try:
            save_file(state, path)
            del state
            for i in s.alive():
                self.load(i, path, version)
        finally:
            if keep:
                if self.kept_file:
                    os.unlink(self.kept_file)
                self.kept_file = path
            else:
                os.unlink(path)
        return {}

    def load(self, i: int, path: str, version: int) -> None:
        """start -> update (the safetensors file) -> finish on server i; a failure drops it (or raises)."""
        s = self.session
        control, started = s.controls[i], False
        try:
            s._phase(i, "start", version, control.start_weight_update)
            started = True
            s._phase(i, "transfer", version, lambda: control.update_weights({"path": path}, timeout=s.config.timeout))
            s._phase(i, "finish", version, lambda: control.finish_weight_update(weight_version=str(version)))
        except Exception as exc:
            if started:
                finish_quietly(control, s.phase_deadline)
            s._drop_or_raise(i, s.transfer_error([s.urls[i]], version, exc), exc)

    def close(self) -> None:
        if self.kept_file:
            os.unlink(self.kept_file)
            self.kept_file = None
