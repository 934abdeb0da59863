"""client.parts: a request of more rows than a slot holds is sent as parts and answered as one request, through
every API (infer, submit, call, AsyncClient), in both worker modes; a failed part fails the whole request once,
and every slot is free afterwards. The zero-copy request, which fills one slot, is refused naming the setting."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import threading
from collections.abc import Callable, Iterator

import numpy as np
import pytest

from shmbroker.client import AsyncClient, BadInput, Client, ClientClosed, ShmBrokerError, WorkerDied
from shmbroker.client.client import Outputs
from tests.conftest import RunningBroker, arr, running_broker
from tests.models import direct

# tiny at max_batch 256; a default session's 4 slots are sized by a 1 MiB ring budget: about 127 rows each
BIG_TINY = """
[models.tiny]
path = "builtin:tiny"
max_batch = 256
max_queue_delay_us = 1000
max_queue_size = 1024
timeout_ms = 20000
intra_op_threads = 1
"""
SESSIONS = "default_slots = 4\ndefault_ring_mib = 1"
ROWS = 256
PART = 10  # Client(max_items=PART): 26 parts through 4 slots


@pytest.fixture(scope="module", params=["process", "thread"])
def big(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningBroker]:
    with running_broker(tmp_path_factory.mktemp(f"parts-{request.param}"), str(request.param), models=BIG_TINY,
                        sessions=SESSIONS) as b:
        yield b


def _x(seed: int, rows: int = ROWS) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((rows, 256), dtype=np.float32)


def _all_slots_free(c: Client) -> None:
    """Every slot can be taken at once, within a short wait: none was left held by the parts."""
    with contextlib.ExitStack() as stack:
        for _ in range(c.slots):
            stack.enter_context(c.request("tiny", timeout=5))


def _call(c: Client, x: np.ndarray) -> Outputs:
    done = threading.Event()
    got: list[tuple[Outputs | None, ShmBrokerError | None]] = []

    def callback(out: Outputs | None, err: ShmBrokerError | None) -> None:
        got.append((out, err))
        done.set()

    c.call("tiny", x, callback)
    assert done.wait(60), "no callback"
    (out, err), = got
    if err is not None:
        raise err
    assert out is not None
    return out


APIS: dict[str, Callable[[Client, np.ndarray], Outputs]] = {
    "infer": lambda c, x: c.infer("tiny", x),
    "submit": lambda c, x: c.submit("tiny", x).result(60),
    "call": _call,
}


@pytest.mark.parametrize("api", sorted(APIS))
def test_a_request_of_more_rows_than_a_slot_holds_is_answered_whole_and_in_order(big: RunningBroker,
                                                                                 api: str) -> None:
    x = _x(1)
    with Client(big.runtime_dir, max_items=PART) as c:
        assert (c.slots, c.max_items) == (4, PART)
        y = arr(APIS[api](c, x))
        np.testing.assert_allclose(y, direct("tiny", x), rtol=0, atol=1e-5)
        _all_slots_free(c)
        one = _x(2, 3)  # a request that fits one slot goes on as before
        np.testing.assert_allclose(arr(APIS[api](c, one)), direct("tiny", one), rtol=0, atol=1e-5)


def test_a_default_session_splits_a_max_batch_request_by_the_ring_budget(big: RunningBroker) -> None:
    x = _x(3)
    with Client(big.runtime_dir) as c:
        assert c.segment.layout.total_bytes <= 1 << 20  # [sessions] default_ring_mib = 1
        assert 1 <= c.max_items < ROWS
        np.testing.assert_allclose(arr(c.infer("tiny", x)), direct("tiny", x), rtol=0, atol=1e-5)


def test_several_threads_send_parts_and_single_requests_at_once(big: RunningBroker) -> None:
    xs = [_x(10 + k, rows) for k, rows in enumerate((ROWS, 1, 37, ROWS, 5, 200))]
    with Client(big.runtime_dir, max_items=PART) as c:
        outs: list[np.ndarray | None] = [None] * len(xs)

        def run(k: int) -> None:
            outs[k] = arr(c.infer("tiny", xs[k], timeout=60))

        threads = [threading.Thread(target=run, args=(k,)) for k in range(len(xs))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        for x, y in zip(xs, outs, strict=True):
            assert y is not None
            np.testing.assert_allclose(y, direct("tiny", x), rtol=0, atol=1e-5)
        _all_slots_free(c)


def test_the_async_client_sends_parts_as_permits_come(big: RunningBroker) -> None:
    xs = [_x(20 + k, rows) for k, rows in enumerate((ROWS, 2, ROWS, 11))]

    async def scenario() -> list[Outputs]:
        async with AsyncClient(big.runtime_dir, max_items=PART) as ac:
            outs = await asyncio.gather(*(ac.infer("tiny", x) for x in xs))
            # every permit came back: as many zero-copy requests as slots are held at once without a wait
            async with contextlib.AsyncExitStack() as stack:
                for _ in range(ac.client.slots):
                    await stack.enter_async_context(ac.request("tiny", timeout=5))
            return outs

    for x, y in zip(xs, asyncio.run(scenario()), strict=True):
        np.testing.assert_allclose(arr(y), direct("tiny", x), rtol=0, atol=1e-5)


def test_a_zero_copy_request_has_one_slots_rows_and_the_error_names_the_setting(big: RunningBroker) -> None:
    with Client(big.runtime_dir, max_items=PART) as c:
        with pytest.raises(BadInput) as e, c.request("tiny", rows=PART + 1):
            pass
        assert e.value.code == "BAD_SHAPE"
        assert f"rows: expected 1..{PART} rows" in str(e.value)
        assert "Client(max_items=...)" in str(e.value) and "default_ring_mib" in str(e.value)
        with c.request("tiny", rows=PART) as req:  # a slot's rows: served
            req.inputs["x"][...] = 1.0
            assert arr(req.run()).shape == (PART, 256)
        with pytest.raises(BadInput, match=r"model 'tiny' has max_batch 256"):  # the model's limit still binds
            c.infer("tiny", _x(4, ROWS + 1))


@pytest.fixture
def stoppable(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningBroker]:
    """A broker of its own, whose worker process the test stops and kills."""
    with running_broker(tmp_path_factory.mktemp("parts-fail"), "process", models=BIG_TINY, sessions=SESSIONS) as b:
        yield b


def test_a_failed_part_fails_the_whole_request_once_and_frees_every_slot(stoppable: RunningBroker) -> None:
    x = _x(5)
    with Client(stoppable.runtime_dir, slots=8, max_items=PART) as c:
        calls: list[tuple[Outputs | None, ShmBrokerError | None]] = []
        called = threading.Event()

        def callback(out: Outputs | None, err: ShmBrokerError | None) -> None:
            calls.append((out, err))
            called.set()

        with stoppable.workers_stopped():  # the first parts wait in the worker's socket, unanswered
            c.call("tiny", x, callback)  # takes every free slot: 8 parts in flight
            (worker,) = stoppable.worker_pids()
            os.kill(worker, signal.SIGKILL)
        assert called.wait(30), "no callback after the worker died"
        c.wait_ready("tiny", 60)  # the broker's new worker
        np.testing.assert_allclose(arr(c.infer("tiny", x)), direct("tiny", x), rtol=0, atol=1e-5)
        _all_slots_free(c)
    (out, err), = calls  # exactly one answer for the whole request
    assert out is None and isinstance(err, WorkerDied), err


def test_closing_the_client_ends_a_request_in_parts_with_one_error(stoppable: RunningBroker) -> None:
    c = Client(stoppable.runtime_dir, max_items=PART)
    with stoppable.workers_stopped():
        fut = c.submit("tiny", _x(6))
        c.close(timeout=0)
    with pytest.raises(ClientClosed):
        fut.result(30)
