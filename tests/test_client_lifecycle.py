"""Closing a client: requests in flight are answered first, up to a timeout; the rest fail with ClientClosed."""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest

from shmbroker.client import AsyncClient, Client, ClientClosed, ShmBrokerError, WorkerDied
from tests.conftest import RunningBroker

X = np.ones((1, 256), np.float32)


def test_leaving_the_with_block_lets_callbacks_get_their_answers(process_broker: RunningBroker) -> None:
    """The README's callback snippet: the callback must see its output, never an error, whenever the block ends."""
    for _ in range(5):
        got: list[object] = []

        def on_done(out: object, err: ShmBrokerError | None, got: list[object] = got) -> None:
            got.append(err if err is not None else out)

        with Client(process_broker.runtime_dir) as c:
            for _ in range(8):
                c.call("tiny", X, on_done)
        assert len(got) == 8 and all(isinstance(g, np.ndarray) for g in got), got


def test_requests_unanswered_when_the_wait_ends_fail_with_client_closed(process_broker: RunningBroker) -> None:
    c = Client(process_broker.runtime_dir)
    c.infer("tiny", X)  # the worker is linked and warm
    with process_broker.workers_stopped():  # nothing is answered while the client closes
        fut = c.submit("tiny", X)
        c.close(timeout=0.2)
        with pytest.raises(ClientClosed, match="closed before the answer came") as e:
            fut.result(10)
        assert e.value.code == "CLIENT_CLOSED" and not isinstance(e.value, WorkerDied)
        with pytest.raises(ClientClosed, match="the client is closed"):
            c.submit("tiny", X)


def test_closing_from_a_callback_does_not_wait_for_itself(process_broker: RunningBroker) -> None:
    c = Client(process_broker.runtime_dir)
    errors: list[ShmBrokerError | None] = []
    closed = threading.Event()

    def on_done(_out: object, err: ShmBrokerError | None) -> None:
        errors.append(err)
        c.close(timeout=30)  # on the client's IO thread: returns at once
        closed.set()

    c.call("tiny", X, on_done)
    assert closed.wait(10)
    assert errors == [None]


def test_async_close_waits_for_awaited_requests(process_broker: RunningBroker) -> None:
    async def main() -> list[object]:
        c = AsyncClient(process_broker.runtime_dir)
        tasks = [asyncio.ensure_future(c.infer("tiny", X)) for _ in range(8)]
        await asyncio.sleep(0)  # let each task submit its request
        await c.close()
        return await asyncio.gather(*tasks, return_exceptions=True)

    results = asyncio.run(main())
    assert all(isinstance(r, np.ndarray) for r in results), results
