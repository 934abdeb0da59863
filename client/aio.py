"""The asyncio client: ``await AsyncClient().infer(model, inputs)``; works under uvloop.

It shares the synchronous client's session and IO thread: a request is a ``Client.call`` whose callback settles
an asyncio future on the loop, one hand-off per answer as for callbacks. Submits made in one event-loop turn are
sent as one message per worker, and a semaphore over the slots keeps the loop from ever blocking on a slot.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
from typing import Any

from shmbroker.client.client import CLOSE_WAIT_S, Client, Inputs, Outputs
from shmbroker.client.errors import ShmBrokerError

log = logging.getLogger(__name__)


def _hand_over(loop: asyncio.AbstractEventLoop, answer: asyncio.Future[Outputs], out: Outputs | None,
               err: ShmBrokerError | None) -> None:
    """The completion callback (on the client's receiving thread): settle ``answer`` on its event loop."""
    try:
        loop.call_soon_threadsafe(_settle, answer, out, err)
    except RuntimeError:  # the loop is closed: nobody waits for the answer any more
        log.debug("an answer came after its event loop closed")


def _settle(answer: asyncio.Future[Outputs], out: Outputs | None, err: ShmBrokerError | None) -> None:
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
        """Run one request; raises the same typed errors as Client.infer."""
        async with self._sem:
            loop = asyncio.get_running_loop()
            answer: asyncio.Future[Outputs] = loop.create_future()
            with self._cork:
                self._client.call(model, inputs, functools.partial(_hand_over, loop, answer), timeout)
            if not self._flush_scheduled:
                self._flush_scheduled = True
                loop.call_soon(self._flush)
            return await answer

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
