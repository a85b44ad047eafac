"""The only module that knows vLLM's HTTP routes (contract: shared/reference/vllm.md).

`VLLMControl` is the synchronous control plane the trainer uses (readiness, introspection, pause/resume, the
4-phase weight update, LoRA adapters). `VLLMClient` is the asynchronous generation client the rollout worker
uses (one per event loop): token ids in, `TurnRecord` out, with retries and Prometheus metrics.

Every call carries a timeout; every non-2xx answer becomes a `VLLMServerError` that names the fix.
"""

from __future__ import annotations

import asyncio
import math
import random
import time
from dataclasses import dataclass
from typing import Any

import httpx

from grpo.samples import TurnRecord

NEG_INF_SENTINEL = -9999.0
"""vLLM serializes -inf logprobs as -9999.0 on both generation endpoints."""

_DEV_ROUTES = ("/pause", "/resume", "/is_paused", "/server_info", "/get_world_size", "/init_weight_transfer_engine",
               "/start_weight_update", "/update_weights", "/finish_weight_update", "/reset_prefix_cache",
               "/weight_info", "/collective_rpc", "/update_weight_version", "/abort_requests")
_WEIGHT_ROUTES = ("/init_weight_transfer_engine", "/start_weight_update", "/update_weights", "/finish_weight_update")


class VLLMServerError(RuntimeError):
    """A non-2xx answer from the vLLM server, with the server's message and a hint naming the fix."""

    def __init__(self, status: int, route: str, message: str, hint: str = ""):
        self.status, self.route, self.message, self.hint = status, route, message, hint
        text = f"vLLM server answered {status} on {route}: {message}"
        super().__init__(f"{text}\n  Fix: {hint}" if hint else text)


class PromptTooLongError(ValueError):
    """The prompt already fills the server's max_model_len: no token can be generated (ends the rollout)."""

    def __init__(self, prompt_len: int, max_model_len: int):
        self.prompt_len, self.max_model_len = prompt_len, max_model_len
        super().__init__(f"prompt of {prompt_len} tokens leaves no room to generate under max_model_len="
                         f"{max_model_len}; shorten the prompt or restart vLLM with a larger --max-model-len")


def _server_message(response: httpx.Response) -> str:
    """The human message of an error body: vLLM's `{"error": {"message"}}`, FastAPI's `{"detail"}`, or text."""
    try:
        body = response.json()
    except ValueError:
        return response.text.strip() or response.reason_phrase
    if isinstance(body, dict):
        error = body.get("error")
        if isinstance(error, dict) and "message" in error:
            return str(error["message"])
        if "detail" in body:
            return str(body["detail"])
        if "message" in body:
            return str(body["message"])
    return str(body)


def error_hint(status: int, route: str, message: str) -> str:
    """Map a server error to the flag or environment variable that fixes it (empty when none applies)."""
    path = route.split("?", 1)[0]
    lowered = message.lower()
    if "lora_adapter" in path and status == 404 and "not found" == lowered.strip():
        return ("runtime LoRA routes are disabled: start the server with VLLM_ALLOW_RUNTIME_LORA_UPDATING=1 and "
                "--enable-lora --max-lora-rank R --max-loras M")
    if path.startswith(_DEV_ROUTES) and status == 404:
        return "start the server with VLLM_SERVER_DEV_MODE=1 (the RL/dev routes are hidden without it)"
    if "weight transfer not configured" in lowered:
        return "start the server with --weight-transfer-config '{\"backend\": \"nccl\"}' (cpu_file on CPU)"
    if path.startswith("/inference/") and status == 403:
        return "restart the server with --enable-scale-out (needed by /inference/v1/generate)"
    if "does not exist" in lowered and "model" in lowered:
        return "send the name the server serves (see /v1/models) or start it with --served-model-name <name>"
    if "max allowed" in lowered and "logprobs" in lowered:
        return "lower num_sampler_logprobs or restart the server with a larger --max-logprobs"
    if "sampling mask" in lowered or "sampling_mask" in lowered:
        return ("sampling masks need temperature > 0, top_k > 0 and a server started with --return-sampling-mask "
                "--logprobs-mode processed_logprobs (Model Runner V2)")
    if "maximum model length" in lowered or "max_model_len" in lowered:
        return "shorten the prompt / max_completion_length or restart the server with a larger --max-model-len"
    if "start_weight_update must be called" in lowered or "without a matching start_weight_update" in lowered:
        return "call the phases in order: /pause, /start_weight_update, /update_weights, /finish_weight_update"
    if path.startswith(_WEIGHT_ROUTES) and status >= 500:
        return ("a failed weight update can leave the server paused with partial weights; restart the server "
                "(check that init_info/update_info match the --weight-transfer-config backend)")
    return ""


def raise_for_status(response: httpx.Response, route: str) -> None:
    if response.is_success:
        return
    message = _server_message(response)
    raise VLLMServerError(response.status_code, route, message, error_hint(response.status_code, route, message))


class VLLMControl:
    """Synchronous control plane: one `httpx.Client`, a timeout on every call (vLLM contract sections 2, 4-7)."""

    def __init__(self, base_url: str, timeout: float = 1800.0):
        self.base_url = base_url.rstrip("/")
        self.timeout = timeout
        self._http = httpx.Client(base_url=self.base_url, timeout=timeout)

    def _request(self, method: str, route: str, *, timeout: float | None = None, **kwargs: Any) -> httpx.Response:
        response = self._http.request(method, route, timeout=timeout or self.timeout, **kwargs)
        raise_for_status(response, route)
        return response

    def wait_ready(self, timeout: float | None = None) -> None:
        """Poll `/health` until it answers 200; raise TimeoutError naming the URL after `timeout` seconds."""
        deadline = time.monotonic() + (timeout if timeout is not None else self.timeout)
        last_error = "no answer"
        while True:
            try:
                if self._http.get("/health", timeout=5.0).status_code == 200:
                    return
                last_error = "health check not 200 yet"
            except httpx.TransportError as exc:
                last_error = f"{type(exc).__name__}: {exc}"
            if time.monotonic() >= deadline:
                raise TimeoutError(f"vLLM server at {self.base_url} not ready ({last_error}); start it with "
                                   f"`python rollout.py serve` or check --vllm-server-base-url")
            time.sleep(1.0)

    # ---- introspection ------------------------------------------------------------------------------------------
    def models(self) -> dict:
        return self._request("GET", "/v1/models").json()

    def max_model_len(self) -> int:
        return int(self.models()["data"][0]["max_model_len"])

    def served_model_name(self) -> str:
        return str(self.models()["data"][0]["id"])

    def server_info(self) -> dict:
        """The resolved server config (`vllm_config.model_config.dtype`, `lora_config`, ...) and VLLM_* env."""
        return self._request("GET", "/server_info", params={"config_format": "json"}).json()

    def world_size(self) -> int:
        """vLLM workers that join a weight-transfer group (TP x PP x DP)."""
        return int(self._request("GET", "/get_world_size").json()["world_size"])

    def weight_info(self) -> str:
        return str(self._request("GET", "/weight_info").json()["weight_version"])

    # ---- pause / resume -----------------------------------------------------------------------------------------
    def pause(self, mode: str = "keep") -> None:
        """keep: freeze running requests (they resume later); abort: end them; wait: drain first."""
        self._request("POST", "/pause", params={"mode": mode})

    def resume(self) -> None:
        self._request("POST", "/resume")

    def is_paused(self) -> bool:
        return bool(self._request("GET", "/is_paused").json()["is_paused"])

    def reset_prefix_cache(self) -> None:
        self._request("POST", "/reset_prefix_cache")

    # ---- 4-phase weight update (contract section 5.2) -----------------------------------------------------------
    def init_weight_transfer_engine(self, init_info: dict, timeout: float | None = None) -> None:
        """Blocks until every worker joined the transfer group (NCCL: run the trainer side concurrently)."""
        self._request("POST", "/init_weight_transfer_engine", json={"init_info": init_info}, timeout=timeout)

    def start_weight_update(self) -> None:
        # No body: TRL's `is_checkpoint_format` body deadlocked NCCL streaming on some vLLM versions (TRL #7103).
        self._request("POST", "/start_weight_update")

    def update_weights(self, update_info: dict, timeout: float | None = None) -> None:
        self._request("POST", "/update_weights", json={"update_info": update_info}, timeout=timeout)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        body = {"weight_version": weight_version} if weight_version is not None else None
        self._request("POST", "/finish_weight_update", json=body)

    # ---- runtime LoRA (contract section 7) ----------------------------------------------------------------------
    def load_lora_adapter(self, name: str, path: str) -> None:
        self._request("POST", "/v1/load_lora_adapter",
                      json={"lora_name": name, "lora_path": path, "load_inplace": False})

    def unload_lora_adapter(self, name: str) -> None:
        self._request("POST", "/v1/unload_lora_adapter", json={"lora_name": name})

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> VLLMControl:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
