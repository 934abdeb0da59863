"""How long a batch that is not full may keep growing while the device is busy with batches launched before it.

A batch launched while the device still computes others only waits on its stream, holding a stream slot, with
the rows it had. Launched just in time instead (when the device's launched work is about to end, less the time
to issue and copy in the rows it has), it starts computing at the same moment with the rows that came
meanwhile: bigger batches at the same latency (bench/RESULTS.md#filling-batches-while-the-device-is-busy). The
lead is per row: a slot freed just after its answers left would otherwise take a small batch before those
clients' next requests came, and the next slot's whole batch then could not copy in behind that small one's
compute (bench/RESULTS.md#the-host-paths-ceiling).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

# besides the measured issue and H2D time of a max batch: the driver's and the threads' jitter
HOLD_MARGIN_S = 1e-3
LEAD_SMOOTHING = 0.2  # weight of a new batch's sample in the moving average of the lead per row


@dataclass(frozen=True, slots=True)
class Hold:
    """Until when a batch of ``rows`` rows that is not full may keep growing (``Batcher.hold``):
    ``until - per_row_s * rows``, time.monotonic() seconds; ``NONE`` holds nothing."""

    until: float
    per_row_s: float = 0.0

    def for_rows(self, rows: int) -> float:
        return self.until - self.per_row_s * rows


NONE = Hold(0.0)


class LaunchPlan:
    """Thread-safe: ``launched`` from whichever thread launches, ``ended`` from the completion thread.

    Both return the ``Hold`` for the batcher: the device's expected end of the work launched so far, less a
    margin and the lead that the batch's rows need (issue on the host, then H2D; with ``lead_rows``, a fixed
    number of rows); ``NONE`` while no lead is known yet or no batch runs.
    """

    def __init__(self, max_batch: int, expected_s: Callable[[int], float | None],
                 margin_s: float = HOLD_MARGIN_S, lead_rows: int = 0) -> None:
        """``expected_s(rows)``: the device time of a batch of ``rows`` rows (None until warm-up measured it);
        ``lead_rows``: where a batch's rows are copied as they come, the rows left to copy at its launch (0:
        every row of the batch, the lead then grows with its rows)."""
        self.max_batch = max_batch
        self.lead_rows = lead_rows
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

    def launched(self, now: float, rows: int) -> tuple[float, Hold]:
        """A batch of ``rows`` rows was issued (``now``: when its issue ended). Returns its expected device
        time and the hold. Its compute starts once its rows are on the device, and not before the batches
        launched before it end: on a device that ran out of work, an end counted from the issue alone comes
        a copy-in too soon, and the next batch then leaves with fewer rows than would keep the device busy."""
        expected = self.expected_s(rows) or 0.0
        with self._lock:
            copied = now + (self.lead_per_row_s or 0.0) * min(rows, self.lead_rows or rows)
            self._busy_until = max(copied, self._busy_until) + expected
            self._pending_s += expected
            return expected, self._hold()

    def ended(self, now: float, expected: float, lead_s: float | None, rows: int, running: int) -> Hold:
        """A launched batch ended on the device (seen at ``now``); ``expected`` is what ``launched`` returned for
        it, ``lead_s`` its issue plus H2D time (None: a failed batch, no sample), ``running`` how many launched
        batches have not ended. Returns the hold."""
        with self._lock:
            if lead_s is not None:
                sample = lead_s / max(1, rows)
                prev = self.lead_per_row_s
                self.lead_per_row_s = sample if prev is None else prev + (sample - prev) * LEAD_SMOOTHING
            if running <= 0:
                self._pending_s = 0.0
                self._busy_until = 0.0
                return NONE
            self._pending_s = max(0.0, self._pending_s - expected)
            # batches on other streams may have computed part of theirs already: the earlier estimate holds
            self._busy_until = min(self._busy_until, now + self._pending_s)
            return self._hold()

    def _hold(self) -> Hold:
        per_row = self.lead_per_row_s
        if per_row is None or self._busy_until == 0.0:
            return NONE
        if self.lead_rows:
            return Hold(self._busy_until - per_row * self.lead_rows - self.margin_s)
        return Hold(self._busy_until - self.margin_s, per_row)
