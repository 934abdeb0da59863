"""Mixed into Client: waiting for a model's worker (``wait_ready``) and ending the session (``close``, the
context manager). Nothing here runs per request."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from typing import Self

import zmq

from broker import protocol as P
from broker.ring import Segment
from client.errors import WorkerDied
from client.lead import ReceiveRole
from client.session import Link, SlotViews


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
    _fail_all: Callable[[str], None]

    def wait_ready(self, model: str, timeout: float = 10.0) -> None:
        """Block until a worker that serves ``model`` is linked (after a restart, say)."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if any(link.up and model in link.models for link in self._snapshot_links()):
                return
            with self._slot_cond:
                self._slot_cond.wait(0.05)
        raise WorkerDied(f"no live worker serves model {model!r} after {timeout} s")

    def close(self) -> None:
        """Say BYE, stop the IO thread, unmap the ring. Outstanding requests fail with WorkerDied."""
        if self._stop.is_set():
            return
        self._finalizer()
        with self._slot_cond:
            self._slot_cond.notify_all()  # callers waiting for a slot see the client closed
        with contextlib.suppress(zmq.ZMQError):
            self._ctl.send_multipart(P.encode(P.Bye(self.session_id)))
        with self._role.exclusive():
            self._fail_all("the client was closed")
            for link in self._snapshot_links():
                link.close()
        self._ctx.destroy(linger=200)
        self._views.clear()  # the cached views export the mapping, which close() then unmaps at once
        self.segment.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
