"""Where a profiled trainer step spends its eager work and its host waits, by Python site (scripts/bench_step.py
--profile prints both tables after the kernel table).

OP SITES: each op of `SITE_OPS` grouped by the Python frames above it (forward) or, for an op autograd's thread ran
(no Python frames), by its autograd node and the Python site of the forward op that made the node (matched by
sequence number). HOST SYNCS: each CUDA runtime call of `SYNC_CALLS` by the op that made it and that op's site,
with the time the host was blocked. GPU IDLE: the gaps between the GPU's kernels and copies, each charged to the op
(and its site) that launched the work ending the gap: where the GPU waited for the host.
"""

from __future__ import annotations

SITE_OPS = ("aten::copy_", "aten::mul", "aten::index", "aten::_index_put_impl_", "aten::index_add_", "aten::add",
            "aten::add_", "aten::cat", "aten::sum", "aten::fill_", "aten::mm", "aten::bmm")
"""The ops `print_op_sites` attributes: the eager elementwise, gather/scatter and matmul work of a step."""


def _python_site(event, depth: int = 3) -> str | None:
    """The first `depth` Python frames above a profiler event that are ours, FSDP2's or the model's."""
    frames, parent = [], event.cpu_parent
    while parent is not None and len(frames) < depth:
        name = parent.name
        if ".py(" in name and ("site-packages" not in name or "torch/distributed" in name
                               or "transformers/models" in name):
            frames.append(name.split("/")[-1])
        parent = parent.cpu_parent
    return " <- ".join(frames) or None


def _backward_node(event):
    """The autograd node (`autograd::engine::evaluate_function: XBackward0`) an op runs under, or None (forward)."""
    parent = event.cpu_parent
    while parent is not None:
        if parent.name.startswith("autograd::engine::evaluate_function:"):
            return parent
        parent = parent.cpu_parent
    return None


SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")
"""CUDA runtime calls where the host waits for the GPU (`.item()`, `.tolist()`, mask indexing, `nonzero`, ...)."""


def _site_namer(events):
    """key(event, label): 'fwd <label>  <Python site>' for an op the forward ran, or, for one run by autograd's
    thread (no Python frames), 'bwd <label> in <node> of <forward op> at <its Python site>' (node matched to the
    forward op that made it by sequence number)."""
    from collections import defaultdict

    by_seq = defaultdict(list)
    for e in events:  # sequence number -> the forward ops that recorded it (the node's op and ops inside it)
        seq = getattr(e, "sequence_nr", -1)
        if seq is not None and seq >= 0 and not e.name.startswith("autograd::") and _backward_node(e) is None:
            by_seq[seq].append(e)

    def forward_site(node) -> str:
        kind = node.name.rsplit(":", 1)[-1].strip().lower()  # e.g. mulbackward0: prefer aten::mul over a cast in it
        candidates = by_seq.get(node.sequence_nr, [])
        named = [e for e in candidates if kind.startswith(e.name.removeprefix("aten::").strip("_").lower())]
        for e in named + candidates:
            site = _python_site(e)
            if site is not None:
                return f"{e.name.removeprefix('aten::')} at {site}"
        return "(forward site unknown)"

    def key(event, label: str) -> str:
        node = _backward_node(event)
        if node is None:
            return f"fwd {label}  {_python_site(event) or '(no Python frame)'}"
        return f"bwd {label} in {node.name.rsplit(':', 1)[-1].strip()} of {forward_site(node)}"

    return key


def print_profile(profiler, label: str, cuda: bool) -> None:
    """The profiled steps' top kernels/ops (by self GPU time on CUDA, else self CPU time), then their op sites."""
    print(f"PROFILE {label} (2 steps)")
    sort = "self_cuda_time_total" if cuda else "self_cpu_time_total"
    print(profiler.key_averages().table(sort_by=sort, row_limit=30, max_name_column_width=70))
    print_op_sites(profiler, sort)


def print_op_sites(profiler, sort: str, top: int = 25) -> None:
    """Where the eager work comes from: each `SITE_OPS` op grouped by the Python frames above it (forward) or, in
    the backward, by its autograd node and the forward op's Python site (`_site_namer`): the attribution a kernel
    table cannot give. Then where the host waited for the GPU (`SYNC_CALLS`, under which op, from which site)."""
    from collections import defaultdict

    cuda = sort.startswith("self_cuda")
    events = list(profiler.events())
    key = _site_namer(events)
    total, count = defaultdict(float), defaultdict(int)
    for e in events:
        if e.name in SITE_OPS:
            k = key(e, e.name)
            total[k] += e.self_device_time_total if cuda else e.self_cpu_time_total
            count[k] += 1
    grand = sum(total.values()) or 1.0
    print(f"OP SITES ({', '.join(o.removeprefix('aten::') for o in SITE_OPS)}: top {top} of {len(total)} sites by "
          f"self {'GPU' if cuda else 'CPU'} time over the profiled steps; {grand / 1e3:.1f} ms in all)")
    for k in sorted(total, key=total.get, reverse=True)[:top]:
        print(f"  {total[k] / 1e3:8.2f} ms {100 * total[k] / grand:5.1f}% {count[k]:6d}x  {k}")
    _print_syncs(events, key, top)
    if cuda:
        print_gpu_idle(events, key, top)


def _print_syncs(events, key, top: int) -> None:
    """HOST SYNCS: each `SYNC_CALLS` call by the op that made it and that op's site, with the time the host was
    blocked (the GPU then idles until the host queues work again)."""
    from collections import defaultdict

    blocked, count = defaultdict(float), defaultdict(int)
    for e in events:
        if e.name not in SYNC_CALLS:
            continue
        op = e.cpu_parent
        while op is not None and not op.name.startswith("aten::"):
            op = op.cpu_parent
        k = key(e, f"{e.name} under {op.name if op is not None else '(no op)'}")
        blocked[k] += e.cpu_time_total
        count[k] += 1
    if not blocked:
        print("HOST SYNCS: none recorded (no CUDA runtime events: a CPU run, or no sync)")
        return
    print(f"HOST SYNCS ({sum(count.values())} calls, the host blocked {sum(blocked.values()) / 1e3:.1f} ms over the "
          f"profiled steps; top {top} of {len(blocked)} sites)")
    for k in sorted(blocked, key=blocked.get, reverse=True)[:top]:
        print(f"  {blocked[k] / 1e3:8.2f} ms {count[k]:6d}x  {k}")


def _on_gpu(event) -> bool:
    return str(getattr(event, "device_type", "")).endswith("CUDA")


def gpu_idle_gaps(events, min_gap_us: float = 5.0):
    """(busy us, span us, [(gap us, launching event)]): the GPU's work (kernels, copies, memsets: events with a
    CUDA device type) merged into busy intervals; each gap of at least `min_gap_us` paired with the CPU op that
    launched the work after it (`_launcher_finder`), None if unknown."""
    device = [e for e in events if _on_gpu(e)]
    if not device:
        return 0.0, 0.0, []
    launcher = _launcher_finder(events)
    device.sort(key=lambda e: e.time_range.start)
    busy, gaps = 0.0, []
    start, end = device[0].time_range.start, device[0].time_range.end
    for e in device[1:]:
        if e.time_range.start > end:
            busy += end - start
            if e.time_range.start - end >= min_gap_us:
                gaps.append((e.time_range.start - end, launcher(e)))
            start = e.time_range.start
        end = max(end, e.time_range.end)
    busy += end - start
    return busy, device[-1].time_range.end - device[0].time_range.start, gaps


LAUNCH_CALLS = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx", "cudaMemcpyAsync",
                "cudaMemsetAsync", "cudaGraphLaunch")
"""CUDA runtime calls that queue GPU work: the fallback for matching a kernel to the op that launched it."""


def _launcher_finder(events):
    """device event -> the CPU op that launched it: by correlation (the device event's `linked_correlation_id` is
    the op's `id`) where this torch's profiler records it, else the op above the last launch call that started
    before the work did (an idle GPU runs new work a few us after its launch)."""
    import bisect

    ops = {e.id: e for e in events if not _on_gpu(e)}
    launches = sorted((e for e in events if e.name in LAUNCH_CALLS), key=lambda e: e.time_range.start)
    starts = [e.time_range.start for e in launches]

    def find(device_event):
        op = ops.get(getattr(device_event, "linked_correlation_id", 0) or -1)
        if op is not None and op.name not in LAUNCH_CALLS:
            return op
        i = bisect.bisect_right(starts, device_event.time_range.start) - 1
        if i < 0:
            return None
        return launches[i].cpu_parent or launches[i]  # the innermost op or record around the launch

    return find


def print_gpu_idle(events, key, top: int = 25) -> None:
    """GPU IDLE: how much of the profiled span the GPU had nothing to run, and the sites whose launches ended the
    longest waits (the host was busy before them: Python, launches, a sync, the next step's batching)."""
    from collections import defaultdict

    busy, span, gaps = gpu_idle_gaps(events)
    if not span:
        return
    idle, count = defaultdict(float), defaultdict(int)
    for gap, op in gaps:
        k = key(op, op.name) if op is not None else "(launching op unknown)"
        idle[k] += gap
        count[k] += 1
    waited = sum(idle.values())
    print(f"GPU IDLE ({span / 1e3:.1f} ms from the first kernel to the last: busy {busy / 1e3:.1f} ms, idle "
          f"{(span - busy) / 1e3:.1f} ms ({100 * (span - busy) / span:.0f} %), {waited / 1e3:.1f} ms of it in "
          f"{len(gaps)} gaps >= 5 us; top {top} of {len(idle)} sites by the idle time before their launch)")
    for k in sorted(idle, key=idle.get, reverse=True)[:top]:
        print(f"  {idle[k] / 1e3:8.2f} ms {count[k]:6d}x  {k}")
