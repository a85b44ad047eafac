"""vLLM's Prometheus `/metrics` text: the scheduler gauges the adaptive concurrency cap and the rollout metrics
read, aggregated over a server's engines (data-parallel ranks). Fetched by `VLLMClient.metrics` (vllm_client.py).
"""

from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass
class ServerMetrics:
    """The scheduler gauges the adaptive concurrency cap reads, aggregated over engines (data-parallel ranks)."""

    kv_cache_usage: float
    """KV-cache usage fraction 0-1, max over engines (`rollout/vllm_kv_cache_usage_frac`)."""
    running: int
    """Requests running, summed over engines."""
    waiting: int
    """Requests queued, summed over engines."""
    preemptions_total: float
    """Cumulative preemptions, summed over engines (the caller logs deltas)."""
    kv_cache_max_concurrency: float
    """Sum over engines of `cache_config_info{kv_cache_max_concurrency}`: full-length requests the KV cache holds."""


_SAMPLE_LINE = re.compile(r"^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(?P<labels>.*)\})?\s+(?P<value>\S+)(?:\s+\S+)?$")
_LABEL = re.compile(r'(?P<key>[a-zA-Z_][a-zA-Z0-9_]*)="(?P<value>(?:[^"\\]|\\.)*)"')


def iter_prometheus(text: str):
    """Yield (name, labels, value) for each sample line of the Prometheus text format; skip comments and _created."""
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        match = _SAMPLE_LINE.match(line)
        if match is None:
            raise ValueError(f"not a Prometheus sample line: {line[:200]!r}")
        name = match["name"]
        if name.endswith("_created"):
            continue
        labels = {m["key"]: m["value"] for m in _LABEL.finditer(match["labels"] or "")}
        yield name, labels, float(match["value"])


def parse_metrics(text: str) -> ServerMetrics:
    """Aggregate vLLM's gauges over engines; ValueError when the text holds none of them (not a vLLM /metrics)."""
    usage: list[float] = []
    sums = {"running": 0.0, "waiting": 0.0, "preemptions": 0.0, "concurrency": 0.0}
    seen = False
    for name, labels, value in iter_prometheus(text):
        # `gpu_cache_usage_perc` is the pre-0.10 name of the same gauge.
        if name in ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"):
            usage.append(value)
        elif name == "vllm:num_requests_running":
            sums["running"] += value
        elif name == "vllm:num_requests_waiting":
            sums["waiting"] += value
        elif name == "vllm:num_preemptions_total":
            sums["preemptions"] += value
        elif name == "vllm:cache_config_info" and "kv_cache_max_concurrency" in labels:
            sums["concurrency"] += float(labels["kv_cache_max_concurrency"])
        else:
            continue
        seen = True
    if not seen:
        raise ValueError("no vllm:* scheduler metrics found in the /metrics text")
    return ServerMetrics(kv_cache_usage=max(usage, default=0.0), running=int(sums["running"]),
                         waiting=int(sums["waiting"]), preemptions_total=sums["preemptions"],
                         kv_cache_max_concurrency=sums["concurrency"])
