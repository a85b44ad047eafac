"""Dropped vLLM servers coming back (docs/reliability.md): the trainer probes each dropped server every
`server_rejoin_interval_s` with the checks the run made at start (health, the served model, max_model_len, dtype,
processed logprobs); one that passes is cold-synced to the current weight version by `WeightSync` before its flag
is set again, and only then does the rollout worker send it groups (`ServerPool.revive`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from grpo.sync_errors import WeightSyncError

log = logging.getLogger("grpo.rejoin")


def probe_server(url: str, expected: dict, check_model: Callable[[str, str, dict], None] | None = None,
                 timeout: float = 10.0) -> str | None:
    """None when the server at `url` can serve this run again; else why not (one line). `expected` holds the
    run's max_model_len and dtype (grpo/server_facts.py); `check_model(url, served, server_info)` raises ValueError
    for a server that serves another model (`check_served_model`, grpo/server_facts.py)."""
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


class RejoinMixin:
    """`WeightSync`'s side of the rejoin (rank 0): dropped servers admitted into a sync, or cold-synced alone when
    none is alive. Uses WeightSync's `rejoiner`, `_joining`, `alive_flags`, `_phase`, `_transfer` and its
    transport (the cpu_file one's kept file and `load`)."""

    def _admit_rejoiners(self) -> None:
        """Rank 0, before a sync: dropped servers that pass their probe take part in it."""
        if self.adapter is None and self.mode != "ipc":
            self._joining |= set(self.rejoiner.due(self.dropped()))

    def _confirm(self, i: int, version: int) -> None:
        self._joining.discard(i)
        self.alive_flags[i] = 1  # the rollout worker sends it groups from now on
        self.rejoiner.rejoined(i, version)

    def _can_rejoin_alone(self) -> bool:
        """Rank 0 can cold-sync a server without the other ranks (one rank, or the kept file of cpu_file)."""
        return (self.config.rejoin_wait_s > 0 and self.rejoiner.probe is not None and self.adapter is None
                and self.mode != "ipc" and (self.world_size == 1 or self.mode == "cpu_file"))

    def rejoin_alone(self, model, version: int) -> bool:
        """Rank 0, no server alive (the trainer waits for samples, or a sync lost its last server): probe the
        dropped servers that are due and cold-sync the first that passes, alone. True when one rejoined."""
        if self.rank != 0 or self.alive() or not self._can_rejoin_alone():
            return False
        kept = getattr(self.transport, "kept_file", None)  # cpu_file on several ranks: the last version
        if self.world_size > 1 and not kept:  # no version written yet
            return False
        for i in self.rejoiner.due(self.dropped()):
            self._joining = {i}
            try:
                self._phase(i, "pause", version, lambda c=self.controls[i]: c.pause(mode="keep"))
                if self.world_size > 1:
                    self.transport.load(i, kept, version)
                else:
                    self._transfer(model, version)
                if i in self._joining:
                    self._phase(i, "resume", version, self.controls[i].resume)
            except Exception as exc:
                self._joining.discard(i)
                self.rejoiner.failed(i, exc)
            if i in self._joining:
                self._confirm(i, version)
                self._none_left = None
                return True
        return False

    def _wait_for_rejoin(self, model, version: int) -> None:
        """Rank 0 after a sync that lost its last server: wait up to rejoin_wait_s for one to come back."""
        from grpo.progress import WaitProgress

        error = self._none_left or WeightSyncError(f"weight sync version {version}: no vLLM server is alive")
        if not self._can_rejoin_alone():
            raise error
        progress = WaitProgress(f"a vLLM server to come back for weight version {version} (every server is "
                                f"dropped; probed every {self.config.rejoin_interval_s:.0f} s)",
                                self.config.progress_every, log)
        deadline = time.monotonic() + self.config.rejoin_wait_s
        while not self.rejoin_alone(model, version):
            if time.monotonic() >= deadline:
                raise WeightSyncError(f"{error}\n  No server came back within {self.config.rejoin_wait_s:.0f} s "
                                      f"(server_rejoin_wait_s): restart the servers, then resume with "
                                      f"--resume-from-checkpoint latest") from error.__cause__
            progress.tick("; ".join(f"{self.urls[i]}: {self.rejoiner.reasons.get(i, 'not probed yet')}"
                                    for i in self.dropped()))
            time.sleep(min(1.0, max(self.config.rejoin_interval_s, 0.1)))
