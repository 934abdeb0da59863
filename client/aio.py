"""The asyncio client: ``await AsyncClient().infer(model, inputs)``; works under uvloop.

It shares the synchronous client's session and IO thread: a request is a ``Client.call`` whose callback settles
an asyncio future on the loop, one hand-off per answer as for callbacks. Submits made in one event-loop turn are
sent as one message per worker, and a semaphore over the slots keeps the loop from ever blocking on a slot:
a request holds its permit from before its slot is taken until after the slot is free again.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
from typing import Any

from shmbroker.client.checks import check_timeout
from shmbroker.client.client import CLOSE_WAIT_S, Client, Inputs, Outputs
from shmbroker.client.errors import RequestTimeout, ShmBrokerError

log = logging.getLogger(__name__)


def _hand_over(loop: asyncio.AbstractEventLoop, answer: asyncio.Future[Outputs], slots: asyncio.Semaphore,
               out: Outputs | None, err: ShmBrokerError | None) -> None:
    """The completion callback (on the client's receiving thread, the slot already free): give the slot's
    permit back and settle ``answer`` on its event loop."""
    try:
        loop.call_soon_threadsafe(_settle, answer, slots, out, err)
    except RuntimeError:  # the loop is closed: nobody waits for the answer any more
        log.debug("an answer came after its event loop closed")


def _settle(answer: asyncio.Future[Outputs], slots: asyncio.Semaphore, out: Outputs | None,
            err: ShmBrokerError | None) -> None:
    slots.release()
    if answer.done():  # the awaiting task was cancelled
        return
    if err is not None:
        answer.set_exception(err)
    else:
        answer.set_result(out)  # type: ignore[arg-type]


class AsyncClient:
    def __init__(self, runtime_dir: str | os.PathLike[str] | None = None, **kwargs: Any) -> None:
        self._client = Client(runtime_dir, **kwargs)
        self._sem = asyncio.Semaphore(self._client.slots)
        self._cork = self._client.corked()  # a thread-local: the event loop's thread is the one that enters it
        self._flush_scheduled = False

    @property
    def client(self) -> Client:
        return self._client

    @property
    def models(self) -> dict[str, Any]:
        return self._client.models

    async def infer(self, model: str, inputs: Inputs, timeout: float | None = None) -> Outputs:
        """Run one request; raises the same typed errors as Client.infer.

        A free slot is awaited first (within ``timeout``, as Client.infer waits), so the loop never blocks on
        one. Its permit goes back when the answer comes, not when the await ends: a cancelled await (say
        ``asyncio.wait_for``) leaves the slot to the worker until then.
        """
        if timeout is None or not self._sem.locked():
            await self._sem.acquire()
        else:
            await self._slot_within(timeout)
        loop = asyncio.get_running_loop()
        answer: asyncio.Future[Outputs] = loop.create_future()
        try:
            with self._cork:
                self._client.call(model, inputs, functools.partial(_hand_over, loop, answer, self._sem), timeout)
        except BaseException:
            self._sem.release()  # not sent: no answer will give the permit back
            raise
        if not self._flush_scheduled:
            self._flush_scheduled = True
            loop.call_soon(self._flush)
        return await answer

    async def _slot_within(self, timeout: float) -> None:
        """A slot's permit within ``timeout`` s, else RequestTimeout as Client.infer words it."""
        check_timeout(timeout)
        try:
            await asyncio.wait_for(self._sem.acquire(), timeout)
        except TimeoutError:
            n = self._client.slots
            raise RequestTimeout(f"no free slot within {timeout} s (all {n} slots in flight)") from None

    def _flush(self) -> None:
        self._flush_scheduled = False
        self._client.flush()

    async def close(self, timeout: float = CLOSE_WAIT_S) -> None:
        """``Client.close`` off the event loop: requests in flight get up to ``timeout`` s to be answered."""
        await asyncio.get_running_loop().run_in_executor(None, self._client.close, timeout)

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
