"""vLLM general plugin: the `cpu_file` weight-transfer backend, so the real four-phase weight-update protocol
(init -> pause -> start -> update -> finish -> resume) runs on a CPU-only vLLM server.

vLLM loads every `vllm.general_plugins` entry point in every process it starts (API server, engine core,
workers) and calls `register()`; pyproject.toml declares ours. Only the transport differs from NCCL:
`update_info` carries a safetensors file path (or the file's bytes, base64, for tiny models) instead of a
manifest for a broadcast. The trainer side lives in `weight_sync.py`.

Start the server with `--weight-transfer-config '{"backend": "cpu_file"}'` (rollout.py serve --server.cpu does).

After the layerwise reload, modules that share a parameter (a tied `lm_head` and `embed_tokens`) but received no
tensor get their post-load step rerun, or a CPU server keeps computing logits with the old embedding
(`unloaded_tied_layers`, docs/design.md §14.6).
"""

from __future__ import annotations

from dataclasses import dataclass

BACKEND_NAME = "cpu_file"


def register() -> None:
    """Idempotent: plugins can be loaded several times per process tree, and a duplicate name raises in vLLM.
    Also registers `ipc_inplace` (grpo/vllm_ipc_inplace.py), imported only when a server asks for it."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    for name, module, cls in ((BACKEND_NAME, "grpo.vllm_plugin", "CPUFileWeightTransferEngine"),
                              ("ipc_inplace", "grpo.vllm_ipc_inplace", "InPlaceIPCWeightTransferEngine")):
        if name not in WeightTransferEngineFactory._registry:
            WeightTransferEngineFactory.register_engine(name, module, cls)


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

        self._tied = tied_layers(self.model)  # before the reload swaps the parameters for meta tensors
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

        stale = unloaded_tied_layers(getattr(self, "_tied", []))
        finalize_layerwise_reload(self.model, self.model_config)
        reprocess_tied(stale)
        _repack_cpu_moe(self.model)

    def shutdown(self) -> None:
        return None

    @staticmethod
    def trainer_send_weights(iterator, trainer_args) -> None:
        """Abstract on the engine base in vLLM 0.26 (a trainer-side helper there); the trainer side of cpu_file is
        grpo/weight_sync.py, so the server never calls this."""
        raise NotImplementedError("the cpu_file trainer side is grpo.weight_sync.WeightSync(mode='cpu_file')")


def tied_layers(model) -> list[tuple[str, object, list[str]]]:
    """(name, module, names of the other modules holding the same parameter) for every module that shares a
    parameter object with another one: a tied `lm_head` and `embed_tokens` (tie_word_embeddings=True)."""
    holders: dict[int, list[tuple[str, object]]] = {}
    for name, module in model.named_modules():
        for param in module._parameters.values():
            if param is not None:
                holders.setdefault(id(param), []).append((name, module))
    tied = []
    for group in holders.values():
        for name, module in group:
            tied.append((name, module, [other for other, _ in group if other != name]))
    return [t for t in tied if t[2]]


def unloaded_tied_layers(tied: list) -> list[tuple[str, object, list[str]]]:
    """Before `finalize_layerwise_reload`: the tied modules this update sent no tensor to whose partner did get one.

    Why (docs/design.md, "Tied embeddings"): vLLM skips `lm_head.weight` of a tied model (the checkpoint has only
    `embed_tokens`), so in a layerwise reload the lm_head layer loads nothing, is reported as `ParallelLMHead:
    Failed to load weights` and gets its old tensors placed back. Its weight is the embedding's parameter and holds
    the new values, but on CPU the embedding method's post-load step built the lm_head's GEMM (`cpu_linear`, a
    oneDNN/packed copy of the weight) from the old weight, and only a processed layer rebuilds it: the server
    keeps computing logits with the old embedding (max |dlogp| 0.2-2.5 after a sync)."""
    from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info

    def unloaded(module) -> bool:
        info = get_layerwise_info(module)  # a processed layer was reset (cannot load); a pending one counts numel
        return info.can_load() and info.load_numel <= 0

    names = {name for name, module, _ in tied if unloaded(module)}
    return [t for t in tied if t[0] in names and any(other not in names for other in t[2])]


def reprocess_tied(stale: list) -> None:
    """After the reload: rerun each stale tied module's post-load step on its (shared, updated) weight."""
    import logging

    for name, module, partners in stale:
        method = getattr(module, "quant_method", None)
        if method is not None and callable(getattr(method, "process_weights_after_loading", None)):
            method.process_weights_after_loading(module)
            logging.getLogger("vllm.grpo_cpu_file").info(
                "cpu_file: %s shares its weight with %s (tied): post-load step rerun on the new weight", name,
                ", ".join(partners))


def _repack_cpu_moe(model) -> None:
    """Redo the CPU grouped-GEMM prepack of every MoE layer after a weight update (docs/design.md §15).

    vLLM 0.32's unquantized MoE method prepacks experts only on the first load: on an update `_setup_kernel` copies
    the new, *unpacked* weights into the kernel tensors and skips `fused_experts.process_weights_after_loading`,
    so the CPU kernel reads raw weights as if packed (logprobs off by 0.3-2 nats). Prepacking is shape-preserving,
    so running the experts' own post-load step on the refreshed tensors restores the kernel layout.
    """
    try:
        from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
    except ImportError:
        return
    import logging

    for module in model.modules():
        kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        if not isinstance(experts, CPUUnquantizedExperts) or getattr(experts, "_use_zentorch", False):
            continue
        moe_config = experts.moe_config
        if experts._padded_intermediate_size(moe_config) != moe_config.intermediate_size_per_partition:
            # The first load padded the intermediate dim; re-padding padded tensors would corrupt them.
            logging.getLogger(__name__).warning(
                "cpu_file: MoE intermediate size %d needs CPU padding; experts not repacked after the update",
                moe_config.intermediate_size_per_partition)
            continue
        experts.process_weights_after_loading(module)
