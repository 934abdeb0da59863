"""Skipping the SUBMIT of a request that a spinning worker already took from its slot header (PROTOCOL 4.2).

A caller blocked in ``infer()`` waits a few microseconds after it publishes its request: a worker that is
spinning takes the request from the hint and clears the hint word, and then the SUBMIT, with its trip
through both ZeroMQ IO threads and the worker's receive, is not needed. The wait is tried only while the
caller's requests follow each other faster than a worker spins (``spin_us``), and it pauses for a while
after waits that came to nothing (a worker that does not spin, a busy machine).
"""

from __future__ import annotations

import os
import time

from shmbroker.broker.common.ring import Segment

# a spinning worker takes a hint within about 10 us: the rest is room for a preempted one
# (bench/RESULTS.md#python-cost-per-request)
HINT_WAIT_NS = 50_000
MISSES_BEFORE_PAUSE = 2
PAUSE_REQUESTS = 256


class HintWait:
    """Advisory counters only: callers on several threads may race on them harmlessly."""

    def __init__(self, segment: Segment, spin_ns: int) -> None:
        self._segment = segment
        self._spin_ns = spin_ns
        self._last_done_ns = 0
        self._misses = 0
        self._pause = 0

    def taken(self, slot: int) -> bool:
        """Wait up to HINT_WAIT_NS for a worker to take the request just published in ``slot`` from its hint."""
        if self._pause:
            self._pause -= 1
            return False
        clock = time.perf_counter_ns
        now = clock()
        if now - self._last_done_ns > self._spin_ns:
            return False  # the worker stops spinning after this long without a request
        end = now + HINT_WAIT_NS
        word = self._segment.hint_word
        while word(slot):
            if clock() >= end:
                self._misses += 1
                if self._misses >= MISSES_BEFORE_PAUSE:
                    self._misses = 0
                    self._pause = PAUSE_REQUESTS
                return False
            os.sched_yield()  # on two cores the worker may need this one
        self._misses = 0
        return True

    def done(self) -> None:
        """A blocking caller got its answer."""
        self._last_done_ns = time.perf_counter_ns()
