"""What one HTTP front-end process allows request bodies: time, pace and memory (connections: frontend/connections.py).

A body must arrive whole within ``body_timeout_s`` of its headers, and at ``min_body_rate_kib`` KiB/s at least: it
may fall behind that pace by RATE_WINDOW_S seconds' worth, and is never more than RATE_WINDOW_S seconds ahead of it,
so a body that stalls is cut RATE_WINDOW_S after its last bytes (both 408). A body is charged as its bytes arrive,
not by its declared length. The bodies held at once fit in ``body_memory`` bytes, and those of one peer (an IP
address, an IPv6 one's /64, or on a Unix socket the client's uid) in ``peer_body_memory`` bytes: a body whose next
bytes do not fit is answered 503, the rest unread. Its charge goes with it, whatever ends it.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import math
import socket
from collections.abc import AsyncIterator

from aiohttp import web

from shmbroker.broker.common.protocol import UCRED
from shmbroker.frontend.kserve import HttpError
from shmbroker.frontend.settings import RATE_WINDOW_S, Settings

MIB = 1 << 20
KIB = 1 << 10


def peer_of(transport: asyncio.BaseTransport | None) -> str:
    """Whom a connection's bodies are charged to: its IP address (an IPv6 address's /64, as one host may hold all
    of it), or on a Unix socket the client's uid."""
    if transport is None:
        return "a closed connection"
    peer = transport.get_extra_info("peername")
    if isinstance(peer, tuple) and peer:
        ip = ipaddress.ip_address(str(peer[0]).partition("%")[0])
        if isinstance(ip, ipaddress.IPv6Address):
            if ip.ipv4_mapped is not None:
                return str(ip.ipv4_mapped)
            return str(ipaddress.IPv6Network((int(ip) >> 64 << 64, 64)))
        return str(ip)
    sock = transport.get_extra_info("socket")
    if sock is not None and sock.family == socket.AF_UNIX:
        _pid, uid, _gid = UCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, UCRED.size))
        return f"uid {uid}"
    return "an unknown peer"


class BodyBudget:
    """The bytes of request bodies a process holds at once: ``limit`` in all, ``peer_limit`` of one peer's."""

    def __init__(self, limit: int, peer_limit: int) -> None:
        self.limit = limit
        self.peer_limit = peer_limit
        self.used = 0
        self.by_peer: dict[str, int] = {}

    def take(self, peer: str, size: int) -> bool:
        """Hold ``size`` more bytes for ``peer``; False, holding nothing, when past either limit."""
        held = self.by_peer.get(peer, 0)
        if held + size > self.peer_limit or self.used + size > self.limit:
            return False
        self.used += size
        self.by_peer[peer] = held + size
        return True

    def give(self, peer: str, size: int) -> None:
        if not size:  # an empty body took nothing, and its peer may hold nothing
            return
        self.used -= size
        left = self.by_peer.pop(peer) - size
        if left:
            self.by_peer[peer] = left


class _Claim:
    """The part of a BodyBudget that one request holds; grows as its body arrives."""

    def __init__(self, budget: BodyBudget, peer: str) -> None:
        self.budget = budget
        self.peer = peer
        self.size = 0

    def grow_to(self, size: int) -> None:
        """Hold ``size`` bytes in all; HttpError 503, naming the limit, when the budget has not that much left."""
        if size <= self.size:
            return
        b = self.budget
        if b.take(self.peer, size - self.size):
            self.size = size
            return
        if b.by_peer.get(self.peer, 0) + size - self.size > b.peer_limit:
            raise HttpError(503, f"overloaded: this front-end process holds {b.by_peer.get(self.peer, 0) / MIB:.1f} "
                                 f"MiB of request bodies from {self.peer}, and this one's next bytes ({size / MIB:.1f} "
                                 f"MiB so far) pass one peer's share (shmbroker http --peer-body-memory-mib "
                                 f"{b.peer_limit // MIB}): try again later")
        raise HttpError(503, f"overloaded: this front-end process holds {b.used / MIB:.1f} MiB of request bodies and "
                             f"this one has {size / MIB:.1f} MiB so far, past its limit (shmbroker http "
                             f"--body-memory-mib {b.limit // MIB}): try again later")

    def release(self) -> None:
        self.budget.give(self.peer, self.size)
        self.size = 0


class _Pace:
    """When a body being read is cut: ``body_timeout_s`` after its headers, or once it falls RATE_WINDOW_S
    behind ``min_body_rate_kib``; each byte buys 1/rate seconds, and no more than RATE_WINDOW_S are in hand."""

    def __init__(self, settings: Settings, start: float) -> None:
        self.start = start
        self.rate = settings.min_body_rate_kib * KIB
        self.end = start + settings.body_timeout_s
        self.due = start + RATE_WINDOW_S if self.rate else math.inf

    def arrived(self, size: int, now: float) -> None:
        if self.rate:
            self.due = min(self.due + size / self.rate, now + RATE_WINDOW_S)

    @property
    def deadline(self) -> float:
        return min(self.due, self.end)

    @property
    def too_slow(self) -> bool:
        """Whether the deadline that passed was the pace's rather than the body timeout's."""
        return self.due < self.end


@contextlib.asynccontextmanager
async def request_body(request: web.Request, budget: BodyBudget, settings: Settings) -> AsyncIterator[bytes]:
    """The whole body, held against ``budget`` until the block ends. HttpError: 413 past --max-body-mib, 503
    when its bytes so far do not fit the budget (its peer's share, or the whole), 408 when it is not all there
    ``settings.body_timeout_s`` after the headers or falls behind ``settings.min_body_rate_kib``."""
    limit = settings.max_body_mib * MIB
    declared = request.content_length
    if declared is not None and declared > limit:
        raise HttpError(413, f"request body: {declared} bytes, past the limit of {settings.max_body_mib} MiB "
                             f"(shmbroker http --max-body-mib)")
    claim = _Claim(budget, peer_of(request.transport))
    try:
        yield await _read(request, claim, limit, settings)
    finally:
        claim.release()


async def _read(request: web.Request, claim: _Claim, limit: int, settings: Settings) -> bytes:
    loop = asyncio.get_running_loop()
    pace = _Pace(settings, loop.time())
    buf = bytearray()
    try:
        async with asyncio.timeout_at(pace.deadline) as window:
            while chunk := await request.content.readany():
                if len(buf) + len(chunk) > limit:
                    raise HttpError(413, f"request body: past the limit of {settings.max_body_mib} MiB "
                                         f"(shmbroker http --max-body-mib)")
                claim.grow_to(len(buf) + len(chunk))
                buf += chunk
                pace.arrived(len(chunk), loop.time())
                window.reschedule(pace.deadline)
    except TimeoutError:
        if pace.too_slow:
            raise HttpError(408, f"request body: {len(buf)} bytes in {loop.time() - pace.start:.1f} s, slower than "
                                 f"{settings.min_body_rate_kib} KiB/s for {RATE_WINDOW_S:g} s (shmbroker http "
                                 f"--min-body-rate)") from None
        raise HttpError(408, f"request body: {len(buf)} bytes came within {settings.body_timeout_s:g} s of the "
                             f"headers, not all of it (shmbroker http --body-timeout)") from None
    except ConnectionError:  # the client left mid-body: its answer goes nowhere, and it is no fault to log
        raise HttpError(400, f"request body: the connection closed after {len(buf)} bytes") from None
    return bytes(buf)
