"""Peak memory of the trained-token log-prob head, forward + backward: chunked (grpo/kernels/logprobs.py) vs naive
(full [M, V] logits through plain autograd). Each variant runs in its own process (RSS high-water mark above the
inputs), and the table is printed side by side:

    python scripts/bench_logprobs.py --vocab 150000 --hidden 512 --positions 1024 2048 --chunk 512
"""

from __future__ import annotations

import json
import resource
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Args:
    vocab: int = 150_000
    hidden: int = 512
    positions: tuple[int, ...] = (1024, 2048)
    """Trained positions M per measurement."""
    chunk: int = 512
    top_k: int = 8
    one: str | None = None
    """Internal: `variant,M` measured in this process."""


def _rss_mib() -> float:
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS"):
            return int(line.split()[1]) / 1024
    return float("nan")


def measure(args: Args, variant: str, m: int) -> dict:
    import torch

    from grpo.kernels.logprobs import naive_token_logprobs, policy_token_logprobs

    torch.manual_seed(0)
    hidden = torch.randn(m, args.hidden).requires_grad_()
    weight = (torch.randn(args.vocab, args.hidden) * 0.05).requires_grad_()
    targets = torch.randint(0, args.vocab, (m,))
    top_ids = torch.randint(0, args.vocab, (m, args.top_k))
    base = _rss_mib()
    t0 = time.perf_counter()
    if variant == "chunked":
        lp, top, _ = policy_token_logprobs(hidden, weight, targets, 1.0, top_ids, chunk_size=args.chunk)
    else:
        lp, top, _ = naive_token_logprobs(hidden, weight, targets, 1.0, top_ids)
    (lp.sum() + top.sum()).backward()
    seconds = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"variant": variant, "M": m, "peak_mib": peak - base, "seconds": seconds,
            "logits_mib": m * args.vocab * 4 / 2**20}


def main(args: Args) -> None:
    if args.one:
        variant, m = args.one.split(",")
        print(json.dumps(measure(args, variant, int(m))))
        return
    repo = Path(__file__).resolve().parents[1]
    rows = []
    for m in args.positions:
        for variant in ("naive", "chunked"):
            cmd = [sys.executable, __file__, "--vocab", str(args.vocab), "--hidden", str(args.hidden),
                   "--chunk", str(args.chunk), "--top-k", str(args.top_k), "--one", f"{variant},{m}"]
            out = subprocess.run(cmd, capture_output=True, text=True, cwd=repo, env={"PYTHONPATH": str(repo)})
            rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    print(f"V={args.vocab} H={args.hidden} chunk={args.chunk}, fp32 CPU, forward+backward")
    print(f"{'M':>6} {'variant':>8} {'peak MiB':>9} {'[M,V] MiB':>10} {'s':>7}")
    for r in rows:
        print(f"{r['M']:>6} {r['variant']:>8} {r['peak_mib']:>9.0f} {r['logits_mib']:>10.0f} {r['seconds']:>7.2f}")


if __name__ == "__main__":
    import tyro

    main(tyro.cli(Args))
