"""The client connections of one HTTP front-end process: how they are accepted, timed and displaced.

The process accepts from its listening socket itself, at most ``accept_batch(N)`` connections a loop turn, N being
``max_connections``: a burst of new connections then cannot displace one before its first bytes are read. It holds
at most N client descriptors: the connections it serves, and those it answered itself (408, 503) whose close waits
LINGER_S so that the answer is read. A new connection past N first closes the oldest answered one at once; else it
displaces the oldest connection that no request is being answered on (an idle keep-alive one, closed without a
word; else the oldest still sending its headers, answered 503 and closed at once); else it is itself answered 503
and closed. A connection whose request headers have all arrived is being answered. A connection has
``header_timeout_s`` to deliver a request's headers, counted from its opening or from its first byte after the
previous response; past it it is answered 408 and closed.

So the descriptors held for clients never pass N, beside at most ``accept_batch(N)`` closed in the current loop turn
(uvloop releases them at the next): a flood of connections never runs the process out of descriptors, whose limit
``shmbroker http`` sets to N + OWN_FDS (frontend/settings.py).
"""

from __future__ import annotations

import asyncio
import enum
import errno
import http
import logging
import socket
from collections.abc import Awaitable, Callable
from typing import cast

import msgspec
from aiohttp import web

from shmbroker.broker.common.ratelog import RateLimitedLog
from shmbroker.frontend.settings import Settings

log = logging.getLogger(__name__)
# How long a connection answered here (408, 503) is still read, and what it sends dropped, before it is closed:
# closing a socket with unread bytes in it sends a reset, which can destroy the answer before the client reads it.
LINGER_S = 1.0
ACCEPT_BATCH = 16  # connections accepted in one loop turn at most (fewer under a small --max-connections)
ACCEPT_PAUSE_S = 0.1  # accepting waits this long when the process or the system has no descriptor left
HEADERS_END = b"\r\n\r\n"
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def accept_batch(max_connections: int) -> int:
    """Connections accepted per loop turn: a new one is read within two turns, so a burst displaces none that
    has sent its request promptly while the batch stays under a quarter of ``max_connections``."""
    return max(1, min(ACCEPT_BATCH, max_connections // 4))


def raw_response(status: int, message: str) -> bytes:
    """A whole HTTP/1.1 response with the protocol's error JSON that closes the connection, for the moments when
    aiohttp is not answering a request on it (no request is being handled)."""
    body = msgspec.json.encode({"error": message})
    head = (f"HTTP/1.1 {status} {http.HTTPStatus(status).phrase}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n")
    return head.encode() + body


class State(enum.Enum):
    OPENING = "opening"  # accepted, its transport not made yet (the next loop turn)
    WAITING = "waiting"  # for a request's headers: the header deadline runs
    READY = "ready"  # its request's headers all arrived: aiohttp starts the request at the next loop turn
    BUSY = "busy"  # a request is being answered (its body read, the inference, the response written)
    IDLE = "idle"  # keep-alive between requests (its first byte starts WAITING): aiohttp's keepalive_timeout bounds it
    DRAINING = "draining"  # answered with its body unread: aiohttp discards the rest, then closes it


DISPLACEABLE = (State.IDLE, State.DRAINING, State.WAITING)  # in this order, the oldest of each first


class Connection(asyncio.Protocol):
    """One client connection: aiohttp's protocol for it behind a deadline on its headers."""

    def __init__(self, guard: ConnectionGuard, inner: web.RequestHandler, sock: socket.socket) -> None:
        self.guard = guard
        self.inner = inner
        self.sock = sock  # the accepted socket; the transport closes it
        self.transport: asyncio.Transport | None = None
        self.state = State.OPENING
        self.admitted = False  # aiohttp's protocol has it
        self.lingering = False  # answered here and about to close: what comes is dropped
        self._tail = b""  # the last bytes of a request's headers so far, for an end split across reads
        self._deadline: asyncio.TimerHandle | None = None
        self._linger: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's are not asyncio.Transport's subclasses
        self.state = State.WAITING
        self.admitted = True
        self._arm()
        self.inner.connection_made(self.transport)

    def data_received(self, data: bytes) -> None:
        if self.lingering or not self.admitted:
            return
        if self.state is State.IDLE:
            self.state = State.WAITING
            self._tail = b""
            self._arm()
        if self.state is State.WAITING:
            seen = self._tail + data[:len(HEADERS_END) - 1]
            if HEADERS_END in seen or HEADERS_END in data:
                self.state = State.READY
            self._tail = (self._tail + data)[-(len(HEADERS_END) - 1):]
        self.inner.data_received(data)

    def eof_received(self) -> None:
        if self.admitted:
            self.inner.eof_received()  # returns None, as this does: the transport then closes itself

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        self.guard.forget(self)
        if self.admitted:
            self.inner.connection_lost(exc)

    def pause_writing(self) -> None:
        if self.admitted:
            self.inner.pause_writing()

    def resume_writing(self) -> None:
        if self.admitted:
            self.inner.resume_writing()

    def request_started(self) -> None:
        self.state = State.BUSY
        self._disarm()

    def request_ended(self, body_read: bool) -> None:
        """The request's task is over: its response written, or the connection gone. Bytes of a next request
        that came with this one's leave it IDLE until more come: bounded by keepalive_timeout, and displaceable."""
        if self.state is State.BUSY:
            self.state = State.IDLE if body_read else State.DRAINING

    def close(self, status: int = 0, message: str = "") -> None:
        """Close at once, or answer ``status`` with ``message`` first: the close then comes LINGER_S later, at
        the client's end, or when the process needs the descriptor, whichever is first."""
        self._disarm()
        self.guard.forget(self)
        t = self.transport
        if t is None or t.is_closing() or self.lingering:
            return
        if not status:
            t.abort()  # nothing is owed to it: its descriptor goes at the next loop turn, whatever it left unsent
            return
        self.lingering = True
        if self.admitted:
            # aiohttp lets go of it now, without its transport, which stays open for the answer: a request it may
            # have just parsed is never started, so never answered a second time
            self.admitted = False
            self.inner.transport = None
            self.inner.connection_lost(None)
        t.write(raw_response(status, message))  # into the socket at once (uvloop writes an empty buffer through)
        t.write_eof()  # the client reads the answer, then the end, even when a reset follows it
        self._linger = asyncio.get_running_loop().call_later(LINGER_S, self.cut)
        self.guard.linger(self)

    def cut(self) -> None:
        """End an answered connection now: its answer is in the socket, or the client is not reading it."""
        self.guard.forget(self)
        if self._linger is not None:
            self._linger.cancel()
            self._linger = None
        if self.transport is not None:
            self.transport.abort()

    def _arm(self) -> None:
        self._disarm()
        loop = asyncio.get_running_loop()
        self._deadline = loop.call_later(self.guard.settings.header_timeout_s, self._expire)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _expire(self) -> None:
        self._deadline = None
        if self.state in (State.WAITING, State.READY):
            self.guard.slow.warning("a connection sent no complete request headers within %g s "
                                    "(--header-timeout): answered 408 and closed", self.guard.settings.header_timeout_s)
            self.close(408, f"no complete request headers within {self.guard.settings.header_timeout_s:g} s "
                            f"(shmbroker http --header-timeout)")


class ConnectionGuard:
    """The connections of one process, each a Connection around aiohttp's protocol for it, accepted by
    ``listen``; the ``track`` middleware tells each when a request on it starts and ends."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.batch = accept_batch(settings.max_connections)
        self.open: dict[asyncio.BaseProtocol, Connection] = {}  # by aiohttp's protocol, oldest first
        self.lingering: dict[Connection, None] = {}  # answered here and closing, oldest first
        self._opening: set[asyncio.Task[object]] = set()
        self._listener: socket.socket | None = None
        self._inner: Callable[[], web.RequestHandler] | None = None
        self._resume: asyncio.TimerHandle | None = None
        # a flood of slow or surplus connections would flood the log
        self.slow = RateLimitedLog(log)
        self.full = RateLimitedLog(log)
        self.exhausted = RateLimitedLog(log)

    @property
    def held(self) -> int:
        """Client descriptors held: the connections served and those answered here, closing."""
        return len(self.open) + len(self.lingering)

    def listen(self, sock: socket.socket, inner: Callable[[], web.RequestHandler]) -> None:
        """Accept from the listening ``sock`` on the running loop: each connection guarded, ``inner``'s protocol
        inside."""
        sock.setblocking(False)
        self._listener = sock
        self._inner = inner
        asyncio.get_running_loop().add_reader(sock.fileno(), self._accept)

    def stop_listening(self) -> None:
        if self._resume is not None:
            self._resume.cancel()
            self._resume = None
        if self._listener is not None:
            asyncio.get_running_loop().remove_reader(self._listener.fileno())
            self._listener = None

    def _accept(self) -> None:
        """Accept up to ``batch`` connections; the rest wait in the backlog for the next loop turn."""
        listener, inner = self._listener, self._inner
        if listener is None or inner is None:
            return
        for _ in range(self.batch):
            try:
                sock, _address = listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                if exc.errno in (errno.ECONNABORTED, errno.EPROTO, errno.EPERM):
                    continue  # this one left (or a firewall refused it) before it was accepted
                self._pause(exc)
                return
            self._take(sock, inner)

    def _pause(self, exc: OSError) -> None:
        """Stop accepting for ACCEPT_PAUSE_S: the connections wait in the backlog instead of being reset."""
        self.exhausted.warning("accepting a connection failed (%s); accepting again in %g s. Past descriptors: "
                               "the open-files limit is below --max-connections + the process's own (see "
                               "`shmbroker http --help`)", exc, ACCEPT_PAUSE_S)
        loop = asyncio.get_running_loop()
        if self._listener is not None and self._resume is None:
            loop.remove_reader(self._listener.fileno())
            self._resume = loop.call_later(ACCEPT_PAUSE_S, self._unpause)

    def _unpause(self) -> None:
        self._resume = None
        if self._listener is not None:
            asyncio.get_running_loop().add_reader(self._listener.fileno(), self._accept)

    def _take(self, sock: socket.socket, inner: Callable[[], web.RequestHandler]) -> None:
        """Serve an accepted connection, making room for it, or answer it 503 and close it when there is none."""
        sock.setblocking(False)
        if self.held >= self.settings.max_connections and not self._make_room():
            self.full.warning("all %d connections of this process are answering requests (--max-connections): "
                              "a new one was answered 503", self.settings.max_connections)
            _refuse(sock, 503, f"this front-end process answers requests on all its {self.settings.max_connections} "
                               f"connections (shmbroker http --max-connections): try again later")
            return
        conn = Connection(self, inner(), sock)
        self.open[conn.inner] = conn
        loop = asyncio.get_running_loop()
        task = loop.create_task(loop.connect_accepted_socket(lambda: conn, sock))
        self._opening.add(task)
        task.add_done_callback(lambda t: self._opened(conn, t))

    def _opened(self, conn: Connection, task: asyncio.Task[object]) -> None:
        """The transport of ``conn`` is made, or failed (the client left at once): then it is forgotten."""
        self._opening.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.debug("a connection ended as it was opened: %r", task.exception())
        if conn.state is State.OPENING:
            self.forget(conn)
            conn.sock.close()  # a no-op once a transport has taken it and closed it

    def _make_room(self) -> bool:
        """Bring the descriptors held under ``max_connections`` for one more: close the oldest answered connection,
        else displace the oldest one that no request is being answered on. False when none can go."""
        while self.held >= self.settings.max_connections:
            if self.lingering:
                next(iter(self.lingering)).cut()
            elif not self._displace():
                return False
        return True

    def _displace(self) -> bool:
        """Close the oldest idle connection, else answer 503 to the oldest one still sending headers."""
        for wanted in DISPLACEABLE:
            victim = next((c for c in self.open.values() if c.state is wanted), None)
            if victim is not None:
                if wanted is State.WAITING:
                    self.full.warning("%d connections (--max-connections): the oldest one still sending its "
                                      "headers was answered 503 for a new one", self.settings.max_connections)
                    victim.close(503, f"this front-end process has {self.settings.max_connections} connections "
                                      f"(shmbroker http --max-connections), and this one had not sent its request "
                                      f"headers yet: try again")
                else:
                    victim.close()
                return True
        return False

    def linger(self, conn: Connection) -> None:
        self.lingering[conn] = None

    def forget(self, conn: Connection) -> None:
        if self.open.get(conn.inner) is conn:
            del self.open[conn.inner]
        self.lingering.pop(conn, None)

    @web.middleware
    async def track(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """Mark the request's connection busy until the request's task (the response written) is over."""
        conn = self.open.get(request.protocol)
        task = asyncio.current_task()
        if conn is not None and task is not None:
            conn.request_started()
            task.add_done_callback(lambda _t: conn.request_ended(request.content.is_eof()))
        response: web.StreamResponse = await handler(request)
        return response


def _refuse(sock: socket.socket, status: int, message: str) -> None:
    """Answer a connection that was never served and close it at once: the answer, then the end, go before the
    close, so the client reads them even if a reset follows for bytes it sent meanwhile."""
    try:
        sock.send(raw_response(status, message))
        sock.shutdown(socket.SHUT_WR)
    except OSError as exc:
        log.debug("a refused connection left before its answer: %s", exc)
    finally:
        sock.close()
