"""client.lead: callers that wait in infer() receive answers themselves; futures and callbacks still complete."""

from __future__ import annotations

import os
import signal
import threading
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import pytest

from shmbroker.client import Client, WorkerDied
from shmbroker.client.client import Outputs
from shmbroker.client.errors import ShmBrokerError
from shmbroker.client.receiving import SLOT_ANSWERS
from tests.conftest import RunningBroker, arr, count_slot_answers
from tests.models import direct


def test_infer_threads_futures_and_callbacks_share_one_client(broker: RunningBroker) -> None:
    """Three threads in infer(), one with futures and one with callbacks, on one client: all answers right."""
    wrong: list[str] = []
    rounds = 150

    def infer_loop(seed: int, c: Client) -> None:
        rng = np.random.default_rng(seed)
        for _ in range(rounds):
            x = rng.standard_normal((1, 256), dtype=np.float32)
            if not np.allclose(arr(c.infer("tiny", x)), direct("tiny", x), rtol=0, atol=1e-5):
                wrong.append(f"infer thread {seed}")

    def future_loop(c: Client) -> None:
        rng = np.random.default_rng(99)
        for _ in range(rounds // 3):
            xs = [rng.standard_normal((1, 256), dtype=np.float32) for _ in range(3)]
            futs = [c.submit("tiny", x) for x in xs]
            for x, f in zip(xs, futs, strict=True):
                if not np.allclose(arr(f.result(20)), direct("tiny", x), rtol=0, atol=1e-5):
                    wrong.append("future")

    def callback_loop(c: Client) -> None:
        rng = np.random.default_rng(7)
        for _ in range(rounds // 3):
            x = rng.standard_normal((1, 256), dtype=np.float32)
            got: Future[Outputs | None] = Future()

            def deliver(out: Outputs | None, err: ShmBrokerError | None, got: Future[Outputs | None] = got) -> None:
                if err is not None:
                    got.set_exception(err)
                else:
                    got.set_result(out)

            c.call("tiny", x, deliver)
            if not np.allclose(arr(got.result(20)), direct("tiny", x), rtol=0, atol=1e-5):
                wrong.append("callback")

    with Client(slots=16) as c, ThreadPoolExecutor(5) as pool:
        jobs = [pool.submit(infer_loop, s, c) for s in range(3)]
        jobs += [pool.submit(future_loop, c), pool.submit(callback_loop, c)]
        for j in jobs:
            j.result(120)  # re-raises any error a thread met
    assert wrong == []


def test_a_callback_that_waits_is_refused(broker: RunningBroker) -> None:
    """A callback runs on the IO thread or on a thread leading in infer(); either way it may not block."""
    x = np.ones((1, 256), np.float32)
    errors: list[ShmBrokerError] = []
    done = threading.Event()

    def callback(out: Outputs | None, err: ShmBrokerError | None) -> None:
        try:
            c.infer("tiny", x)
        except ShmBrokerError as exc:
            errors.append(exc)
        done.set()

    with Client() as c:
        for _ in range(20):  # some of these callbacks are run by the infer() below, some by the IO thread
            done.clear()
            c.call("tiny", x, callback)
            np.testing.assert_allclose(arr(c.infer("tiny", x)), direct("tiny", x), rtol=0, atol=1e-5)
            assert done.wait(20)
    assert len(errors) == 20 and all(e.code == "DEADLOCK" for e in errors)


def test_worker_killed_while_a_caller_waits_in_infer(process_broker: RunningBroker) -> None:
    """The waiting caller gets WorkerDied (or its answer, if it came first), not a hang until its deadline."""
    b = process_broker
    x = np.zeros((1, 224, 224, 3), np.float32)
    with Client(b.runtime_dir) as c, ThreadPoolExecutor(1) as pool:
        c.infer("nsfw", x)
        started = threading.Event()

        def slow() -> str:
            started.set()
            try:
                c.infer("nsfw", x, timeout=60)
            except WorkerDied:
                return "died"
            return "answered"

        job = pool.submit(slow)
        assert started.wait(10)
        (worker,) = b.worker_pids()
        os.kill(worker, signal.SIGKILL)
        assert job.result(30) in {"died", "answered"}  # 30 s: well inside the request's 60 s deadline
        c.wait_ready("tiny", timeout=60)
        y = np.ones((1, 256), np.float32)
        np.testing.assert_allclose(arr(c.infer("tiny", y)), direct("tiny", y), rtol=0, atol=1e-5)


@pytest.mark.skipif(not SLOT_ANSWERS, reason="answers are read from the slot header only on x86-64 (TSO)")
def test_infer_reads_answers_from_the_slot_header_and_skips_their_late_done(
        broker: RunningBroker, monkeypatch: pytest.MonkeyPatch) -> None:
    """A spinning caller completes from the slot header; the DONE message that follows completes nothing else."""
    from_header = count_slot_answers(monkeypatch)
    rng = np.random.default_rng(11)
    with Client(spin_us=200_000, slots=2) as c:  # two slots: each is reused while its late DONE may be on the way
        for _ in range(300):
            x = rng.standard_normal((1, 256), dtype=np.float32)
            np.testing.assert_allclose(arr(c.infer("tiny", x)), direct("tiny", x), rtol=0, atol=1e-5)
        xs = [rng.standard_normal((1, 256), dtype=np.float32) for _ in range(2)]
        futs = [c.submit("tiny", x) for x in xs]  # the IO thread receives these, behind any late DONEs
        for f, x in zip(futs, xs, strict=True):
            np.testing.assert_allclose(arr(f.result(20)), direct("tiny", x), rtol=0, atol=1e-5)
    assert from_header() > 0

