"""How long a batch that is not full may keep growing while the device is busy with batches launched before it.

A batch launched while the device still computes others only waits on its stream, holding a stream slot, with
the rows it had. Launched just in time instead (when the device's launched work is about to end, less the time
to issue and copy in a max batch), it starts computing at the same moment with the rows that came meanwhile:
bigger batches at the same latency (bench/RESULTS.md#filling-batches-while-the-device-is-busy).
"""

from __future__ import annotations

import threading
from collections.abc import Callable

# besides the measured issue and H2D time of a max batch: the driver's and the threads' jitter
HOLD_MARGIN_S = 1e-3
LEAD_SMOOTHING = 0.2  # weight of a new batch's sample in the moving average of the lead per row


class LaunchPlan:
    """Thread-safe: ``launched`` from whichever thread launches, ``ended`` from the completion thread.

    Both return the ``hold`` time for the batcher (``Batcher.hold``): the device's expected end of the work
    launched so far, less the lead a max batch needs (issue on the host, then H2D) and a margin; 0 while no
    batch has ended yet (no lead measured) or none runs.
    """

    def __init__(self, max_batch: int, expected_s: Callable[[int], float | None],
                 margin_s: float = HOLD_MARGIN_S, lead_rows: int = 0) -> None:
        """``expected_s(rows)``: the device time of a batch of ``rows`` rows (None until warm-up measured it);
        ``lead_rows``: the rows whose issue and H2D the lead covers (0: ``max_batch``; fewer where a batch's
        rows are copied as they come, so only its last ones are left at its launch)."""
        self.max_batch = max_batch
        self.lead_rows = lead_rows or max_batch
        self.expected_s = expected_s
        self.margin_s = margin_s
        self._lock = threading.Lock()
        self._busy_until = 0.0  # time.monotonic() at which the device is expected to end the launched batches
        self._pending_s = 0.0  # the expected device time of the batches launched and not yet ended
        self.lead_per_row_s: float | None = None  # issue plus H2D, per row, a moving average

    def prime(self, lead_per_row_s: float) -> None:
        """The lead per row measured at warm-up, until batches measure their own."""
        with self._lock:
            if self.lead_per_row_s is None:
                self.lead_per_row_s = lead_per_row_s

    def launched(self, now: float, rows: int) -> tuple[float, float]:
        """A batch of ``rows`` rows was issued (``now``: when its issue ended). Returns (its expected device
        time, the hold time)."""
        expected = self.expected_s(rows) or 0.0
        with self._lock:
            self._busy_until = max(now, self._busy_until) + expected
            self._pending_s += expected
            return expected, self._hold()

    def ended(self, now: float, expected: float, lead_s: float | None, rows: int, running: int) -> float:
        """A launched batch ended on the device (seen at ``now``); ``expected`` is what ``launched`` returned for
        it, ``lead_s`` its issue plus H2D time (None: a failed batch, no sample), ``running`` how many launched
        batches have not ended. Returns the hold time."""
        with self._lock:
            if lead_s is not None:
                sample = lead_s / max(1, rows)
                prev = self.lead_per_row_s
                self.lead_per_row_s = sample if prev is None else prev + (sample - prev) * LEAD_SMOOTHING
            if running <= 0:
                self._pending_s = 0.0
                self._busy_until = 0.0
                return 0.0
            self._pending_s = max(0.0, self._pending_s - expected)
            # batches on other streams may have computed part of theirs already: the earlier estimate holds
            self._busy_until = min(self._busy_until, now + self._pending_s)
            return self._hold()

    def _hold(self) -> float:
        if self.lead_per_row_s is None or self._busy_until == 0.0:
            return 0.0
        lead = self.lead_per_row_s * self.lead_rows
        return self._busy_until - lead - self.margin_s
