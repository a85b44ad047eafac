"""vLLM weight-transfer backend `ipc_inplace`: vLLM's own CUDA-IPC engine, loading into the served parameters in place.

vLLM's `ipc` engine wraps every update in *layerwise reload* (`initialize_layerwise_reload` at start,
`finalize_layerwise_reload` at finish): each layer's incoming checkpoint tensors are buffered, the layer is
re-materialised, loaded, post-processed and copied back into the original parameters (so CUDA graphs keep their
addresses). That is what a quantized checkpoint needs. An unquantized model's parameters are the checkpoint's
tensors (stacked qkv / gate_up shards are copied in by each parameter's `weight_loader`; vLLM's unquantized linear
post-load step does nothing on CUDA, while on CPU it prepacks and drops the weight, so this backend is GPU-only), so
`model.load_weights` on the live model is the whole update: this engine is vLLM's IPC receiver (its
`receive_weights`, unchanged) with start and finish doing no reload. On the Qwen3-0.6B shape (one H200,
docs/results.md, 2026-12-03) vLLM's `ipc` update took 0.14-0.15 s of a 0.19-0.20 s sync; this one 0.04 s (its load
23-46 ms for 1137 MiB in 310 tensors), the whole sync 0.10-0.12 s, with the server's logprobs equal to the trainer's
after every one of 20 syncs.

Serve with `--weight-transfer-config '{"backend": "ipc_inplace"}'` (and `VLLM_ALLOW_INSECURE_SERIALIZATION=1`, as
for `ipc`); the trainer's `--weight-transfer ipc` / `auto` treat it as ipc. Quantized models are refused at the
first update (use `ipc`). Each update logs its tensor count, bytes and milliseconds in the server log.
"""

from __future__ import annotations

import logging
import time

import torch
from vllm.distributed.weight_transfer.ipc_engine import IPCWeightTransferEngine

logger = logging.getLogger("vllm.grpo_ipc_inplace")  # under vLLM's logger: its handler prints INFO in the server log


def _quantization(engine) -> str | None:
    model_config = getattr(engine, "model_config", None)
    return getattr(model_config, "quantization", None)


class InPlaceIPCWeightTransferEngine(IPCWeightTransferEngine):
    """vLLM's IPC engine without layerwise reload: updates copy into the live parameters (unquantized models)."""

    def start_weight_update(self) -> None:
        from vllm.platforms import current_platform

        if current_platform.is_cpu():
            raise ValueError("weight-transfer backend ipc_inplace is for a GPU server (vLLM's CPU linear layers "
                             "prepack their weights after loading); on CPU serve with backend 'cpu_file'")
        quantization = _quantization(self)
        if quantization is not None:
            raise ValueError(f"weight-transfer backend ipc_inplace loads checkpoint tensors into the live parameters, "
                             f"which a {quantization!r}-quantized model does not hold; serve with backend 'ipc'")

    def finish_weight_update(self) -> None:
        return None

    def receive_weights(self, update_info) -> None:
        start = time.perf_counter()
        super().receive_weights(update_info)
        torch.cuda.synchronize(self.device)
        sizes = getattr(update_info, "tensor_sizes", None)
        logger.info("ipc_inplace update: %d tensors%s in %.1f ms", len(update_info.names),
                    f", {sum(sizes) / 2**20:.0f} MiB packed" if sizes else "", 1e3 * (time.perf_counter() - start))
