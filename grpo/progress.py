"""Progress lines while waiting on something external (server start, `/health`, an empty sample queue): one log
line every `every` seconds saying what is awaited and since when, so a wait is never silent."""

from __future__ import annotations

import contextlib
import logging
import threading
import time

log = logging.getLogger("grpo.wait")

DEFAULT_EVERY_S = 30.0


class WaitProgress:
    """`tick()` inside a polling loop; it logs at most once per `every` seconds, the first time after `every`."""

    def __init__(self, what: str, every: float = DEFAULT_EVERY_S, logger: logging.Logger = log):
        self.what, self.every, self.logger = what, every, logger
        self.restart()

    def restart(self) -> None:
        self.since_wall, self.since = time.time(), time.monotonic()
        self._next = self.since + self.every
        self.lines = 0

    @property
    def waited_s(self) -> float:
        return time.monotonic() - self.since

    def tick(self, detail: str = "") -> bool:
        """Log a line if one is due; return whether it did."""
        now = time.monotonic()
        if now < self._next:
            return False
        self._next = now + self.every
        self.lines += 1
        since = time.strftime("%H:%M:%S", time.localtime(self.since_wall))
        self.logger.warning("still waiting for %s since %s (%.0f s)%s", self.what, since, now - self.since,
                            f": {detail}" if detail else "")
        return True


@contextlib.contextmanager
def heartbeat(what: str, every: float = DEFAULT_EVERY_S, logger: logging.Logger = log):
    """For a blocking call that cannot tick (a kernel check that autotunes for minutes): a daemon thread logs the
    same "still waiting for ..." line every `every` seconds until the block exits."""
    progress, done = WaitProgress(what, every, logger), threading.Event()

    def beat():
        while not done.wait(min(1.0, every / 4)):
            progress.tick()

    thread = threading.Thread(target=beat, name="heartbeat", daemon=True)
    thread.start()
    try:
        yield progress
    finally:
        done.set()
        thread.join()
