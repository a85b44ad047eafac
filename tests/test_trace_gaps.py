"""scripts/trace_gaps.py: the GPU's idle gaps in a chrome trace and the host frames that ran during them, checked on
a hand-built trace whose answer is known."""

from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

import trace_gaps  # noqa: E402


def _x(cat, name, ts, dur, tid=1, pid=1):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": pid, "tid": tid}


def _trace():
    return [
        _x("kernel", "k1", 0, 100, tid=7, pid=0), _x("kernel", "k2", 200, 100, tid=7, pid=0),
        _x("gpu_memcpy", "copy", 250, 60, tid=8, pid=0),  # another stream, overlapping k2: merged
        _x("kernel", "k3", 320, 80, tid=7, pid=0),  # 10 us after the copy: below the 20 us threshold
        _x("cuda_runtime", "cudaLaunchKernel", 5, 3),  # thread (1, 1) launches GPU work
        _x("python_function", "layer", 90, 160), _x("python_function", "guard", 100, 40),
        _x("cpu_op", "aten::mm", 150, 10),
        _x("python_function", "recursive", 170, 20), _x("python_function", "recursive", 175, 10),
        _x("python_function", "other thread", 100, 100, tid=2),  # launches nothing: not counted
        {"ph": "M", "name": "thread_name", "pid": 1, "tid": 1, "args": {"name": "main"}},
    ]


def test_gaps_are_the_idle_time_between_merged_streams():
    events = [e for e in _trace() if e["ph"] == "X"]
    busy = trace_gaps.merged_busy(events)
    assert busy == [(0, 100), (200, 310), (320, 400)]
    assert trace_gaps.idle_gaps(busy, 20) == [(100, 200)]
    assert trace_gaps.idle_gaps(busy, 5) == [(100, 200), (310, 320)]


def test_self_and_inclusive_time_inside_the_gaps():
    events = [e for e in _trace() if e["ph"] == "X"]
    own, inclusive = trace_gaps.host_time_in_gaps(events, [(100, 200)])
    # layer spans 90-250; inside the gap its children take 100-140, 150-160 and 170-190
    assert own["guard"] == pytest.approx(40)
    assert own["aten::mm"] == pytest.approx(10)
    assert own["recursive"] == pytest.approx(20)
    assert own["layer"] == pytest.approx(100 - 40 - 10 - 20)
    assert sum(own.values()) == pytest.approx(100)  # the gap is covered once, by the innermost frames
    assert inclusive["layer"] == pytest.approx(100)
    assert inclusive["recursive"] == pytest.approx(20)  # nested calls of one name counted once per moment
    assert "other thread" not in own and "other thread" not in inclusive


def test_an_unclosed_call_is_clipped_to_its_parent():
    """The profiler's Python tracer can leave a call unclosed (its end at the trace's end): it must not swallow the
    later frames as its children, nor count the rest of the trace as its own time."""
    events = [
        _x("cuda_runtime", "cudaLaunchKernel", 5, 3),
        _x("python_function", "layer 1", 100, 40), _x("python_function", "apply", 110, 10_000),  # unclosed
        _x("python_function", "between layers", 140, 20),
        _x("python_function", "layer 2", 160, 40), _x("python_function", "apply", 170, 10_000),  # unclosed
    ]
    own, inclusive = trace_gaps.host_time_in_gaps(events, [(100, 200)])
    assert own["between layers"] == pytest.approx(20)
    assert own["apply"] == pytest.approx(30 + 30)  # 110-140 and 170-200: clipped at each layer's end
    assert own["layer 1"] == pytest.approx(10) and own["layer 2"] == pytest.approx(10)
    assert sum(own.values()) == pytest.approx(100)
    assert inclusive["apply"] == pytest.approx(60)


def test_report_reads_a_gzipped_trace(tmp_path, capsys):
    path = tmp_path / "t.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": _trace()}, f)
    trace_gaps.print_report(str(path), min_gap_us=20, top=4)
    out = capsys.readouterr().out
    assert "1 gaps >= 20 us, 0.1 ms of a 0.4 ms GPU span" in out
    assert out.index("guard") < out.index("aten::mm")  # by self time: 40 before 10
