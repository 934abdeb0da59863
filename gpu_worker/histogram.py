"""A small fixed-bucket histogram of durations, cheap enough to feed from the GPU pipeline's threads."""

from __future__ import annotations

import bisect
import threading

from shmbroker.broker.common import protocol as P


def _bounds() -> tuple[float, ...]:
    """Upper bucket bounds in microseconds, 10 us to 10 s, ten per decade (1, 1.25, 1.5, 2, 2.5, 3, 4, 5, 6, 8)."""
    return (*(float(m * 10**k) for k in range(1, 7) for m in (1, 1.25, 1.5, 2, 2.5, 3, 4, 5, 6, 8)), 1e7)


BOUNDS_US = _bounds()


class Histogram:
    """Thread-safe: ``add`` from any thread, ``snapshot`` for the stats message, ``quantile`` for reports."""

    def __init__(self, bounds_us: tuple[float, ...] = BOUNDS_US) -> None:
        self.bounds_us = bounds_us
        self._counts = [0] * (len(bounds_us) + 1)
        self._count = 0
        self._sum = 0.0
        self._max = 0.0
        self._lock = threading.Lock()

    def add(self, us: float) -> None:
        i = bisect.bisect_left(self.bounds_us, us)
        with self._lock:
            self._counts[i] += 1
            self._count += 1
            self._sum += us
            self._max = max(self._max, us)

    def add_all(self, values_us: list[float]) -> None:
        """Several observations under one lock (a batch's requests)."""
        idx = [bisect.bisect_left(self.bounds_us, us) for us in values_us]
        with self._lock:
            for i in idx:
                self._counts[i] += 1
            self._count += len(values_us)
            self._sum += sum(values_us)
            self._max = max(self._max, *values_us) if values_us else self._max

    def add_same(self, us: float, n: int) -> None:
        """``n`` observations of one duration (a batch's stage, once per request it served) under one lock."""
        i = bisect.bisect_left(self.bounds_us, us)
        with self._lock:
            self._counts[i] += n
            self._count += n
            self._sum += us * n
            self._max = max(self._max, us)

    def snapshot(self) -> P.StageHistogram:
        with self._lock:
            return P.StageHistogram(list(self.bounds_us), list(self._counts), self._count, self._sum, self._max)


def quantile(h: P.StageHistogram, q: float) -> float | None:
    """The upper bound of the bucket holding quantile ``q`` (the maximum for the open last bucket); None if empty."""
    if h.count == 0:
        return None
    rank = q * h.count
    seen = 0
    for i, n in enumerate(h.counts):
        seen += n
        if seen >= rank and n:
            return min(h.bounds_us[i], h.max_us) if i < len(h.bounds_us) else h.max_us
    return h.max_us


def mean(h: P.StageHistogram) -> float | None:
    return h.sum_us / h.count if h.count else None
