"""The rollout worker's view of several vLLM servers: which server a group goes to, and which servers are alive.

Each server has its own generation client and its own adaptive `ConcurrencyCap` (steered by that server's
`/metrics`; `max_concurrent_rollouts` bounds each server). A group is placed whole on one server (group affinity:
the G rollouts share a prompt, so that server's prefix cache serves G-1 of its prefills; a multi-turn rollout stays
where it started). The least busy server wins: lowest rollouts in flight / its cap, then fewest groups placed so
far (so groups alternate when every server is idle, as under a tight staleness allowance), then the lower index.

A server is marked dead when a request to it fails for good (connection refused, or retries exhausted) or when
the trainer dropped it from the weight sync (a shared flag per server, `alive_flags`). Its in-flight rollouts are
re-dispatched by the scheduler to one surviving server per group; the run stops with `NoServerLeftError` when none
is left. A dead server never comes back within a run.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from grpo.flow_control import ConcurrencyCap

log = logging.getLogger("grpo.rollout")


class NoServerLeftError(ConnectionError):
    """Every vLLM server of the run is dead (or was dropped by the weight sync)."""


class ServerGone(ConnectionError):
    """The server a rollout was waiting for, or running on, died: dispatch it elsewhere."""


@dataclass
class Server:
    index: int
    url: str
    client: Any
    """`VLLMClient` of this server (one per event loop)."""
    cap: ConcurrencyCap
    alive: bool = True
    groups: int = 0
    """Groups placed here (first placements and moves after a death)."""
    last_preempt: float | None = None
    death: str = ""

    @property
    def busy(self) -> float:
        """Rollouts in flight as a fraction of its cap."""
        return self.cap.inflight / max(min(self.cap.limit, self.cap.max_concurrent), 1)


@dataclass
class GroupHome:
    """The server a group's rollouts go to; moved, for the rollouts not yet finished, when it dies."""

    server: Server


class ServerPool:
    """The servers of one rollout worker, in `--vllm-server-base-url` order."""

    def __init__(self, urls: list[str], clients: list[Any], max_concurrent: int, alive_flags=None):
        if not urls:
            raise ValueError("no vLLM server URL: pass --vllm-server-base-url URL [URL ...]")
        self.servers = [Server(i, url, client, ConcurrencyCap(max_concurrent))
                        for i, (url, client) in enumerate(zip(urls, clients, strict=True))]
        self.alive_flags = alive_flags
        """Shared per-server 0/1 flags (multiprocessing Array) between the trainer and this worker; None alone."""

    def __len__(self) -> int:
        return len(self.servers)

    @property
    def alive(self) -> list[Server]:
        self.refresh()
        return [s for s in self.servers if s.alive]

    def refresh(self) -> None:
        """Adopt the trainer's verdicts: a server it dropped from the weight sync serves stale weights."""
        if self.alive_flags is None:
            return
        for server in self.servers:
            if server.alive and not self.alive_flags[server.index]:
                self.mark_dead(server, "dropped by the trainer's weight sync (its weights would be stale)")

    def pick(self) -> Server:
        """Where the next group goes: the alive server least busy, then with the fewest groups, then first."""
        alive = self.alive
        if not alive:
            raise NoServerLeftError(self._none_left_message())
        server = min(alive, key=lambda s: (s.busy, s.groups, s.index))
        server.groups += 1
        return server

    def mark_dead(self, server: Server, reason: str) -> None:
        if not server.alive:
            return
        server.alive, server.death = False, reason
        if self.alive_flags is not None:
            self.alive_flags[server.index] = 0
        server.cap.close()  # wakes the groups waiting for one of its slots: they re-dispatch
        left = [s.url for s in self.servers if s.alive]
        log.warning("vLLM server %d (%s) is dead: %s; %d of %d servers left %s; its in-flight rollouts are "
                    "re-dispatched", server.index, server.url, reason, len(left), len(self.servers), left)

    def _none_left_message(self) -> str:
        deaths = "; ".join(f"{s.url}: {s.death}" for s in self.servers)
        return (f"no vLLM server left ({deaths}). Check the servers' logs, restart them, then resume with "
                f"--resume-from-checkpoint latest")

    async def acquire(self, server: Server) -> None:
        """A slot on `server`; raises ServerGone if it dies while waiting."""
        if not server.alive:
            raise ServerGone(server.url)
        await server.cap.acquire()
        if not server.alive:  # woken by mark_dead
            server.cap.release()
            raise ServerGone(server.url)

    async def slot(self, home: GroupHome) -> Server:
        """A slot on the group's server; when that server is dead, the group moves to the one `pick` names first
        (NoServerLeftError when none is left)."""
        while True:
            if not home.server.alive:
                home.server = self.pick()
            try:
                await self.acquire(home.server)
                return home.server
            except ServerGone:
                continue

    def gauges(self, alive: list[Server], polled: list) -> list[tuple[str, Any]]:
        """Server gauges from one `/metrics` poll of each alive server (None: that poll failed). KV usage: max
        over servers; running / queued: sums; preemptions: sum of each server's delta since its last poll."""
        items: list[tuple[str, Any]] = [("rollout/servers_alive", len(alive))]
        seen = [(s, m) for s, m in zip(alive, polled) if m is not None]
        if not seen:
            return items
        items += [
            ("rollout/vllm_kv_cache_usage_frac", max(m.kv_cache_usage for _, m in seen)),
            ("rollout/vllm_running_requests", sum(m.running for _, m in seen)),
            ("rollout/vllm_queued_requests", sum(m.waiting for _, m in seen))]
        deltas = [max(m.preemptions_total - s.last_preempt, 0.0) for s, m in seen if s.last_preempt is not None]
        if deltas:
            items.append(("rollout/vllm_preemption_count", sum(deltas)))
        for s, m in seen:
            s.last_preempt = m.preemptions_total
        if len(self.servers) > 1:
            items += [(f"rollout/server{s.index}_concurrency_cap", s.cap.limit) for s in alive]
        return items
