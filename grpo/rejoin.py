"""Dropped vLLM servers coming back (docs/reliability.md): the trainer probes each dropped server every
`server_rejoin_interval_s` with the checks the run made at start (health, the served model, max_model_len, dtype,
processed logprobs); one that passes is cold-synced to the current weight version by `WeightSync` before its flag
is set again, and only then does the rollout worker send it groups (`ServerPool.revive`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

log = logging.getLogger("grpo.rejoin")


def probe_server(url: str, expected: dict, check_model: Callable[[str, str, dict], None] | None = None,
                 timeout: float = 10.0) -> str | None:
    """None when the server at `url` can serve this run again; else why not (one line). `expected` holds the
    run's max_model_len and dtype (train.server_facts); `check_model(url, served, server_info)` raises ValueError
    for a server that serves another model (train.check_served_model)."""
    from grpo.vllm_client import ServerFacts, VLLMControl

    try:
        with VLLMControl(url, timeout=timeout) as control:
            health = control._http.get("/health", timeout=min(timeout, 5.0)).status_code
            if health != 200:
                return f"GET /health answered {health}"
            info = control.server_info()
            served = control.served_model_name()
            facts = ServerFacts.from_server_info(info, control.max_model_len())
    except Exception as exc:  # down, stopped, or half up: probed again later
        return f"{type(exc).__name__}: {exc}"
    try:
        facts.check(url)
        if check_model is not None:
            check_model(url, served, info)
    except ValueError as exc:
        return str(exc)
    if (facts.max_model_len, facts.dtype) != (expected.get("max_model_len"), expected.get("dtype")):
        return (f"it now serves max_model_len={facts.max_model_len} dtype={facts.dtype}, the run started with "
                f"max_model_len={expected.get('max_model_len')} dtype={expected.get('dtype')}; restart it with the "
                f"run's --max-model-len and --dtype")
    return None


class Rejoiner:
    """When each dropped server is probed next, and the warning lines about it (rank 0 of the trainer)."""

    def __init__(self, urls: list[str], interval_s: float, probe: Callable[[str], str | None] | None = None):
        self.urls, self.interval_s, self.probe = urls, interval_s, probe
        self.next_probe: dict[int, float] = {}
        self.reasons: dict[int, str] = {}
        self.rejoined_count = 0

    def dropped(self, i: int) -> None:
        """The sync just dropped it: the first probe comes one interval later."""
        self.next_probe[i] = time.monotonic() + self.interval_s

    def due(self, dropped: list[int]) -> list[int]:
        """Probe the dropped servers whose time has come (a server first seen dropped is probed at once); the
        ones that passed, to be cold-synced."""
        if self.probe is None or self.interval_s <= 0:
            return []
        now, passed = time.monotonic(), []
        for i in dropped:
            if now < self.next_probe.setdefault(i, now):
                continue
            self.next_probe[i] = now + self.interval_s
            reason = self.probe(self.urls[i])
            if reason is None:
                log.warning("vLLM server %s answers again and passes the start-up checks: cold-syncing the current "
                            "weights to it before it takes rollouts", self.urls[i])
                passed.append(i)
            elif reason != self.reasons.get(i):
                log.warning("dropped vLLM server %s is not back yet (%s); probed again every %.0f s "
                            "(server_rejoin_interval_s)", self.urls[i], reason, self.interval_s)
            self.reasons[i] = reason or ""
        return passed

    def rejoined(self, i: int, version: int) -> None:
        self.next_probe.pop(i, None)
        self.reasons.pop(i, None)
        self.rejoined_count += 1
        log.warning("vLLM server %s rejoined the run: it holds weight version %d and takes rollouts again",
                    self.urls[i], version)

    def failed(self, i: int, error: BaseException) -> None:
        log.warning("vLLM server %s failed its rejoin sync (%s); it stays dropped, probed again in %.0f s",
                    self.urls[i], error, self.interval_s)
        self.dropped(i)
