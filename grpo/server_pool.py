"""The rollout worker's view of several vLLM servers: which server a group goes to, and which servers are alive.

Each server has its own generation client and its own adaptive `ConcurrencyCap` (steered by that server's
`/metrics`; `max_concurrent_rollouts` bounds each server). A group is placed whole on one server (group affinity:
the G rollouts share a prompt, so that server's prefix cache serves G-1 of its prefills; a multi-turn rollout stays
where it started). The least busy server wins: lowest rollouts in flight / its cap, then fewest groups placed so
far (so groups alternate when every server is idle, as under a tight staleness allowance), then the lower index.

A server is marked dead when a request to it fails for good (connection refused, or retries exhausted) or when
the trainer dropped it from the weight sync (a shared flag per server, `alive_flags`). Its in-flight rollouts are
re-dispatched by the scheduler to one surviving server per group; the run stops with `NoServerLeftError` when none
is left. A dead server comes back when the trainer sets its flag again, after it answered a probe and took a cold
sync of the current weights (grpo/rejoin.py); with no server alive, `slot` waits up to `rejoin_wait_s` for one (a
progress line every `progress_every` seconds) before raising `NoServerLeftError`.
"""

from __future__ import annotations

import asyncio
import logging
import time
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
    epoch: int = 0
    """Times it came back: a failure of a request sent before its return does not kill it again."""

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

    def __init__(self, urls: list[str], clients: list[Any], max_concurrent: int, alive_flags=None,
                 rejoin_wait_s: float = 0.0, progress_every: float = 30.0):
        if not urls:
            raise ValueError("no vLLM server URL: pass --vllm-server-base-url URL [URL ...]")
        self.servers = [Server(i, url, client, ConcurrencyCap(max_concurrent))
                        for i, (url, client) in enumerate(zip(urls, clients, strict=True))]
        self.alive_flags = alive_flags
        """Shared per-server 0/1 flags (multiprocessing Array) between the trainer and this worker; None alone."""
        self.max_concurrent = max_concurrent
        self.rejoin_wait_s, self.progress_every = rejoin_wait_s, progress_every
        self._waiting = None  # WaitProgress while no server is alive

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
            elif not server.alive and self.alive_flags[server.index]:
                self.revive(server)

    def revive(self, server: Server) -> None:
        """The trainer cold-synced it after it answered again: it takes groups from now on (a fresh cap)."""
        server.alive, server.cap = True, ConcurrencyCap(self.max_concurrent)
        server.epoch += 1
        left = [s.url for s in self.servers if s.alive]
        log.warning("vLLM server %d (%s) is back (it was dead: %s): it answered the trainer's probe and holds the "
                    "current weights; %d of %d servers alive", server.index, server.url, server.death, len(left),
                    len(self.servers))
        server.death = ""

    def pick(self) -> Server:
        """Where the next group goes: the alive server least busy, then with the fewest groups, then first."""
        alive = self.alive
        if not alive:
            raise NoServerLeftError(self._none_left_message())
        server = min(alive, key=lambda s: (s.busy, s.groups, s.index))
        server.groups += 1
        return server

    def mark_dead(self, server: Server, reason: str, epoch: int | None = None) -> None:
        """`epoch`: the server's epoch when the failed request was sent (a stale failure is ignored)."""
        if not server.alive or (epoch is not None and epoch != server.epoch):
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

    async def wait_for_server(self) -> None:
        """Return once a server is alive; with none, wait up to `rejoin_wait_s` for the trainer to bring one back
        (a progress line every `progress_every` s), then raise NoServerLeftError."""
        if self.alive:
            self._waiting = None
            return
        from grpo.progress import WaitProgress

        if self._waiting is None:  # one wait (and one progress line) however many rollouts wait
            self._waiting = WaitProgress("a vLLM server to come back (every server is dead; the trainer probes them "
                                         "every server_rejoin_interval_s)", self.progress_every, log)
        progress = self._waiting
        deadline = progress.since + self.rejoin_wait_s
        while not self.alive:
            if time.monotonic() >= deadline:
                raise NoServerLeftError(self._none_left_message() + f" (waited {self.rejoin_wait_s:.0f} s, "
                                        f"server_rejoin_wait_s, for one to come back)")
            progress.tick("; ".join(f"{s.url}: {s.death}" for s in self.servers))
            await asyncio.sleep(0.5)

    async def pick_alive(self) -> Server:
        """`pick`, after waiting (bounded) for a server when none is alive."""
        await self.wait_for_server()
        return self.pick()

    async def slot(self, home: GroupHome) -> Server:
        """A slot on the group's server; when that server is dead, the group moves to the one `pick` names first
        (after a bounded wait for one to come back when none is alive; then NoServerLeftError)."""
        while True:
            if not home.server.alive:
                home.server = await self.pick_alive()
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
