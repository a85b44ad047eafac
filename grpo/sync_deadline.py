"""Weight-sync calls with a deadline that says what it waits for (docs/reliability.md).

Each server's part of each phase (pause, start, transfer, finish, resume) runs on a daemon thread; the trainer
joins it in one-second slices, logs a progress line every `every` seconds naming the server, the phase and the
version, and gives up at `weight_sync_timeout` with a `PhaseTimeout` (the caller drops that server when another
one is left). The HTTP timeout stays what it was: a stopped server (SIGSTOP) or a hung worker never answers, so
without this the trainer waited the whole `vllm_server_timeout` without a word.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections.abc import Callable

from grpo.progress import WaitProgress

log = logging.getLogger("grpo.weight_sync")


class PhaseTimeout(TimeoutError):
    """A server did not finish its part of a weight-sync phase within weight_sync_timeout."""


def start_thread(fn: Callable, what: str) -> tuple[threading.Thread, dict]:
    """Run `fn` on a daemon thread; (thread, result box with "value" or "error")."""
    result: dict = {}

    def target():
        try:
            result["value"] = fn()
        except BaseException as exc:  # surfaced to the caller
            result["error"] = exc

    thread = threading.Thread(target=target, daemon=True, name=what)
    thread.start()
    return thread, result


def join_within(thread: threading.Thread, result: dict, timeout: float, what: str):
    """Join `thread` (from `start_thread`) for at most `timeout` s: its value, its exception, or TimeoutError."""
    thread.join(timeout)
    if thread.is_alive():
        raise TimeoutError(f"{what} did not return within {timeout:.0f} s")
    if "error" in result:
        raise result["error"]
    return result.get("value")


def finish_quietly(control, deadline_s: float = 30.0) -> None:
    """Best-effort /finish_weight_update after a failed transfer (the server is usually dead or wedged by now), on a
    side thread given at most `deadline_s`: a silent server must not hold the trainer here either."""
    def finish():
        try:
            control.finish_weight_update(weight_version=None)
        except Exception:  # the original error is the one that matters
            pass

    start_thread(finish, "vllm-finish-cleanup")[0].join(deadline_s)


SLOW_PHASE_S = 0.5
"""A phase still running after this long gets one log line with where every thread of this process is."""


def thread_sites(frames: int = 3) -> str:
    """Where each thread of this process is: its innermost `frames` frames, "; "-separated (names the wait when
    a sync phase is slow: the HTTP thread in a socket read means the server has not answered, another thread in
    Python work means this process was busy)."""
    names = {t.ident: t.name for t in threading.enumerate()}
    parts = []
    for ident, frame in sys._current_frames().items():
        sites = []
        while frame is not None and len(sites) < frames:
            sites.append(f"{frame.f_code.co_name} ({frame.f_code.co_filename.rsplit('/', 1)[-1]}:{frame.f_lineno})")
            frame = frame.f_back
        parts.append(f"{names.get(ident, ident)}: {' < '.join(sites)}")
    return "; ".join(parts)


def wait_phase(thread: threading.Thread, result: dict, url: str, phase: str, version: int, deadline_s: float,
               every_s: float):
    """Join `thread` with progress lines; its value, its exception, or PhaseTimeout past `deadline_s`. A phase
    slower than SLOW_PHASE_S logs once where the threads are (`thread_sites`)."""
    progress = WaitProgress(f"{url} to finish the {phase} phase of weight sync version {version}", every_s, log)
    start = time.monotonic()
    end = start + deadline_s
    sampled = False
    while thread.is_alive():
        slice_s = 1.0 if sampled else max(start + SLOW_PHASE_S - time.monotonic(), 0.01)
        thread.join(min(slice_s, max(end - time.monotonic(), 0.01)))
        if not sampled and thread.is_alive() and time.monotonic() - start >= SLOW_PHASE_S:
            sampled = True
            log.info("weight sync version %d: the %s phase on %s has taken %.1f s so far; threads: %s", version,
                     phase, url, time.monotonic() - start, thread_sites())
        if thread.is_alive() and time.monotonic() >= end:
            raise PhaseTimeout(f"{url} did not finish the {phase} phase of weight sync version {version} within "
                               f"{deadline_s:.0f} s (weight_sync_timeout): the server is stopped (SIGSTOP), hung (a "
                               f"stuck worker) or overloaded; check its log, restart it, or raise "
                               f"--weight-sync-timeout")
        progress.tick(f"deadline {deadline_s:.0f} s")
    if "error" in result:
        raise result["error"]
    return result.get("value")


def call_phase(fn: Callable, url: str, phase: str, version: int, deadline_s: float, every_s: float):
    """`fn()` under `wait_phase`."""
    thread, result = start_thread(fn, f"vllm-{phase}")
    return wait_phase(thread, result, url, phase, version, deadline_s, every_s)
