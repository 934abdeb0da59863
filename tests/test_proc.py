"""broker.common.proc: the stop-signal handler sets its Event once and never waits on it, however many signals
come (a burst re-enters the handler while an earlier run of it is inside ``Event.set``). A real worker process
that gets such a burst exits."""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterator

import pytest

from shmbroker.broker.common import proc
from tests.conftest import RunningBroker, process_gone


class _ReentryProbe(threading.Event):
    """An Event whose ``set()`` raises SIGTERM at this process while it holds its own lock, as the next signal of
    a burst can; a ``set()`` that comes back in while the lock is held is counted instead of waiting forever."""

    def __init__(self) -> None:
        super().__init__()
        self.lock = threading.Lock()
        self.raised = False
        self.reentered = 0

    def set(self) -> None:
        if not self.lock.acquire(blocking=False):
            self.reentered += 1
            return
        try:
            if not self.raised:
                self.raised = True
                signal.raise_signal(signal.SIGTERM)  # its handler runs on this thread before the lock is released
            super().set()
        finally:
            self.lock.release()


@pytest.fixture
def restored_handlers() -> Iterator[None]:
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)


def test_a_signal_inside_the_handlers_set_does_not_set_again(restored_handlers: None) -> None:
    stop = _ReentryProbe()
    proc.stop_on_signals(stop)
    signal.raise_signal(signal.SIGTERM)
    assert stop.raised, "the handler never reached set()"
    assert stop.reentered == 0, "the handler re-entered set() while the Event's lock was held: it would hang"
    assert stop.is_set()


def test_a_worker_exits_after_a_burst_of_sigterms(process_broker: RunningBroker) -> None:
    (worker,) = process_broker.worker_pids()
    for _ in range(200):
        try:
            os.kill(worker, signal.SIGTERM)
        except ProcessLookupError:
            break
    assert process_gone(worker, 15), "a worker that got a burst of SIGTERMs did not exit"
