"""When a service loop polls without sleeping (spins): the worker's IO loop and the client's IO thread."""

from __future__ import annotations


class SpinPolicy:
    """Spin for ``spin_ns`` after a loop finished its work (``waiting``), and only while the next event has
    lately come within that window (``arrived``); otherwise the spin would only burn a core that other
    processes need (sparse traffic, or a machine already busy)."""

    def __init__(self, spin_ns: int) -> None:
        self.spin_ns = spin_ns
        self.until = 0  # perf_counter_ns() deadline of the current spin; 0: none
        self._done_at = 0
        self._gap_ns = 0  # moving average of the time from the end of the work to the next event

    def arrived(self, now: int) -> None:
        if self._done_at:
            # a sample is capped, so that one long pause stops spinning for a few events, not for hundreds
            self._gap_ns += (min(now - self._done_at, 4 * self.spin_ns) - self._gap_ns) // 8
            self._done_at = 0

    def waiting(self, now: int) -> None:
        if self.spin_ns:
            self._done_at = now
            self.until = now + self.spin_ns if self._gap_ns < self.spin_ns else 0
