"""When a service loop polls without sleeping (spins): the worker's IO loop, the client's IO thread and a
caller waiting in ``infer()``."""

from __future__ import annotations

HIT_ONE = 256  # the moving share of hits is kept in 1/256ths, so it stays an int
HIT_MIN = HIT_ONE // 2


class SpinPolicy:
    """Spin for ``spin_ns`` after a loop finished its work (``waiting``), and only while at least half of
    the recent events (``arrived``) came within ``reach`` such windows (1 unless set); otherwise the spin
    would only burn a core that other processes need (sparse traffic, or a slow model).

    The share of hits, not the mean gap, decides: on a virtual machine whose host preempts it, a few long
    pauses lift the mean past the window while most events still come within it, and sleeping then costs
    the most (bench/RESULTS.md#spin-policy-and-io-thread-reach).
    """

    def __init__(self, spin_ns: int, reach: int = 1) -> None:
        self.spin_ns = spin_ns
        self.reach_ns = reach * spin_ns  # an event that comes within this of ``waiting`` is a hit
        self.until = 0  # perf_counter_ns() deadline of the current spin; 0: none
        self._done_at = 0
        self._hits = HIT_ONE  # moving share (of HIT_ONE) of the events that came within the reach

    def arrived(self, now: int, far: bool = True) -> None:
        """An event came at ``now``; ``far=False`` counts it a hit only within one window, whatever the reach."""
        if self._done_at:
            hit = HIT_ONE if now - self._done_at < (self.reach_ns if far else self.spin_ns) else 0
            self._hits += (hit - self._hits) >> 3  # a weight of 1/8: a change of traffic shows within a few events
            self._done_at = 0

    def waiting(self, now: int) -> None:
        if self.spin_ns:
            self._done_at = now
            self.until = now + self.spin_ns if self._hits >= HIT_MIN else 0
