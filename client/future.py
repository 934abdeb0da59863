"""The Future that ``Client.submit`` returns: waiting on it receives answers on the waiting thread."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures._base import CANCELLED, CANCELLED_AND_NOTIFIED, FINISHED
from typing import Any, TypeVar

T = TypeVar("T")
# (the Future, the caller's timeout) -> the timeout left: sends queued SUBMITs, then leads (client.lead)
Await = Callable[["Future[Any]", "float | None"], "float | None"]
_DONE = frozenset((CANCELLED, CANCELLED_AND_NOTIFIED, FINISHED))


class ClientFuture(Future[T]):
    """A ``concurrent.futures.Future`` whose ``result()`` and ``exception()``, before they block, send the
    SUBMITs that ``submit()`` queued and receive answers on the calling thread, as ``infer()`` does: a
    waiting thread is not woken by another one (client.lead). ``add_done_callback`` on a pending Future hands
    receiving to the IO thread at once (``receiver``). Everything else is the standard Future's.
    """

    def __init__(self, wait: Await, receiver: Callable[[], None]) -> None:
        super().__init__()
        self._wait = wait
        self._receiver = receiver

    def add_done_callback(self, fn: Callable[[Future[T]], object]) -> None:
        """As ``Future.add_done_callback``; the callback runs on the thread that receives the answer."""
        super().add_done_callback(fn)
        if self._state != FINISHED:
            self._receiver()

    def done(self) -> bool:
        """As ``Future.done``, read without the lock: the state only moves forward, so a stale answer costs one
        more look (a leader looks after every message it receives)."""
        return self._state in _DONE

    def result(self, timeout: float | None = None) -> T:
        """As ``Future.result``; raises DEADLOCK (ShmBrokerError) from a completion callback of its client."""
        if self._state != FINISHED:  # read without the lock: a stale answer only costs the call to _wait
            timeout = self._wait(self, timeout)
        if self._state == FINISHED and self._exception is None:
            return self._result  # type: ignore[return-value]  # set_result stores it before the state
        return super().result(timeout)

    def exception(self, timeout: float | None = None) -> BaseException | None:
        """As ``Future.exception``; raises DEADLOCK (ShmBrokerError) from a completion callback of its client."""
        if self._state != FINISHED:
            timeout = self._wait(self, timeout)
        return super().exception(timeout)
