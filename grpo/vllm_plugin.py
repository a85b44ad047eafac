"""vLLM general plugin: the `cpu_file` weight-transfer backend, so the real four-phase weight-update protocol
(init -> pause -> start -> update -> finish -> resume) runs on a CPU-only vLLM server.

vLLM loads every `vllm.general_plugins` entry point in every process it starts (API server, engine core,
workers) and calls `register()`; pyproject.toml declares ours. Only the transport differs from NCCL:
`update_info` carries a safetensors file path (or the file's bytes, base64, for tiny models) instead of a
manifest for a broadcast. The trainer side lives in `weight_sync.py`.

Start the server with `--weight-transfer-config '{"backend": "cpu_file"}'` (rollout.py serve --server.cpu does).
"""

from __future__ import annotations

from dataclasses import dataclass

BACKEND_NAME = "cpu_file"


def register() -> None:
    """Idempotent: plugins can be loaded several times per process tree, and a duplicate name raises in vLLM."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    if BACKEND_NAME in WeightTransferEngineFactory._registry:
        return
    WeightTransferEngineFactory.register_engine(BACKEND_NAME, "grpo.vllm_plugin", "CPUFileWeightTransferEngine")


def _engine_base():
    from vllm.distributed.weight_transfer.base import (
        WeightTransferEngine,
        WeightTransferInitInfo,
        WeightTransferUpdateInfo,
    )

    return WeightTransferEngine, WeightTransferInitInfo, WeightTransferUpdateInfo


_Engine, _InitInfo, _UpdateInfo = _engine_base()


@dataclass
class CPUFileInitInfo(_InitInfo):
    """Nothing to rendezvous: the trainer and the server share a filesystem (or send bytes inline)."""


@dataclass
class CPUFileUpdateInfo(_UpdateInfo):
    path: str | None = None
    """A safetensors file the server can read (tmpfs on one host)."""
    safetensors_b64: str | None = None
    """The safetensors bytes, base64, inline in the request (only sensible for a few MB)."""


class CPUFileWeightTransferEngine(_Engine):
    init_info_cls = CPUFileInitInfo
    update_info_cls = CPUFileUpdateInfo
    supports_draft_weight_update = False

    def init_transfer_engine(self, init_info: CPUFileInitInfo) -> None:
        return None

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)

    def update_weights(self, update_info: dict) -> None:
        # The base class ends with torch.accelerator.synchronize(), which raises on a CPU-only machine.
        self.receive_weights(self.parse_update_info(update_info))

    def receive_weights(self, update_info: CPUFileUpdateInfo) -> None:
        import base64

        from safetensors.torch import load, load_file

        if (update_info.path is None) == (update_info.safetensors_b64 is None):
            raise ValueError("cpu_file update_info needs exactly one of `path` or `safetensors_b64`")
        if update_info.path is not None:
            state = load_file(update_info.path)
        else:
            state = load(base64.b64decode(update_info.safetensors_b64))
        self.model.load_weights(state.items())

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)
        _repack_cpu_moe(self.model)

    def shutdown(self) -> None:
        return None


def _repack_cpu_moe(model) -> None:
    """vLLM's CPU fused-MoE method skips its expert-weight repack on a weight update (cpu_vllm.md, section 8):
    redo the post-load processing of every fused-MoE layer so reloaded experts are actually used."""
    try:
        from vllm.model_executor.layers.fused_moe.layer import FusedMoE
    except ImportError:
        return
    for module in model.modules():
        if isinstance(module, FusedMoE):
            method = getattr(module, "quant_method", None)
            if method is not None and hasattr(method, "process_weights_after_loading"):
                method.process_weights_after_loading(module)
