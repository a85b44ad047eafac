"""One live run per output directory: `<output_dir>/.run.lock` names the run holding it (pid, host, start time).

Two runs writing one output_dir overwrite each other's checkpoints, ledgers and metrics without a word; the second
is refused at start, naming the first. A lock whose process is gone (a killed run) is taken over with a log line;
one held from another host cannot be checked from here and is refused, naming the file to delete.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from pathlib import Path

log = logging.getLogger("train")
LOCK_NAME = ".run.lock"


class OutputDirInUseError(RuntimeError):
    """Another live run holds the output directory."""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        return True
    return True


def acquire(output_dir: str | Path) -> Path:
    """Take the output directory's lock (rank 0, before anything is written there); returns the lock file."""
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    lock, host = out / LOCK_NAME, socket.gethostname()
    mine = {"pid": os.getpid(), "host": host, "start": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
    for _ in range(3):  # a dead holder's file is removed and the exclusive create retried
        try:
            fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            _clear_or_refuse(lock, host)
            continue
        with os.fdopen(fd, "w") as f:
            json.dump(mine, f)
        return lock
    raise OutputDirInUseError(f"could not take {lock}: another run keeps creating it; check who writes "
                              f"--output-dir {out}")


def _clear_or_refuse(lock: Path, host: str) -> None:
    try:
        holder = json.loads(lock.read_text())
        pid, where, since = int(holder["pid"]), str(holder["host"]), holder.get("start", "?")
    except FileNotFoundError:
        return
    except (ValueError, KeyError, TypeError):
        log.warning("taking over %s: it is not a readable lock (%r)", lock, lock.read_text()[:80])
        lock.unlink(missing_ok=True)
        return
    if where == host and (pid == os.getpid() or not _alive(pid)):
        log.warning("taking over %s from run pid %d on %s started %s (%s)", lock, pid, where, since,
                    "this process" if pid == os.getpid() else "that process is gone")
        lock.unlink(missing_ok=True)
        return
    state = "alive" if where == host else "on another host, not checkable from here"
    raise OutputDirInUseError(
        f"--output-dir {lock.parent} is in use by the run pid {pid} on {where}, started {since} ({state}): two runs "
        f"in one output_dir overwrite each other's checkpoints and logs. Pass another --output-dir, or stop that run "
        f"(to resume it later: --resume-from-checkpoint latest); if it is dead, delete {lock}")


def release(lock: Path | None) -> None:
    """Remove the lock if this process still holds it."""
    if lock is None:
        return
    try:
        if json.loads(lock.read_text()).get("pid") == os.getpid():
            lock.unlink()
    except (FileNotFoundError, ValueError):
        pass
