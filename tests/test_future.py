"""client.future: a Future's result() receives on the waiting thread and sends the SUBMITs its thread queued; a
Future waited on by other means is still sent and answered; waiting inside a completion callback is refused."""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import CancelledError, Future, wait

import numpy as np
import pytest

from shmbroker.client import Client
from shmbroker.client.client import Outputs
from shmbroker.client.errors import ShmBrokerError
from shmbroker.client.future import ClientFuture
from tests.conftest import RunningBroker, arr
from tests.models import direct


def test_a_futures_loop_gets_every_answer_right(broker: RunningBroker) -> None:
    """Eight in flight, each result() followed by one more submit: the waiting thread receives and its submits
    leave together with its next wait."""
    rng = np.random.default_rng(9)
    xs = [rng.standard_normal((1, 256), dtype=np.float32) for _ in range(200)]
    with Client(slots=16) as c:
        pending = [(x, c.submit("tiny", x)) for x in xs[:8]]
        for x in xs[8:]:
            want, fut = pending.pop(0)
            np.testing.assert_allclose(arr(fut.result(20)), direct("tiny", want), rtol=0, atol=1e-5)
            pending.append((x, c.submit("tiny", x)))
        for want, fut in pending:
            np.testing.assert_allclose(arr(fut.result(20)), direct("tiny", want), rtol=0, atol=1e-5)


def test_futures_waited_on_without_result_are_sent_and_answered(broker: RunningBroker) -> None:
    """After a thread waited in a Future's result(), its next submits are queued for its next wait. A thread that
    then waits with concurrent.futures.wait instead still gets every answer: the IO thread sends the queued
    SUBMITs and takes the receive role back (client.lead, WATCH_MS)."""
    rng = np.random.default_rng(5)
    xs = [rng.standard_normal((1, 256), dtype=np.float32) for _ in range(10)]
    with Client(slots=16) as c:
        first = [c.submit("tiny", x) for x in xs[:2]]  # one left in flight while this thread leads
        np.testing.assert_allclose(arr(first[0].result(20)), direct("tiny", xs[0]), rtol=0, atol=1e-5)
        futs = first[1:] + [c.submit("tiny", x) for x in xs[2:]]
        _done, not_done = wait(futs, timeout=20)
        assert not not_done
        for x, f in zip(xs[1:], futs, strict=True):
            np.testing.assert_allclose(arr(f.result(0)), direct("tiny", x), rtol=0, atol=1e-5)


def test_done_callbacks_run_with_the_answers_after_a_result(broker: RunningBroker) -> None:
    """A done-callback added after the thread led hands receiving to the IO thread, which runs it with the
    answer; callbacks added to Futures already done run at once."""
    rng = np.random.default_rng(6)
    xs = [rng.standard_normal((1, 256), dtype=np.float32) for _ in range(6)]
    got: dict[int, np.ndarray] = {}
    all_in = threading.Event()

    def keep(i: int) -> Callable[[Future[Outputs]], None]:
        def done(f: Future[Outputs]) -> None:
            got[i] = arr(f.result(0))
            if len(got) == len(xs) - 1:
                all_in.set()
        return done

    with Client(slots=16) as c:
        c.submit("tiny", xs[0]).result(20)  # this thread led: its next submits are queued
        for i, x in enumerate(xs[1:], 1):
            c.submit("tiny", x).add_done_callback(keep(i))
        assert all_in.wait(20)
    for i in range(1, len(xs)):
        np.testing.assert_allclose(got[i], direct("tiny", xs[i]), rtol=0, atol=1e-5)


def test_a_callback_that_waits_on_a_future_is_refused(broker: RunningBroker) -> None:
    """A Future's result() inside a completion callback raises DEADLOCK; the request it waited for is still
    sent and answered."""
    x = np.ones((1, 256), np.float32)
    errors: list[ShmBrokerError] = []
    inner: list[Future[Outputs]] = []
    done = threading.Event()

    def callback(out: Outputs | None, err: ShmBrokerError | None) -> None:
        inner.append(c.submit("tiny", x))
        try:
            inner[-1].result(5)
        except ShmBrokerError as exc:
            errors.append(exc)
        done.set()

    with Client() as c:
        c.call("tiny", x, callback)
        assert done.wait(20)
        np.testing.assert_allclose(arr(inner[0].result(20)), direct("tiny", x), rtol=0, atol=1e-5)
    assert [e.code for e in errors] == ["DEADLOCK"]


def test_done_and_result_read_without_the_lock_agree_with_the_standard_future() -> None:
    """ClientFuture's lock-free done() and result() report what a plain Future reports, in every final state."""
    def never(_fut: Future[object], timeout: float | None) -> float | None:
        return timeout

    def futures() -> tuple[ClientFuture[object], Future[object]]:
        return ClientFuture(never, lambda: None), Future()

    ok, plain = futures()
    assert not ok.done() and not plain.done()
    for f in (ok, plain):
        f.set_result({"y": 1})
    assert ok.done() and ok.result(0) == plain.result(0) == {"y": 1}

    failed, plain = futures()
    for f in (failed, plain):
        f.set_exception(ShmBrokerError("model 'tiny' has 9 requests queued", "OVERLOADED"))
    assert failed.done() and plain.done()
    for f in (failed, plain):
        with pytest.raises(ShmBrokerError, match="OVERLOADED"):
            f.result(0)

    cancelled, plain = futures()
    assert cancelled.cancel() and plain.cancel()
    assert cancelled.done() and plain.done() and cancelled.cancelled()
    with pytest.raises(CancelledError):
        cancelled.result(0)
