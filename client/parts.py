"""A request of more rows than a slot holds (``Client.infer``, ``submit`` and ``call``), sent as parts.

Each part is rows that fit one slot (``Client._spans``: at most the session's ``max_items`` rows of tensors, or
images whose bytes fit a slot's input region). The request takes a free slot as any request
does (waiting for one if none is free), and at once every other free slot it has parts for; each slot, once its
part is answered, carries the next part, so the request never waits for a slot again and no other caller can
take a slot from under it. The worker batches the parts in flight together as it batches any requests. The
request completes once its last slot is free: with every part's outputs in place, or with the first error (no
part is sent after one). The wire protocol does not know of parts: each is an ordinary request.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence

import numpy as np

from shmbroker.client.errors import RequestError, RequestTimeout, ShmBrokerError

log = logging.getLogger(__name__)

Answered = Callable[[Sequence[np.ndarray] | ShmBrokerError], None]  # a part's output views in its slot, or its error
# send(slot, first row, end row, timeout, answered): fill the slot with those rows and send them; raises if not sent
Send = Callable[[int, int, int, float, Answered], None]


class Parts:
    """Invariant: the request holds ``held`` slots, each writing or carrying one part; ``finish`` runs once, when
    the last of them is given back. ``_next``, ``_held`` and ``_error`` change under ``_lock``: the caller sends
    the first parts while the receiving thread may already send the next ones."""

    def __init__(self, spans: Sequence[tuple[int, int]], outs: list[np.ndarray], deadline: float, budget: float,
                 send: Send, release: Callable[[int], None],
                 finish: Callable[[list[np.ndarray] | None, ShmBrokerError | None], None]) -> None:
        """``spans``: each part's (first, end) rows, in order; ``outs``: an array per output of every row, which
        the parts' outputs fill; ``deadline`` (monotonic) bounds the whole request, ``budget`` s after it began;
        ``release`` gives a slot back."""
        self.outs = outs
        self._spans = spans
        self._deadline = deadline
        self._budget = budget
        self._send = send
        self._release = release
        self._finish = finish
        self._lock = threading.Lock()
        self._next = 0  # the next part to send
        self._held = 0
        self._error: ShmBrokerError | None = None

    def start(self, slots: list[int]) -> None:
        """Send the first part in ``slots[0]`` and one more in each other slot. If the first cannot be sent, every
        slot is given back and its error raised, as a request's would be, and ``finish`` never runs."""
        self._held = len(slots)
        span = self._take()
        if span is None:  # cannot happen: a request goes as parts only when it has more than one
            raise RequestError("a request split into parts has no parts")
        try:
            self._send_part(slots[0], span)
        except BaseException:
            for slot in slots:
                self._release(slot)
            raise
        for slot in slots[1:]:
            self._drive(slot)

    def _take(self) -> tuple[int, int] | None:
        """The rows of the next part to send, or None: all sent, or one failed."""
        with self._lock:
            if self._error is not None or self._next >= len(self._spans):
                return None
            self._next += 1
            return self._spans[self._next - 1]

    def _send_part(self, slot: int, span: tuple[int, int]) -> None:
        left = self._deadline - time.monotonic()
        if left <= 0:
            raise RequestTimeout(f"the request's parts were not all answered within its timeout ({self._budget:g} s)")
        first, end = span
        self._send(slot, first, end, left, lambda r: self._answered(slot, span, r))

    def _drive(self, slot: int) -> None:
        """Send the next part in ``slot``; with none left to send (or none to be sent after an error), give the
        slot back."""
        while True:
            span = self._take()
            if span is None:
                self._give_back(slot)
                return
            try:
                self._send_part(slot, span)
                return
            except ShmBrokerError as exc:
                self._fail(exc)
            except Exception as exc:  # on the receiving thread: the request must still end, and the slot go back
                log.exception("a part of a request could not be sent")
                self._fail(RequestError(f"a part of the request could not be sent: {exc!r}"))

    def _answered(self, slot: int, span: tuple[int, int], r: Sequence[np.ndarray] | ShmBrokerError) -> None:
        """A part's answer (the receive role's holder): its outputs copied into place, then the slot carries the
        next part."""
        if isinstance(r, ShmBrokerError):
            self._fail(r)
        else:
            first, end = span
            for out, view in zip(self.outs, r, strict=True):
                out[first:end] = view
        self._drive(slot)

    def _fail(self, error: ShmBrokerError) -> None:
        with self._lock:
            if self._error is None:
                self._error = error

    def _give_back(self, slot: int) -> None:
        self._release(slot)
        with self._lock:
            self._held -= 1
            last = self._held == 0
        if last:
            error = self._error
            self._finish(None if error is not None else self.outs, error)
