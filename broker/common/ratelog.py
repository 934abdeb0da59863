"""Rate-limited warnings for floods of bad messages: at most one line per ``interval`` seconds on the given
logger, each saying how many similar lines were dropped since the last one."""

from __future__ import annotations

import logging
import time


class RateLimitedLog:
    """One log line per ``interval`` seconds for a flood of bad messages, with the count of those dropped.

    It writes to its caller's logger (the worker passes ``logging.getLogger(__name__)`` of gpu_worker.worker),
    so the lines keep the logger name they are filtered by.
    """

    def __init__(self, logger: logging.Logger, interval: float = 5.0) -> None:
        self.log = logger
        self.interval = interval
        self._last = 0.0
        self._dropped = 0

    def warning(self, fmt: str, *args: object) -> None:
        now = time.monotonic()
        if now - self._last >= self.interval:
            self.log.warning(fmt + " (%d similar dropped)", *args, self._dropped)
            self._last = now
            self._dropped = 0
        else:
            self._dropped += 1
