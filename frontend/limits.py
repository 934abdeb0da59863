"""What one HTTP front-end process allows request bodies: time and memory (connections: frontend/connections.py).

A request body must arrive whole within ``body_timeout_s`` of its headers (else 408), and the bodies held at once
fit in ``body_memory`` bytes: a request whose body does not fit is answered 503 at once, its body unread.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from aiohttp import web

from shmbroker.frontend.kserve import HttpError
from shmbroker.frontend.settings import Settings

MIB = 1 << 20


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
