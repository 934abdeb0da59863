"""Mixed into Client: waiting for a model's worker (``wait_ready``) and ending the session (``close``, the
context manager). Nothing here runs per request."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from typing import Any, Self

import zmq

from shmbroker.broker.common import protocol as P
from shmbroker.broker.common.ring import Segment
from shmbroker.client.errors import ClientClosed, ShmBrokerError, WorkerDied
from shmbroker.client.lead import ReceiveRole
from shmbroker.client.session import Link, SlotViews

CLOSE_WAIT_S = 5.0  # how long close() (and leaving the with block) lets requests in flight finish


class Lifecycle:
    """Mixed into Client: the session's end, and waiting for a worker after a restart."""

    session_id: int
    segment: Segment
    _ctx: zmq.Context[zmq.Socket[bytes]]
    _ctl: zmq.Socket[bytes]
    _stop: threading.Event
    _slot_cond: threading.Condition
    _role: ReceiveRole
    _views: dict[int, list[SlotViews | None]]
    _finalizer: Callable[[], object]  # weakref.finalize of Client._shutdown
    _snapshot_links: Callable[[], tuple[Link, ...]]  # methods of Client and Receiving
    _fail_all: Callable[[ShmBrokerError], None]
    _wake: Callable[[], None]
    _io: threading.Thread
    _pending: dict[int, Any]
    _open: bool  # False once close() began: requests are refused
    _drained: threading.Event | None  # set by the IO thread once nothing is in flight, while close() waits

    def wait_ready(self, model: str, timeout: float = 10.0) -> None:
        """Block until a worker that serves ``model`` is linked (after a restart, say)."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if any(link.up and model in link.models for link in self._snapshot_links()):
                return
            with self._slot_cond:
                self._slot_cond.wait(0.05)
        raise WorkerDied(f"no live worker serves model {model!r} after {timeout} s")

    def close(self, timeout: float = CLOSE_WAIT_S) -> None:
        """Refuse new requests (ClientClosed), wait up to ``timeout`` s for those in flight to be answered, fail
        the rest with ClientClosed; then say BYE, stop the IO thread, unmap the ring. Called from a callback
        (the client's own IO thread, which answers requests), it does not wait."""
        if self._stop.is_set():
            return
        self._open = False
        if self._pending and timeout > 0 and threading.current_thread() is not self._io:
            self._drained = threading.Event()
            self._wake()  # the IO thread looks at once whether anything is still in flight
            self._drained.wait(timeout)
        self._finalizer()
        with self._slot_cond:
            self._slot_cond.notify_all()  # callers waiting for a slot see the client closed
        with contextlib.suppress(zmq.ZMQError):
            self._ctl.send_multipart(P.encode(P.Bye(self.session_id)))
        with self._role.exclusive():
            self._fail_all(ClientClosed(f"the client was closed before the answer came (close waited up to "
                                        f"{timeout} s)"))
            for link in self._snapshot_links():
                link.close()
        self._ctx.destroy(linger=200)
        self._views.clear()  # the cached views export the mapping, which close() then unmaps at once
        self.segment.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
