"""What the host was doing while the GPU sat idle, from a torch.profiler chrome trace (`bench_step.py --profile
--trace`): the GPU's idle gaps (no kernel, copy or memset on any stream), and the host's Python frames and aten ops
that ran during them, by self time (the frame itself, not the calls it made) and inclusive time.

    python scripts/trace_gaps.py /tmp/q06.json.gz --min-gap-us 20 --top 25

A frame with a large self time inside the gaps is host work the GPU waited for; a large inclusive time names the
region (a compiled layer's entry, a library's launch path) it happened in. Only the threads that launched GPU work
are read (the main thread and autograd's), so idle time spent in other threads' frames is not counted.
"""

from __future__ import annotations

import argparse
import bisect
import gzip
import json
from collections import Counter, defaultdict

GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
HOST_CATEGORIES = ("python_function", "cpu_op")


def load_events(path: str) -> list[dict]:
    """The complete ('X') events of a chrome trace, gzipped or not."""
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt") as f:
        data = json.load(f)
    events = data["traceEvents"] if isinstance(data, dict) else data
    return [e for e in events if e.get("ph") == "X" and "dur" in e]


def merged_busy(events: list[dict]) -> list[tuple[float, float]]:
    """The GPU's busy intervals over every stream, merged: [(start, end)] in trace microseconds."""
    spans = sorted((e["ts"], e["ts"] + e["dur"]) for e in events if e.get("cat") in GPU_CATEGORIES)
    merged: list[list[float]] = []
    for start, end in spans:
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(a, b) for a, b in merged]


def idle_gaps(busy: list[tuple[float, float]], min_gap_us: float) -> list[tuple[float, float]]:
    """The idle intervals of at least `min_gap_us` between the first busy interval and the last."""
    return [(a_end, b_start) for (_, a_end), (b_start, _) in zip(busy, busy[1:]) if b_start - a_end >= min_gap_us]


def launching_threads(events: list[dict]) -> set:
    """(pid, tid) of the host threads that called the CUDA runtime (launches, copies): where the GPU's work comes
    from."""
    return {(e.get("pid"), e.get("tid")) for e in events if e.get("cat") == "cuda_runtime"}


def _overlap(start: float, end: float, gaps: list[tuple[float, float]], gap_starts: list[float]) -> float:
    """Microseconds of [start, end) inside the (sorted, disjoint) gaps."""
    total, i = 0.0, max(bisect.bisect_right(gap_starts, start) - 1, 0)
    while i < len(gaps) and gaps[i][0] < end:
        total += max(0.0, min(end, gaps[i][1]) - max(start, gaps[i][0]))
        i += 1
    return total


def _nested(thread_events: list[dict]) -> list[tuple[str, float, float, int]]:
    """(name, start, end, parent index) of one thread's events, each clipped to its parent's end. The profiler's
    Python tracer leaves some calls unclosed (an autograd Function's `apply` that ends "at the end of the trace"),
    and without the clipping such a call would swallow every later event as its child."""
    ordered = sorted(thread_events, key=lambda e: (e["ts"], -e["dur"]))
    out: list[tuple[str, float, float, int]] = []
    stack: list[int] = []  # indices into out, ends non-increasing from bottom to top
    for event in ordered:
        start = event["ts"]
        while stack and start >= out[stack[-1]][2]:
            stack.pop()
        parent = stack[-1] if stack else -1
        end = start + event["dur"] if parent < 0 else min(start + event["dur"], out[parent][2])
        out.append((event["name"], start, end, parent))
        stack.append(len(out) - 1)
    return out


def _self_segments(nested: list[tuple[str, float, float, int]]):
    """(name, start, end) pieces of each nested event not covered by its children."""
    children: dict = defaultdict(list)
    for name, start, end, parent in nested:
        if parent >= 0:
            children[parent].append((start, end))
    for i, (name, start, end, _) in enumerate(nested):
        cursor = start
        for c_start, c_end in children.get(i, ()):
            if c_start > cursor:
                yield name, cursor, c_start
            cursor = max(cursor, c_end)
        if end > cursor:
            yield name, cursor, end


def host_time_in_gaps(events: list[dict], gaps: list[tuple[float, float]],
                      threads: set | None = None) -> tuple[Counter, Counter]:
    """(self, inclusive) microseconds per frame/op name that the launching threads spent inside `gaps`. Inclusive
    time counts each name once per moment (a recursive frame is not counted twice)."""
    threads = launching_threads(events) if threads is None else threads
    by_thread: dict = defaultdict(list)
    for e in events:
        if e.get("cat") in HOST_CATEGORIES and (e.get("pid"), e.get("tid")) in threads:
            by_thread[(e.get("pid"), e.get("tid"))].append(e)
    gap_starts = [a for a, _ in gaps]
    own, inclusive = Counter(), Counter()
    for thread_events in by_thread.values():
        nested = _nested(thread_events)
        for name, start, end in _self_segments(nested):
            own[name] += _overlap(start, end, gaps, gap_starts)
        spans: dict = defaultdict(list)
        for name, start, end, _ in nested:
            spans[name].append((start, end))
        for name, intervals in spans.items():
            for start, end in _union(intervals):
                inclusive[name] += _overlap(start, end, gaps, gap_starts)
    return own, inclusive


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for start, end in sorted(intervals):
        if out and start <= out[-1][1]:
            out[-1][1] = max(out[-1][1], end)
        else:
            out.append([start, end])
    return [(a, b) for a, b in out]


def print_report(path: str, min_gap_us: float = 20.0, top: int = 25) -> None:
    events = load_events(path)
    busy = merged_busy(events)
    if len(busy) < 2:
        print(f"HOST IN GPU GAPS: no GPU activity in {path} (a CPU trace?)")
        return
    gaps = idle_gaps(busy, min_gap_us)
    span = busy[-1][1] - busy[0][0]
    idle = sum(b - a for a, b in gaps)
    own, inclusive = host_time_in_gaps(events, gaps)
    print(f"HOST IN GPU GAPS ({len(gaps)} gaps >= {min_gap_us:g} us, {idle / 1e3:.1f} ms of a {span / 1e3:.1f} ms "
          f"GPU span; the launching threads' frames and ops inside them)")
    for title, counter in (("self", own), ("inclusive", inclusive)):
        print(f"  by {title} time:")
        for name, us in counter.most_common(top):
            print(f"    {us / 1e3:9.2f} ms  {name[:150]}")


def write_trace(profiler, path) -> None:
    """The profiled steps as a chrome trace, gzipped to `path`.gz (the raw JSON is tens of MB), and this report on
    it (what the host ran while the GPU waited: the log keeps it even when the file does not come back)."""
    import shutil
    from pathlib import Path

    profiler.export_chrome_trace(str(path))
    with open(path, "rb") as raw, gzip.open(f"{path}.gz", "wb") as packed:
        shutil.copyfileobj(raw, packed)
    Path(path).unlink()
    print(f"TRACE {path}.gz ({Path(f'{path}.gz').stat().st_size / 2**20:.1f} MiB)", flush=True)
    print_report(f"{path}.gz", top=20)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("trace", help="a chrome trace (.json or .json.gz) from torch.profiler")
    p.add_argument("--min-gap-us", type=float, default=20.0, help="shortest GPU idle interval counted")
    p.add_argument("--top", type=int, default=25)
    args = p.parse_args()
    print_report(args.trace, args.min_gap_us, args.top)


if __name__ == "__main__":
    main()
