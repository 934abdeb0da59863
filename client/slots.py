"""The ring's slots as the client tracks them: which are free, their generations, the requests in flight.

Slots are the client's flow control: at most one request per slot is in flight, and a caller that finds none
free waits for one. ``list.pop`` and ``list.append`` are atomic under the GIL, so the common case takes no lock.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from shmbroker.broker.common import protocol as P
from shmbroker.client.errors import ClientClosed, Overloaded, RequestTimeout, ShmBrokerError
from shmbroker.client.session import ModelPlan


@dataclass(slots=True)
class Pending:
    """A request in flight, keyed by its slot in ``Slots.pending``."""

    request_id: int
    generation: int
    plan: ModelPlan
    worker_id: int
    on_done: Callable[[P.Result | ShmBrokerError], None]  # frees the slot, unless a zero-copy Request holds it
    layout: P.CanonicalRows


SLOTS_SETTING = "Client(slots=...)"


def no_free_slot(timeout: float | None, n: int, setting: str) -> str:
    """The message of a wait for a slot that timed out."""
    return f"no free slot within {timeout} s (all {n} slots in flight: raise {setting}, or the timeout)"


class Slots:
    """Invariant: a slot is free, or held by a caller writing it (or a zero-copy Request), or in ``pending``.

    ``pending`` changes only on the thread that holds the receive role (completions) and on senders (a new
    request in a slot they hold).
    """

    def __init__(self, n: int) -> None:
        self.n = n
        self.pending: dict[int, Pending] = {}
        self._free: list[int] = list(range(n - 1, -1, -1))
        self.gens = [0] * n  # per slot: the generation of its latest request
        self.cond = threading.Condition()  # slot freed, links changed, session back: waiters look again
        self._waiters = 0
        self.open = True  # False once close() began: no slot is handed out
        self.setting = SLOTS_SETTING  # how the user raises the slots, named when none is free

    def acquire(self, timeout: float | None, io_thread: Callable[[], bool]) -> int:
        """A free slot, waiting up to ``timeout`` s for one; a caller for which ``io_thread()`` is True (a
        completion callback) never waits. Raises ClientClosed, Overloaded (a callback found none free) or
        RequestTimeout."""
        if self.open:
            try:
                return self._free.pop()
            except IndexError:
                pass
        return self._wait(timeout, io_thread())

    def take_free(self, n: int) -> list[int]:
        """Up to ``n`` free slots, taken without waiting (none once close() began)."""
        got: list[int] = []
        while len(got) < n and self.open:
            try:
                got.append(self._free.pop())
            except IndexError:
                break
        return got

    def _wait(self, timeout: float | None, io_thread: bool) -> int:
        end = None if timeout is None else time.monotonic() + timeout
        while True:
            if not self.open:
                raise ClientClosed("the client is closed")
            try:
                return self._free.pop()
            except IndexError:
                pass
            if io_thread:
                raise Overloaded(f"all {self.n} slots are in flight, and a completion callback cannot wait for "
                                 f"one (raise {self.setting})")
            left = None if end is None else end - time.monotonic()
            if left is not None and left <= 0:
                raise RequestTimeout(no_free_slot(timeout, self.n, self.setting))
            with self.cond:
                self._waiters += 1
                try:
                    if not self._free:
                        self.cond.wait(left)
                finally:
                    self._waiters -= 1

    def release(self, slot: int) -> None:
        self._free.append(slot)
        if self._waiters:  # only a caller that found no free slot sleeps on the condition
            with self.cond:
                self.cond.notify()

    def wake_all(self) -> None:
        """Every waiter looks again (the client closed, a link came up, the session came back)."""
        with self.cond:
            self.cond.notify_all()

