"""The asyncio client: ``await AsyncClient().infer(model, inputs)``; works under uvloop.

It shares the synchronous client's session and IO thread. Submits made in one event-loop turn are sent
as one message per worker, and a semaphore over the slots keeps the loop from ever blocking on a slot.
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

from shmbroker.client.client import Client, Inputs, Outputs
from shmbroker.client.lifecycle import CLOSE_WAIT_S


class AsyncClient:
    def __init__(self, runtime_dir: str | os.PathLike[str] | None = None, **kwargs: Any) -> None:
        self._client = Client(runtime_dir, **kwargs)
        self._sem = asyncio.Semaphore(len(self._client._gens))
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
            self._client._cork.on = True
            try:
                fut = self._client.submit(model, inputs, timeout)
            finally:
                self._client._cork.on = False
            if not self._flush_scheduled:
                self._flush_scheduled = True
                loop.call_soon(self._flush)
            return await asyncio.wrap_future(fut)

    def _flush(self) -> None:
        self._flush_scheduled = False
        self._client._flush_all()

    async def close(self, timeout: float = CLOSE_WAIT_S) -> None:
        """``Client.close`` off the event loop: requests in flight get up to ``timeout`` s to be answered."""
        await asyncio.get_running_loop().run_in_executor(None, self._client.close, timeout)

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
