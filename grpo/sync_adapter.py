"""The `adapter` weight transport (grpo/lora.py): each sync writes the PEFT adapter as `<name>-v<version>/` and
registers it on every server through vLLM's runtime LoRA route, without pausing generation (running requests keep
the adapter they named), then unloads the version that left the staleness window."""

from __future__ import annotations

import time

from grpo.sync_errors import WeightSyncError


class AdapterTransport:
    name, pauses = "adapter", False

    def __init__(self, session):
        self.session = session

    def open(self, model, infos) -> None:
        """Unload this name's adapters an earlier run left registered, and their directories."""
        s = self.session
        if s.rank == 0:
            prefix = f"{s.adapter.name}-v"
            for i in s.alive():
                for name in s.controls[i].lora_adapters():
                    if name.startswith(prefix):
                        s.controls[i].unload_lora_adapter(name)
            s.adapter.clear()

    def send(self, model, version: int) -> dict[str, float]:
        """Gather the adapter (every rank), write it, load it on every server, unload the version that left the
        window. No pause: the weights a running request uses never change."""
        from grpo.lora import adapter_tensors

        s = self.session
        tensors = adapter_tensors(model)
        t_gathered = time.perf_counter()
        if s.rank == 0:
            try:
                path = s.adapter.write(version, tensors, model.peft_config[model.active_adapter])
            except Exception as exc:
                raise WeightSyncError(f"adapter sync (version {version}): writing the adapter failed: {exc}") from exc
            old = s.adapter.loaded_version(version)
            for i in s.alive():
                try:
                    s.controls[i].load_lora_adapter(s.adapter.served_name(version), str(path))
                    for stale in old:
                        s.controls[i].unload_lora_adapter(s.adapter.served_name(stale))
                except Exception as exc:
                    error = WeightSyncError(f"adapter sync to {s.urls[i]} (version {version}) failed: {exc}")
                    s._drop_or_raise(i, error, exc)
        return {"perf/weight_sync_pause_s": 0.0, "perf/weight_sync_transfer_s": time.perf_counter() - t_gathered}

    def close(self) -> None:
        return None
