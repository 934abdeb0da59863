"""What one HTTP front-end process allows its clients: time to send headers and bodies, connections, body memory.

A connection has ``header_timeout_s`` to deliver a request's headers, counted from its opening or from its first
byte after the previous response; past it it is answered 408 and closed. A process holds at most
``max_connections``: one more first displaces the oldest connection that no request is being answered on (an
idle keep-alive one, closed without a word; else one still sending its headers, answered 503), and is itself
answered 503 and closed when a request is being answered on every one. A request body must arrive whole within
``body_timeout_s`` of its headers (else 408), and the bodies held at once fit in ``body_memory`` bytes: a request
whose body does not fit is answered 503 at once, its body unread.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import http
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import cast

import msgspec
from aiohttp import web

from shmbroker.broker.common.ratelog import RateLimitedLog
from shmbroker.frontend.kserve import HttpError
from shmbroker.frontend.settings import Settings

log = logging.getLogger(__name__)
MIB = 1 << 20
# How long a connection answered here (408, 503) is still read, and what it sends dropped, before it is closed:
# closing a socket with unread bytes in it sends a reset, which can destroy the answer before the client reads it.
LINGER_S = 1.0
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def raw_response(status: int, message: str) -> bytes:
    """A whole HTTP/1.1 response with the protocol's error JSON that closes the connection, for the moments when
    aiohttp is not answering a request on it (no request is being handled)."""
    body = msgspec.json.encode({"error": message})
    head = (f"HTTP/1.1 {status} {http.HTTPStatus(status).phrase}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n")
    return head.encode() + body


class State(enum.Enum):
    WAITING = "waiting"  # for a request's headers: the header deadline runs
    BUSY = "busy"  # a request is being answered (its body read, the inference, the response written)
    IDLE = "idle"  # keep-alive between requests (its first byte starts WAITING): aiohttp's keepalive_timeout bounds it
    DRAINING = "draining"  # answered with its body unread: aiohttp discards the rest, then closes it


class Connection(asyncio.Protocol):
    """One client connection: aiohttp's protocol for it behind a deadline on its headers."""

    def __init__(self, guard: ConnectionGuard, inner: web.RequestHandler) -> None:
        self.guard = guard
        self.inner = inner
        self.transport: asyncio.Transport | None = None
        self.state = State.WAITING
        self.admitted = False
        self.lingering = False  # answered here and about to close: what comes is dropped
        self._deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's are not asyncio.Transport's subclasses
        self.admitted = self.guard.admit(self)
        if self.admitted:
            self._arm()
            self.inner.connection_made(self.transport)

    def data_received(self, data: bytes) -> None:
        if self.lingering or not self.admitted:
            return
        if self.state is State.IDLE:
            self.state = State.WAITING
            self._arm()
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
        """Close, first answering ``status`` with ``message`` when given (then the close comes LINGER_S later, or
        at the client's end, whichever is first); the guard forgets it at once."""
        self._disarm()
        self.guard.forget(self)
        t = self.transport
        if t is None or t.is_closing() or self.lingering:
            return
        if not status:
            t.close()
            return
        self.lingering = True
        if self.admitted:
            # aiohttp lets go of it now, without its transport, which stays open for the answer: a request it may
            # have just parsed is never started, so never answered a second time
            self.admitted = False
            self.inner.transport = None
            self.inner.connection_lost(None)
        t.write(raw_response(status, message))
        if t.can_write_eof():
            t.write_eof()  # the client reads the answer, then the end
        asyncio.get_running_loop().call_later(LINGER_S, t.close)

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
        if self.state is State.WAITING:
            self.guard.slow.warning("a connection sent no complete request headers within %g s "
                                    "(--header-timeout): answered 408 and closed", self.guard.settings.header_timeout_s)
            self.close(408, f"no complete request headers within {self.guard.settings.header_timeout_s:g} s "
                            f"(shmbroker http --header-timeout)")


class ConnectionGuard:
    """The connections of one process, each a Connection around aiohttp's protocol for it; the ``track``
    middleware tells each when a request on it starts and ends."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.open: dict[asyncio.BaseProtocol, Connection] = {}  # by aiohttp's protocol, oldest first
        # a flood of slow or surplus connections would flood the log
        self.slow = RateLimitedLog(log)
        self.full = RateLimitedLog(log)

    def factory(self, inner: Callable[[], web.RequestHandler]) -> Callable[[], Connection]:
        """The protocol factory for the listening socket: each connection guarded, ``inner``'s protocol inside."""
        return lambda: Connection(self, inner())

    def admit(self, conn: Connection) -> bool:
        """Take ``conn`` in, displacing the oldest connection no request is answered on when all
        ``max_connections`` are taken; else answer it 503 and close it (False)."""
        if len(self.open) >= self.settings.max_connections and not self._displace():
            self.full.warning("all %d connections of this process are answering requests (--max-connections): "
                              "a new one was answered 503", self.settings.max_connections)
            conn.close(503, f"this front-end process answers requests on all its "
                            f"{self.settings.max_connections} connections (shmbroker http --max-connections): "
                            f"try again later")
            return False
        self.open[conn.inner] = conn
        return True

    def _displace(self) -> bool:
        """Close the oldest idle connection, else answer 503 to the oldest one still sending headers."""
        for wanted in (State.IDLE, State.DRAINING, State.WAITING):
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

    def forget(self, conn: Connection) -> None:
        if self.open.get(conn.inner) is conn:
            del self.open[conn.inner]

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


class BodyBudget:
    """The bytes of request bodies a process may hold at once."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0

    def take(self, size: int) -> bool:
        if self.used + size > self.limit:
            return False
        self.used += size
        return True

    def give(self, size: int) -> None:
        self.used -= size


class _Claim:
    """The part of a BodyBudget that one request holds; grows as its body arrives."""

    def __init__(self, budget: BodyBudget) -> None:
        self.budget = budget
        self.size = 0

    def grow_to(self, size: int) -> None:
        """Hold ``size`` bytes in all; HttpError 503 when the budget has not that much left."""
        if size <= self.size:
            return
        if not self.budget.take(size - self.size):
            raise HttpError(503, f"overloaded: this front-end process holds {self.budget.used / MIB:.1f} MiB of "
                                 f"request bodies and this one has {size / MIB:.1f} MiB, past its limit "
                                 f"(shmbroker http --body-memory-mib {self.budget.limit // MIB}): try again later")
        self.size = size

    def release(self) -> None:
        self.budget.give(self.size)
        self.size = 0


@contextlib.asynccontextmanager
async def request_body(request: web.Request, budget: BodyBudget, settings: Settings) -> AsyncIterator[bytes]:
    """The whole body, held against ``budget`` until the block ends. HttpError: 413 past --max-body-mib, 503
    when the budget cannot hold it (a declared length is claimed before anything is read), 408 when it is not
    all there ``settings.body_timeout_s`` after the headers."""
    limit = settings.max_body_mib * MIB
    declared = request.content_length
    if declared is not None and declared > limit:
        raise HttpError(413, f"request body: {declared} bytes, past the limit of {settings.max_body_mib} MiB "
                             f"(shmbroker http --max-body-mib)")
    claim = _Claim(budget)
    try:
        claim.grow_to(declared or 0)
        yield await _read(request, claim, limit, settings)
    finally:
        claim.release()


async def _read(request: web.Request, claim: _Claim, limit: int, settings: Settings) -> bytes:
    buf = bytearray()
    try:
        async with asyncio.timeout(settings.body_timeout_s):
            while chunk := await request.content.readany():
                if len(buf) + len(chunk) > limit:
                    raise HttpError(413, f"request body: past the limit of {settings.max_body_mib} MiB "
                                         f"(shmbroker http --max-body-mib)")
                claim.grow_to(len(buf) + len(chunk))
                buf += chunk
    except TimeoutError:
        raise HttpError(408, f"request body: {len(buf)} bytes came within {settings.body_timeout_s:g} s of the "
                             f"headers, not all of it (shmbroker http --body-timeout)") from None
    except ConnectionError:  # the client left mid-body: its answer goes nowhere, and it is no fault to log
        raise HttpError(400, f"request body: the connection closed after {len(buf)} bytes") from None
    return bytes(buf)
