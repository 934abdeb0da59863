"""The asyncio client: ``await AsyncClient().infer(model, inputs)``; works under uvloop.

It shares the synchronous client's session and IO thread: a request is a ``Client.call`` whose callback settles
an asyncio future on the loop, one hand-off per answer as for callbacks. Submits made in one event-loop turn are
sent as one message per worker, and a semaphore over the slots keeps the loop from ever blocking on a slot:
a request holds its permit from before its slot is taken until after the slot is free again. A request of more
rows than a slot holds is sent as parts (``Client.parts``), each with a permit of its own as one comes, while
none has failed; their outputs are concatenated.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
from collections.abc import AsyncIterator, Callable
from typing import Any

import numpy as np

from shmbroker.client.checks import check_timeout
from shmbroker.client.client import CLOSE_WAIT_S, Callback, Client, Inputs, Outputs
from shmbroker.client.errors import RequestTimeout, ShmBrokerError
from shmbroker.client.request import Request
from shmbroker.client.slots import no_free_slot

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


class AsyncRequest:
    """A held slot for zero-copy use on an event loop (``AsyncClient.request``): write ``inputs`` in place, then
    ``submit()``. The views are valid inside the ``async with`` block only."""

    def __init__(self, req: Request, submit: Callable[[Request], asyncio.Future[Outputs]]) -> None:
        self._req = req
        self._submit = submit

    @property
    def inputs(self) -> dict[str, np.ndarray]:
        """The slot's input arrays, by input name, to fill in place."""
        return self._req.inputs

    def submit(self) -> asyncio.Future[Outputs]:
        """Send the slot as it is; the returned future (await it, in the block or after it) holds the outputs,
        copied out of the slot. The inputs go read-only. Once per request.

        Raises:
            ShmBrokerError: as ``Request.submit`` (REQUEST_ENDED, REQUEST_SENT); WorkerDied.
        """
        return self._submit(self._req)


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
        parts = self._client.parts(model, inputs)
        if parts is not None:
            return await self._infer_parts(model, parts, timeout)
        if timeout is None or not self._sem.locked():  # inline: one coroutine less per request
            await self._sem.acquire()
        else:
            await self._slot_within(timeout)
        return await self._sent(lambda done: self._client.call(model, inputs, done, timeout), lambda: True)

    async def _infer_parts(self, model: str, parts: list[Inputs], timeout: float | None) -> Outputs:
        """A request of more rows than a slot holds, as one request per part, each sent once a permit comes and
        while no part has failed, with the time left of the whole request's deadline; the outputs concatenated in
        order, or the first failed part's error."""
        loop = asyncio.get_running_loop()
        budget = timeout if timeout is not None else self._client.models[model].info.timeout_ms / 1e3
        deadline = loop.time() + budget
        answers: list[asyncio.Future[Outputs]] = []
        failed: list[asyncio.Future[Outputs]] = []
        error: ShmBrokerError | None = None
        try:
            for part in parts:
                if failed:
                    break
                left = deadline - loop.time()
                try:
                    if left <= 0:
                        raise RequestTimeout(f"the request's parts were not all sent within its timeout ({budget:g} s)")
                    await self._permit(left)
                    answer = self._sent(functools.partial(self._client.call, model, part, timeout=left), lambda: True)
                except ShmBrokerError as exc:
                    error = exc
                    break
                answer.add_done_callback(lambda a: failed.append(a) if not a.cancelled() and a.exception() else None)
                answers.append(answer)
            outs = await asyncio.gather(*answers, return_exceptions=True)
        except BaseException:
            for a in answers:  # cancelled: a part still out gives its permit back when answered (_settle)
                a.cancel()
            raise
        for out in outs:
            if isinstance(out, BaseException):
                raise out
        if error is not None:
            raise error
        first = outs[0]
        if isinstance(first, dict):
            return {name: np.concatenate([o[name] for o in outs]) for name in first}  # type: ignore[index]
        return np.concatenate(outs)  # type: ignore[arg-type]

    @contextlib.asynccontextmanager
    async def request(self, model: str, rows: int = 1, timeout: float | None = None) -> AsyncIterator[AsyncRequest]:
        """Zero-copy on the event loop: ``async with ac.request(model) as req:`` write ``req.inputs[name]`` in
        place, then ``fut = req.submit()``; ``await fut`` for the outputs. A free slot is awaited first (within
        ``timeout``), as for ``infer``; a block that submits nothing gives it back at its end."""
        await self._permit(timeout)
        held: Request | None = None
        try:
            with self._client.request(model, rows, timeout) as req:  # a permit is a free slot: no wait here
                held = req
                yield AsyncRequest(req, self._submit_held)
        finally:
            if held is None or not held.submitted:
                self._sem.release()

    def _submit_held(self, req: Request) -> asyncio.Future[Outputs]:
        before = req.submitted
        # a refused call (REQUEST_ENDED, REQUEST_SENT) leaves the permit to the block or the earlier submit
        return self._sent(req.call, lambda: req.submitted and not before)

    def _sent(self, send: Callable[[Callback], object], took_slot: Callable[[], bool]) -> asyncio.Future[Outputs]:
        """Send one request with ``send(callback)``; the future that its answer settles, giving the permit back.
        If ``send`` raises, the permit goes back at once where ``took_slot()`` says the request had taken it."""
        loop = asyncio.get_running_loop()
        answer: asyncio.Future[Outputs] = loop.create_future()
        try:
            with self._cork:
                send(functools.partial(_hand_over, loop, answer, self._sem))
        except BaseException:
            if took_slot():  # not sent: no answer will give the permit back
                self._sem.release()
            raise
        self._flush_soon(loop)
        return answer

    async def _permit(self, timeout: float | None) -> None:
        if timeout is None or not self._sem.locked():
            await self._sem.acquire()
        else:
            await self._slot_within(timeout)

    def _flush_soon(self, loop: asyncio.AbstractEventLoop) -> None:
        if not self._flush_scheduled:
            self._flush_scheduled = True
            loop.call_soon(self._flush)

    async def _slot_within(self, timeout: float) -> None:
        """A slot's permit within ``timeout`` s, else RequestTimeout as Client.infer words it."""
        check_timeout(timeout)
        try:
            await asyncio.wait_for(self._sem.acquire(), timeout)
        except TimeoutError:
            raise RequestTimeout(no_free_slot(timeout, self._client.slots, self._client.slots_setting)) from None

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
