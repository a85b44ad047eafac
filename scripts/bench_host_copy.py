"""A packed row's fields staged into one (pinned) host buffer and copied to the device: `grpo.trie.to_device`
(numpy copies, one memcpy each on the calling thread) against the same staging with torch's `copy_` (what it did
before 2026-12-04: each copy through the intra-op thread pool), at several intra-op thread counts, side by side.

    python scripts/bench_host_copy.py                       # 14 fields of 20k int64, 50 repetitions
    python scripts/bench_host_copy.py --fields 14 --numel 20000 --threads 16 4 1

On an H200 machine's host (16 cores) the torch staging's p90 was 4.12 ms against numpy's 0.66 ms (docs/results.md,
2026-12-04 seventeenth session). Without a GPU the buffer is not pinned and nothing is copied to a device.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from grpo.trie import to_device  # noqa: E402


def torch_staging(tensors: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """The former staging: byte views copied by torch into one buffer, then one non-blocking copy."""
    buf = torch.empty(sum(t.numel() * t.element_size() for t in tensors), dtype=torch.uint8,
                      pin_memory=device.type == "cuda")
    offset = 0
    for t in tensors:
        nbytes = t.numel() * t.element_size()
        buf[offset:offset + nbytes] = t.view(-1).view(torch.uint8)
        offset += nbytes
    return buf.to(device, non_blocking=True) if device.type == "cuda" else buf


def timed(fn, reps: int, cuda: bool) -> list[float]:
    """Milliseconds per call (each followed by a device sync on CUDA), sorted; five untimed calls first."""
    for _ in range(5):
        fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize()
        times.append(1e3 * (time.perf_counter() - t0))
    return sorted(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--fields", type=int, default=14)
    p.add_argument("--numel", type=int, default=20000)
    p.add_argument("--reps", type=int, default=50)
    p.add_argument("--threads", type=int, nargs="+", default=[torch.get_num_threads(), 4, 1])
    args = p.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    tensors = [torch.randint(0, 100, (args.numel,)) for _ in range(args.fields)]
    print(f"{args.fields} fields of {args.numel} int64 to {device}, {args.reps} reps; ms per row")
    print(f"{'threads':>7} {'staging':<14} {'median':>8} {'p90':>8} {'max':>8}")
    for threads in args.threads:
        torch.set_num_threads(threads)
        for name, fn in (("numpy (now)", lambda: to_device(tensors, device, packed=True)),
                         ("torch copy_", lambda: torch_staging(tensors, device))):
            t = timed(fn, args.reps, device.type == "cuda")
            print(f"{threads:>7} {name:<14} {t[len(t) // 2]:>8.3f} {t[int(len(t) * 0.9)]:>8.3f} {t[-1]:>8.3f}")


if __name__ == "__main__":
    main()
