"""The caller's side of the deployment (``BrokerHandle``): ``await bh.infer(model, inputs, timeout)`` through a
Ray Serve handle, answered and failing as ``AsyncClient.infer`` is.

A Ray call costs a millisecond or more of CPU between the caller and the replica, against tens of microseconds
for a request to the broker: requests made in one event-loop turn go as one call of up to ``coalesce`` requests
(``NodeBroker.infer_many``), each with its own deadline and its own answer or typed error. A request's deadline
travels as a wall-clock time, so the time it spends in Ray counts against it; its caller waits
``timeout + GRACE_S`` at most (``wait_s`` without a timeout), then gets RequestTimeout: a request that no
replica takes (none alive, say) never hangs. Ray's own failures come as the client's types: a replica that died
under the call as WorkerDied, Ray Serve's back-pressure as Overloaded.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from ray.exceptions import RayActorError, RayTaskError
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError, ReplicaUnavailableError

from shmbroker.client import Overloaded, RequestError, RequestTimeout, ShmBrokerError, WorkerDied
from shmbroker.client.checks import check_timeout
from shmbroker.client.client import Inputs, Outputs
from shmbroker.ray.node import Call

COALESCE = 16  # requests in one Ray call at most: 32 in flight still spread over two replicas
WAIT_S = 60.0  # how long a request without a timeout waits for its answer through Ray
GRACE_S = 5.0  # past a request's timeout, how long its caller waits for the replica's answer to come back


def typed(exc: BaseException) -> ShmBrokerError:
    """The client's error for what a Ray call raised."""
    if isinstance(exc, RayTaskError) and isinstance(exc.cause, ShmBrokerError):
        return exc.cause
    if isinstance(exc, ShmBrokerError):
        return exc
    if isinstance(exc, RayActorError | ReplicaUnavailableError):
        return WorkerDied(f"the replica died before it answered ({type(exc).__name__}); nothing else is lost: send "
                          "the request again")
    if isinstance(exc, DeploymentUnavailableError):
        return WorkerDied(f"no replica can take the request: {exc.message}")
    if isinstance(exc, BackPressureError):
        return Overloaded(f"Ray Serve refused the request: {exc}")
    return RequestError(f"the Ray call failed: {exc!r}")


class BrokerHandle:
    """``infer`` through ``handle``, a DeploymentHandle of the ``shmbroker`` deployment (``serve.run``'s result,
    or ``serve.get_deployment_handle("shmbroker", app_name)``). Use it from one event loop."""

    def __init__(self, handle: Any, coalesce: int = COALESCE, wait_s: float = WAIT_S) -> None:
        if type(coalesce) is not int or coalesce < 1:
            raise ValueError(f"BrokerHandle(coalesce=...): expected requests per Ray call, at least 1, "
                             f"got {coalesce!r}")
        if not wait_s > 0:
            raise ValueError(f"BrokerHandle(wait_s=...): expected seconds, more than 0, got {wait_s!r}")
        self._handle = handle
        self.coalesce = coalesce
        self.wait_s = wait_s
        self._queue: list[tuple[Call, asyncio.Future[Outputs]]] = []
        self._flush_scheduled = False
        self._calls: set[asyncio.Task[None]] = set()  # the Ray calls out: a task needs a reference to live

    async def infer(self, model: str, inputs: Inputs, timeout: float | None = None) -> Outputs:
        """One request (numpy in, numpy out) through the replica of whichever node Ray picks; ``timeout``: seconds
        from now, Ray's share included (None: the model's own timeout on the broker). Raises the client's typed
        errors (RequestTimeout, Overloaded, WorkerDied, BadInput, UnknownModel, ...)."""
        check_timeout(timeout)
        loop = asyncio.get_running_loop()
        answer: asyncio.Future[Outputs] = loop.create_future()
        self._queue.append((Call(model, inputs, None if timeout is None else time.time() + timeout), answer))
        if not self._flush_scheduled:
            self._flush_scheduled = True
            loop.call_soon(self._flush)
        bound = self.wait_s if timeout is None else timeout + GRACE_S
        try:
            done, _ = await asyncio.wait((answer,), timeout=bound)
        finally:
            if not answer.done():  # timed out, or the caller was cancelled: the answer, if it comes, is dropped
                answer.cancel()
        if not done:
            raise RequestTimeout(f"no answer came through Ray within {bound:g} s (the timeout + {GRACE_S:g} s, or "
                                 "BrokerHandle(wait_s=...) without one): no replica took the request, or its answer "
                                 "was lost with it")
        return answer.result()

    def _flush(self) -> None:
        """Send what this loop turn queued: one Ray call per ``coalesce`` requests still awaited."""
        self._flush_scheduled = False
        queue, self._queue = self._queue, []
        live = [(call, answer) for call, answer in queue if not answer.done()]
        for i in range(0, len(live), self.coalesce):
            chunk = live[i:i + self.coalesce]
            try:
                response = self._handle.infer_many.remote([call for call, _ in chunk])
            except Exception as exc:  # noqa: BLE001 - refused before it left (Serve shut down): each caller hears why
                self._fail([answer for _, answer in chunk], exc)
                continue
            task = asyncio.get_running_loop().create_task(self._settle(response, [answer for _, answer in chunk]))
            self._calls.add(task)
            task.add_done_callback(self._calls.discard)

    async def _settle(self, response: Any, answers: list[asyncio.Future[Outputs]]) -> None:
        try:
            outs: list[Outputs | ShmBrokerError] = await response
        except Exception as exc:  # noqa: BLE001 - whatever Ray raised reaches each caller as a typed error
            self._fail(answers, exc)
            return
        for answer, out in zip(answers, outs, strict=True):
            if answer.done():
                continue
            if isinstance(out, ShmBrokerError):
                answer.set_exception(out)
            else:
                answer.set_result(out)

    @staticmethod
    def _fail(answers: list[asyncio.Future[Outputs]], exc: BaseException) -> None:
        for answer in answers:
            if not answer.done():
                answer.set_exception(typed(exc))
