"""The IO loop's choice between sleeping in poll and polling without sleep (spinning)."""

from __future__ import annotations


class SpinPolicy:
    """When the IO loop polls without sleeping: for ``spin_ns`` after it ran a batch inline, and only while
    the next request has lately come within that window; otherwise the spin would only burn a core that
    other processes need (sparse traffic, or a machine already busy)."""

    def __init__(self, spin_ns: int) -> None:
        self.spin_ns = spin_ns
        self.until = 0  # perf_counter_ns() deadline of the current spin; 0: none
        self._done_at = 0
        self._gap_ns = 0  # moving average of the time from an inline batch to the next request

    def arrived(self, now: int) -> None:
        if self._done_at:
            # a sample is capped, so that one long pause stops spinning for a few requests, not for hundreds
            self._gap_ns += (min(now - self._done_at, 4 * self.spin_ns) - self._gap_ns) // 8
            self._done_at = 0

    def ran_inline(self, now: int) -> None:
        if self.spin_ns:
            self._done_at = now
            self.until = now + self.spin_ns if self._gap_ns < self.spin_ns else 0
