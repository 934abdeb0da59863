"""client.client's contract with its user, against a live broker (real processes, shared memory, ZeroMQ):
the session takes the slots and rows asked for and refuses what is out of range, naming it; slots are the flow
control (a caller waits for one, within its timeout; a callback, which cannot wait, is told Overloaded); a
cancelled Future gives its slot back, and a cancelled await keeps it until answered without blocking the
event loop; a closed client refuses every entry point; a forked child cannot use
its parent's client. Closing with requests in flight: tests/test_client_lifecycle.py."""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

from shmbroker.client import (
    AsyncClient,
    Client,
    ClientClosed,
    HandshakeError,
    Overloaded,
    RequestTimeout,
    ShmBrokerError,
)
from shmbroker.client.receiving import IO_THREAD_NAME
from tests.conftest import TINY_MODELS, RunningBroker, arr, running_broker, wait_until
from tests.models import direct

X = np.random.default_rng(3).standard_normal((1, 256), dtype=np.float32)


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningBroker]:
    """A broker serving tiny alone; [sessions] default_slots = 8, default_max_items = 16 (tests/conftest.py)."""
    with running_broker(tmp_path_factory.mktemp("client"), models=TINY_MODELS) as b:
        yield b


def test_a_session_has_the_slots_and_rows_asked_for_or_the_brokers_defaults(live: RunningBroker) -> None:
    with Client(live.runtime_dir, slots=3, max_items=5) as c:
        assert (c.segment.layout.n_slots, c.max_items) == (3, 5)
        assert arr(c.infer("tiny", np.ones((5, 256), np.float32))).shape == (5, 256)
    with Client(live.runtime_dir) as c:
        assert (c.segment.layout.n_slots, c.max_items) == (8, 16)


def _thread_names() -> list[str]:
    return [Path(f"/proc/self/task/{tid}/comm").read_text().strip() for tid in os.listdir("/proc/self/task")]


def test_the_clients_io_thread_carries_its_name_where_top_and_py_spy_see_it(live: RunningBroker) -> None:
    with Client(live.runtime_dir, slots=1) as c:
        c.infer("tiny", X)  # answered on a thread of this client: its IO thread is up
        wait_until(lambda: IO_THREAD_NAME in _thread_names(), "the client's IO thread named", 10.0)
        assert _thread_names().count(IO_THREAD_NAME) == 1
    wait_until(lambda: IO_THREAD_NAME not in _thread_names(), "the IO thread ended with the client", 10.0)


@pytest.mark.parametrize(("slots", "max_items", "message"), [
    (0, -1, "HELLO.max_items: expected >= 0 (0: the broker's default), got -1"),
    (-1, 0, "HELLO.slots: expected 1..1024 (sessions.max_slots), got -1"),
    (1025, 0, "HELLO.slots: expected 1..1024 (sessions.max_slots), got 1025"),
])
def test_slots_or_rows_out_of_range_are_refused_naming_the_field(live: RunningBroker, slots: int, max_items: int,
                                                                 message: str) -> None:
    with pytest.raises(HandshakeError) as e:
        Client(live.runtime_dir, slots=slots, max_items=max_items)
    assert e.value.code == "BAD_HELLO"
    assert message in str(e.value)
    with Client(live.runtime_dir, slots=1) as c:  # the broker goes on serving
        np.testing.assert_allclose(arr(c.infer("tiny", X)), direct("tiny", X), rtol=0, atol=1e-5)


def test_a_caller_waits_for_a_free_slot_and_its_timeout_covers_that_wait(live: RunningBroker) -> None:
    with Client(live.runtime_dir, slots=1) as c:
        got: list[np.ndarray] = []
        with c.request("tiny"):  # holds the only slot, and sends nothing
            with pytest.raises(RequestTimeout, match=r"no free slot within 0\.05 s \(all 1 slots in flight: "
                                                     r"raise Client\(slots=\.\.\.\), or the timeout\)"):
                c.infer("tiny", X, timeout=0.05)
            waiter = threading.Thread(target=lambda: got.append(arr(c.infer("tiny", X))))
            waiter.start()  # no timeout: it waits until the block below ends
        waiter.join(30)
        assert len(got) == 1
        np.testing.assert_allclose(got[0], direct("tiny", X), rtol=0, atol=1e-5)


def test_a_callback_that_needs_a_slot_while_all_are_in_flight_is_told_overloaded(live: RunningBroker) -> None:
    """A callback runs on the thread that delivers every answer: waiting there for a slot would wait for
    itself. Its own request's slot is free again when it runs; the next one it asks for is refused."""
    refused: list[Exception] = []
    answers: list[object] = []
    done = threading.Event()

    def second(out: object, err: ShmBrokerError | None) -> None:
        answers.append(err if err is not None else out)
        done.set()

    def first(out: object, err: ShmBrokerError | None) -> None:
        answers.append(err if err is not None else out)
        c.call("tiny", X, second)  # takes the slot that `first`'s request gave back
        try:
            c.call("tiny", X, second)
        except Overloaded as exc:
            refused.append(exc)

    with Client(live.runtime_dir, slots=2) as c, c.request("tiny"):  # one of the two slots held throughout
        c.call("tiny", X, first)
        assert done.wait(30)
    assert len(refused) == 1, refused
    assert "all 2 slots are in flight" in str(refused[0]) and "Client(slots=...)" in str(refused[0])
    assert len(answers) == 2 and all(isinstance(a, np.ndarray) for a in answers), answers


def test_a_cancelled_future_gives_its_slot_back_when_its_answer_comes(live: RunningBroker) -> None:
    with Client(live.runtime_dir, slots=1) as c:
        c.infer("tiny", X)  # linked and warm
        with live.workers_stopped():  # no answer before the cancel
            fut = c.submit("tiny", X)
            assert fut.cancel()
        np.testing.assert_allclose(arr(c.infer("tiny", X, timeout=30)), direct("tiny", X), rtol=0, atol=1e-5)
        assert fut.cancelled()


def test_a_cancelled_await_keeps_its_slot_until_answered_and_the_loop_never_blocks(live: RunningBroker) -> None:
    """``asyncio.wait_for`` cancels an AsyncClient request whose answer is late; its slot stays the worker's
    until the answer comes. A request made meanwhile waits for it without blocking the event loop, and its own
    timeout covers that wait."""

    async def scenario() -> np.ndarray:
        async with AsyncClient(live.runtime_dir, slots=1) as ac:
            await ac.infer("tiny", X)  # linked and warm
            with live.workers_stopped():  # no answer before the cancel
                with pytest.raises(TimeoutError):
                    await asyncio.wait_for(ac.infer("tiny", X), 0.1)
                with pytest.raises(RequestTimeout, match=r"no free slot within 0\.2 s .*raise Client\(slots="):
                    await ac.infer("tiny", X, timeout=0.2)
                waiting = asyncio.create_task(ac.infer("tiny", X, timeout=30))
                for _ in range(3):  # the loop goes on while the request waits for the slot
                    await asyncio.sleep(0.05)
                assert not waiting.done()
            return arr(await waiting)  # the late answer freed the slot

    np.testing.assert_allclose(asyncio.run(scenario()), direct("tiny", X), rtol=0, atol=1e-5)


def test_a_closed_client_refuses_every_entry_point_and_leaves_no_thread(live: RunningBroker) -> None:
    c = Client(live.runtime_dir)
    c.infer("tiny", X)
    io_thread = f"shmb-client-{c.session_id}"
    assert io_thread in {t.name for t in threading.enumerate()}
    c.close()
    c.close()  # a second close does nothing
    calls: dict[str, Callable[[], object]] = {
        "infer": lambda: c.infer("tiny", X),
        "submit": lambda: c.submit("tiny", X),
        "call": lambda: c.call("tiny", X, lambda out, err: None),
        "request": lambda: c.request("tiny").__enter__(),
    }
    for name, call in calls.items():
        with pytest.raises(ClientClosed, match="the client is closed") as e:
            call()
        assert e.value.code == "CLIENT_CLOSED", name
    assert io_thread not in {t.name for t in threading.enumerate()}


def test_a_forked_child_cannot_use_its_parents_client(live: RunningBroker) -> None:
    """The child shares the parent's ring and sockets: a request from it would take the parent's slots. It is
    refused before anything is sent, and the parent's client goes on."""
    with Client(live.runtime_dir) as c:
        c.infer("tiny", X)
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: report the error's code, and leave without running anything of pytest's
            code = b"none"
            try:
                c.infer("tiny", X)
            except ShmBrokerError as exc:
                code = exc.code.encode()
            finally:
                os.write(w, code)
                os._exit(0)
        os.close(w)
        with os.fdopen(r, "rb") as child:
            code = child.read()
        assert os.waitpid(pid, 0)[1] == 0
        assert code == b"FORKED"
        np.testing.assert_allclose(arr(c.infer("tiny", X)), direct("tiny", X), rtol=0, atol=1e-5)
