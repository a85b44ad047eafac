"""vLLM's runtime LoRA routes (`/v1/load_lora_adapter`, `/v1/unload_lora_adapter`, adapters in `/v1/models`).

A mixin of `VLLMControl` (grpo/vllm_client.py), which supplies `_request` (timeout + `VLLMServerError` on non-2xx)
and `models()`. The server needs `VLLM_ALLOW_RUNTIME_LORA_UPDATING=1` and `--enable-lora`; `error_hint` in
vllm_client.py names that fix when the routes answer 404.
"""

from __future__ import annotations


class LoraRoutes:
    def load_lora_adapter(self, name: str, path: str) -> None:
        self._request("POST", "/v1/load_lora_adapter",
                      json={"lora_name": name, "lora_path": path, "load_inplace": False})

    def unload_lora_adapter(self, name: str) -> None:
        self._request("POST", "/v1/unload_lora_adapter", json={"lora_name": name})

    def lora_adapters(self) -> list[str]:
        """Names of the runtime LoRA adapters registered now (`/v1/models` entries with a `parent`)."""
        return [str(m["id"]) for m in self.models()["data"] if m.get("parent")]
