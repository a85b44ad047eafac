"""The split tree attention (grpo/tree_split.py) through torch's FlashAttention ops and through torch's cuDNN ragged
SDPA ops, side by side on the bench's rows (bench_step.py's groups: 8 rollouts, 1068-token prompts, 256-token
completions, packed to the token budget): forward and backward ms per layer call, how far cuDNN's output and
gradients are from FlashAttention's, and what a row of a size not seen before costs (cuDNN plans per shape).

    python scripts/bench_attention.py                                # Qwen3-1.7B's attention: 16 heads, 8 KV, d 128
    python scripts/bench_attention.py --heads 8 --kv-heads 2 --head-dim 256   # Qwen3.5-2B's full-attention layers
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def bench_row(shared: bool, budget: int, vocab: int = 1000, prompt_len: int = 1068, completion_len: int = 256):
    """A packed row of samples up to `budget` tokens, filled in order as the batcher fills one."""
    from bench_step import synthetic_groups

    from grpo.trie import pack_samples

    samples, source = [], synthetic_groups(vocab, shared, 0, prompt_len=prompt_len, completion_len=completion_len)
    while True:
        sample = next(source)
        if pack_samples(samples + [sample], share_prefixes=shared).num_tokens > budget and samples:
            return pack_samples(samples, share_prefixes=shared)
        samples.append(sample)


def run_split(plan, ops, q, k, v, dout, scale):
    """One forward and backward of the split with `ops` (forward, backward primitives): (out, dq, dk, dv)."""
    from grpo import tree_split

    plan.ops = lambda: ops  # this plan object only
    out, lse, aux, aux_b = tree_split._split_forward(q, k, v, plan, scale)
    return (out, *tree_split._split_backward(dout, q, k, v, out, lse, plan, scale, aux, aux_b))


def timed(fn, reps: int) -> float:
    """Median ms of `fn()` over `reps` calls, device-synchronised."""
    import torch

    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return 1e3 * sorted(times)[len(times) // 2]


def measure(row, args) -> dict:
    import torch

    from grpo import tree_split

    row = row.to(torch.device("cuda"))
    plan = tree_split.SplitPlan.of(row, flash=True)
    n, scale = row.num_tokens, args.head_dim ** -0.5
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(n, h, args.head_dim, device="cuda", dtype=torch.bfloat16, generator=gen)
               for h in (args.heads, args.kv_heads, args.kv_heads))
    dout = torch.randn(n, args.heads, args.head_dim, device="cuda", dtype=torch.bfloat16, generator=gen)
    kernels = {"flash": (tree_split.flash_forward, tree_split.flash_backward),
               "cudnn": (tree_split.cudnn_forward, tree_split.cudnn_backward)}
    result = {"tokens": n, "segments": len(row.cu_seqlens_q) - 1}
    outputs = {}
    for name, ops in kernels.items():
        try:
            t0 = time.perf_counter()
            outputs[name] = run_split(plan, ops, q, k, v, dout, scale)
            torch.cuda.synchronize()
            result[f"{name}_first_ms"] = 1e3 * (time.perf_counter() - t0)
            result[f"{name}_fwd_ms"] = timed(lambda: tree_split._split_forward(q, k, v, plan, scale), args.reps)
            result[f"{name}_fwd_bwd_ms"] = timed(lambda: run_split(plan, ops, q, k, v, dout, scale), args.reps)
        except Exception as e:  # noqa: BLE001 - reported, the other kernel still measured
            result[f"{name}_error"] = f"{type(e).__name__}: {str(e)[:300]}"
    if len(outputs) == 2:
        for i, what in enumerate(("out", "dq", "dk", "dv")):
            a, b = outputs["flash"][i].float(), outputs["cudnn"][i].float()
            result[f"{what}_max_diff_rel"] = ((a - b).abs().max() / a.abs().max().clamp_min(1e-9)).item()
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--token-budget", type=int, default=16384)
    p.add_argument("--reps", type=int, default=20)
    args = p.parse_args()
    for shared, budget in ((True, args.token_budget), (False, args.token_budget), (True, args.token_budget - 2000)):
        r = measure(bench_row(shared, budget), args)
        print("ATTN " + json.dumps({"shared": shared, "budget": budget, **r}), flush=True)


if __name__ == "__main__":
    main()
