"""Merged vs adapter-only weight sync of a LoRA policy, side by side against one real `--enable-lora` vLLM server.

For each mode, `repeats` syncs of a PEFT model (`grpo.weight_sync.WeightSync`, as train.py drives it) while one
streamed request decodes on the server: bytes per sync, trainer time per sync, and the longest gap between two
streamed tokens during the sync (what a rollout in flight sees: merged sync pauses generation from /pause to
/resume; adapter sync does not pause, the engine loads the adapter between two steps). Then decode throughput
under the base model name vs the adapter name (vLLM applies the LoRA on the fly).

    python scripts/bench_lora_sync.py                                 # CPU: ~29M-parameter Qwen3, r=16
    python scripts/bench_lora_sync.py --hidden 1024 --layers 8 --rank 32
"""

from __future__ import annotations

import shutil
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))


@dataclass(frozen=True)
class Args:
    hidden: int = 512
    """Hidden size of the benchmark Qwen3 (head dim 64)."""
    layers: int = 8
    """Decoder layers."""
    rank: int = 16
    """LoRA rank (all-linear, alpha = 2 x rank)."""
    repeats: int = 3
    """Syncs per mode; the table shows the median."""
    concurrent: int = 16
    """Concurrent requests of the throughput rows."""
    max_tokens: int = 64
    """Tokens per request of the throughput rows."""


def build_model(args: Args, out: Path) -> Path:
    """A randomly initialised Qwen3 of the requested size, with the tiny test tokenizer."""
    import transformers as tf

    from make_tiny_model import make

    tiny = make(REPO / ".tiny", kinds=("qwen3",))["qwen3"]
    heads = args.hidden // 64
    cfg = tf.Qwen3Config(vocab_size=1024, hidden_size=args.hidden, intermediate_size=3 * args.hidden,
                         num_hidden_layers=args.layers, num_attention_heads=heads,
                         num_key_value_heads=max(1, heads // 2),
                         head_dim=64, max_position_embeddings=4096, tie_word_embeddings=False, eos_token_id=2,
                         pad_token_id=3, bos_token_id=None, dtype="float32")
    torch.manual_seed(0)
    tf.Qwen3ForCausalLM(cfg).save_pretrained(out)
    for f in tiny.iterdir():
        if f.name.startswith(("tokenizer", "chat_template", "special_tokens")):
            shutil.copy(f, out / f.name)
    return out


def stream_gaps(base_url: str, model: str, stop: threading.Event) -> list[float]:
    """Decode one long streamed request until `stop`; returns the gaps between streamed chunks (s)."""
    times = []
    body = {"model": model, "prompt": [5, 6, 7], "max_tokens": 1900, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{base_url}/v1/completions", json=body, timeout=120) as response:
        for line in response.iter_lines():
            if line.startswith("data:"):
                times.append(time.perf_counter())
            if stop.is_set():
                break
    return [b - a for a, b in zip(times, times[1:])]


def timed_syncs(sync, model, server, stream_model: str, repeats: int, first_version: int, perturb) -> dict:
    """`repeats` syncs, each while a streamed request decodes; medians of trainer time and longest token gap."""
    totals, stalls, typical = [], [], []
    for i in range(repeats):
        stop = threading.Event()
        with ThreadPoolExecutor(1) as pool:
            gaps = pool.submit(stream_gaps, server.base_url, stream_model, stop)
            time.sleep(1.0)  # decoding is under way
            perturb(model, i)
            t0 = time.perf_counter()
            sync.sync(model, first_version + i)
            totals.append(time.perf_counter() - t0)
            time.sleep(0.5)
            stop.set()
            stalls.append(max(gaps.result()))
            typical.append(statistics.median(gaps.result()))
    return {"sync_s": statistics.median(totals), "stall_s": statistics.median(stalls),
            "gap_s": statistics.median(typical)}


def throughput(base_url: str, model: str, concurrent: int, max_tokens: int) -> float:
    body = {"model": model, "prompt": [5, 6, 7], "max_tokens": max_tokens, "ignore_eos": True}

    def one(_):
        httpx.post(f"{base_url}/v1/completions", json=body, timeout=300).raise_for_status()

    with ThreadPoolExecutor(concurrent) as pool:
        list(pool.map(one, range(concurrent)))  # warm-up
        t0 = time.perf_counter()
        list(pool.map(one, range(concurrent)))
    return concurrent * max_tokens / (time.perf_counter() - t0)


def main(args: Args) -> None:
    import transformers as tf
    from peft import LoraConfig

    from grpo.lora import AdapterVersions, wrap_policy
    from grpo.vllm_server import ServeConfig, free_port, launch
    from grpo.weight_sync import WeightSync, WeightSyncConfig

    work = Path(tempfile.mkdtemp(prefix="bench_lora_"))
    model_dir = build_model(args, work / "model")
    cpu = not torch.cuda.is_available()
    server = launch(ServeConfig(model=str(model_dir), port=free_port(), max_model_len=2048, dtype="float32",
                                cpu=cpu, weight_transfer_backend="cpu_file" if cpu else "nccl",
                                kv_cache_bytes=512 * 2**20, lora_rank=args.rank, max_loras=4),
                    log_path=work / "vllm.log")
    try:
        base = tf.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        n_params = sum(p.numel() for p in base.parameters())
        model = wrap_policy(base, LoraConfig(r=args.rank, lora_alpha=2 * args.rank, target_modules="all-linear"))

        def perturb(m, seed):
            generator = torch.Generator().manual_seed(seed)
            with torch.no_grad():
                for name, p in m.named_parameters():
                    if "lora_B" in name:
                        p.copy_(torch.randn(p.shape, generator=generator) * 1e-3)

        mode = "cpu_file" if cpu else "nccl"
        adapter = AdapterVersions(work / ".vllm_lora", "bench", keep=2)
        rows = {}
        sync = WeightSync(server.base_url, WeightSyncConfig(mode=mode, timeout=600), adapter=adapter)
        sync.init(model)
        rows["adapter"] = timed_syncs(sync, model, server, str(model_dir), args.repeats, 1, perturb)
        rows["adapter"]["bytes"] = (adapter.path(adapter.loaded[-1]) / "adapter_model.safetensors").stat().st_size
        sync.close()
        served = adapter.served_name(adapter.loaded[-1])
        sync = WeightSync(server.base_url, WeightSyncConfig(mode=mode, timeout=600))
        sync.init(model)
        rows["merged"] = timed_syncs(sync, model, server, str(model_dir), args.repeats, 100, perturb)
        manifest = sync.plan.manifest
        rows["merged"]["bytes"] = sum(torch.Size(s).numel() * getattr(torch, d).itemsize
                                      for s, d in zip(manifest["shapes"], manifest["dtype_names"]))
        sync.close()
        tok_base = throughput(server.base_url, str(model_dir), args.concurrent, args.max_tokens)
        tok_adapter = throughput(server.base_url, served, args.concurrent, args.max_tokens)
    finally:
        server.stop()
    print(f"Qwen3 {n_params / 1e6:.1f}M params, hidden {args.hidden}, {args.layers} layers, LoRA r={args.rank} "
          f"all-linear, {'CPU' if cpu else 'GPU'} server fp32, median of {args.repeats} syncs\n")
    print("| sync | bytes per sync | trainer time per sync (s) | longest token gap during sync (s) | median gap (s) |")
    print("|---|---|---|---|---|")
    for name in ("merged", "adapter"):
        r = rows[name]
        print(f"| {name} | {r['bytes'] / 2**20:.2f} MiB | {r['sync_s']:.3f} | {r['stall_s']:.3f} | {r['gap_s']:.4f} |")
    print(f"\nadapter / merged: bytes {rows['adapter']['bytes'] / rows['merged']['bytes']:.3f}, trainer time "
          f"{rows['adapter']['sync_s'] / rows['merged']['sync_s']:.2f}, longest gap "
          f"{rows['adapter']['stall_s'] / rows['merged']['stall_s']:.2f}")
    print(f"decode throughput ({args.concurrent} x {args.max_tokens} tokens): base {tok_base:.0f} tok/s, adapter "
          f"{tok_adapter:.0f} tok/s (base / adapter {tok_base / tok_adapter:.2f}x)")
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    import tyro

    main(tyro.cli(Args, description=__doc__))
