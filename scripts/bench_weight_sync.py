"""Packed NCCL weight broadcast (grpo/nccl_broadcast.py, the trainer's sender) vs one raw torch.distributed
broadcast of the same bytes, GPU 0 -> GPU 1, on Qwen3-1.7B- and Qwen3.5-2B-shaped bf16 state dicts.

The receiver cuts and unpacks chunks from the manifest as vLLM's worker does (`packed_nccl_broadcast_consumer`)
and copies every tensor into its own destination (vLLM's `load_weights` copies into parameters). Shapes come
from `build_plan` on a meta-device transformers model, so the manifest is the one a sync would declare. No vLLM.

    python scripts/bench_weight_sync.py                      # 2 GPUs
    python scripts/bench_weight_sync.py --repeats 5 --buffer-sizes 1073741824 268435456
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


@dataclass(frozen=True)
class Args:
    models: tuple[str, ...] = ("qwen3_1_7b", "qwen3_5_2b")
    """State-dict shapes to send."""
    buffer_sizes: tuple[int, ...] = (1 << 30, 1 << 28)
    """packed_buffer_size_bytes values to try (1 GiB is vLLM's default)."""
    num_buffers: int = 2
    """packed_num_buffers."""
    repeats: int = 3
    """Timed transfers per row (after one warm-up); the table shows the median."""


def model_on_meta(kind: str):
    """Meta-device model with the public config of that size (Qwen3.5-2B's GDN sizes are this script's assumption
    where not known: 16 value/key heads of 128)."""
    import transformers as tf

    with torch.device("meta"):
        if kind == "qwen3_1_7b":
            cfg = tf.Qwen3Config(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
                                 num_attention_heads=16, num_key_value_heads=8, head_dim=128, vocab_size=151936,
                                 tie_word_embeddings=True)
            return tf.Qwen3ForCausalLM(cfg).to(torch.bfloat16)
        text = dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=24, num_attention_heads=8,
                    num_key_value_heads=2, head_dim=256, linear_conv_kernel_dim=4, linear_key_head_dim=128,
                    linear_value_head_dim=128, linear_num_key_heads=16, linear_num_value_heads=16,
                    layer_types=["linear_attention"] * 3 + ["full_attention"], vocab_size=248320)
        text["layer_types"] = text["layer_types"] * 6
        vision = dict(depth=24, hidden_size=1024, intermediate_size=4096, num_heads=16, out_hidden_size=2048,
                      patch_size=16)
        cfg = tf.Qwen3_5Config(text_config=text, vision_config=vision, tie_word_embeddings=True)
        return tf.Qwen3_5ForConditionalGeneration(cfg).to(torch.bfloat16)


def manifest_for(kind: str) -> dict:
    from grpo.weight_sync import build_plan

    return build_plan(model_on_meta(kind), torch.bfloat16).manifest


def _barrier(group) -> None:
    flag = torch.ones(1, device=group.device)
    group.all_reduce_(flag)
    group.synchronize(torch.cuda.current_stream(), "barrier")


def _checksum(tensors) -> int:
    return int(sum(t.view(torch.int16).to(torch.int64).sum().item() for t in tensors))


def worker(rank: int, args: Args, ports: tuple[int, int], out: str) -> None:
    import torch.distributed as dist

    from grpo.nccl_broadcast import NcclGroup, packed_broadcast_receive, packed_broadcast_send, tensor_nbytes

    torch.cuda.set_device(rank)
    group = NcclGroup("127.0.0.1", ports[0], rank=rank, world_size=2, timeout=300)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{ports[1]}", rank=rank, world_size=2,
                            device_id=torch.device("cuda", rank))
    rows = []
    for kind in args.models:
        if rank == 0:
            manifest = manifest_for(kind)
            group.store.set(f"manifest/{kind}", json.dumps(manifest))  # the receiver's "HTTP" manifest
        else:
            manifest = json.loads(group.store.get(f"manifest/{kind}"))
        shapes = manifest["shapes"]
        total = sum(tensor_nbytes(s, torch.bfloat16) for s in shapes)
        if rank == 0:
            tensors = [torch.randn(s, device="cuda", dtype=torch.bfloat16) for s in shapes]
            group.store.set(f"checksum/{kind}", str(_checksum(tensors)))
        else:
            tensors = [torch.empty(s, device="cuda", dtype=torch.bfloat16) for s in shapes]
            index = {n: t for n, t in zip(manifest["names"], tensors)}
        raw = torch.empty(total, dtype=torch.uint8, device="cuda")
        for buffer_size in args.buffer_sizes:
            packed_s, raw_s = [], []
            for repeat in range(args.repeats + 1):
                _barrier(group)
                start = time.perf_counter()
                if rank == 0:
                    packed_broadcast_send(group, iter(zip(manifest["names"], tensors)), manifest, buffer_size,
                                          args.num_buffers)
                else:
                    def load(chunk):
                        for name, piece in chunk:
                            index[name].copy_(piece)
                    packed_broadcast_receive(group, manifest, buffer_size, args.num_buffers, load)
                torch.cuda.synchronize()
                packed = time.perf_counter() - start
                dist.barrier()
                torch.cuda.synchronize()
                start = time.perf_counter()
                dist.broadcast(raw, src=0)
                torch.cuda.synchronize()
                if repeat > 0:
                    packed_s.append(packed)
                    raw_s.append(time.perf_counter() - start)
            if rank == 1:
                ok = _checksum(tensors) == int(group.store.get(f"checksum/{kind}"))
                packed_med, raw_med = sorted(packed_s)[len(packed_s) // 2], sorted(raw_s)[len(raw_s) // 2]
                rows.append((kind, len(shapes), total / 1e9, buffer_size >> 20, packed_med, total / packed_med / 1e9,
                             raw_med, total / raw_med / 1e9, raw_med / packed_med, ok))
        del tensors, raw
        torch.cuda.empty_cache()
    if rank == 1:
        Path(out).write_text(json.dumps(rows))
    dist.destroy_process_group()
    group.close()


def main(args: Args) -> None:
    import torch.multiprocessing as mp

    from grpo.vllm_server import free_port as _free_port

    if torch.cuda.device_count() < 2:
        raise SystemExit("needs 2 GPUs (run it on an nvidia-h200-x2 machine)")
    out = "/tmp/bench_weight_sync.json"
    mp.spawn(worker, args=(args, (_free_port(), _free_port()), out), nprocs=2, join=True)
    rows = json.loads(Path(out).read_text())
    print(f"date {time.strftime('%Y-%m-%d')}  device {torch.cuda.get_device_name(0)} x2  torch {torch.__version__}  "
          f"NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}  num_buffers {args.num_buffers}  "
          f"median of {args.repeats}")
    print("| state dict | tensors | GB | buffer MiB | packed s | packed GB/s | raw bcast s | raw GB/s | "
          "packed/raw speed | checksum |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for kind, n, gb, buf, ps, pg, rs, rg, ratio, ok in rows:
        print(f"| {kind} | {n} | {gb:.2f} | {buf} | {ps:.4f} | {pg:.1f} | {rs:.4f} | {rg:.1f} | {ratio:.2f} | "
              f"{'ok' if ok else 'MISMATCH'} |")


if __name__ == "__main__":
    try:
        import tyro
    except ImportError:  # the GPU image has no tyro: defaults only
        main(Args())
    else:
        main(tyro.cli(Args))
