"""``PatientAsk``: a question to the broker outlives the broker's restart, against real ``serve`` processes."""

from __future__ import annotations

import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import msgspec
import pytest

from shmbroker.broker.common import protocol as P
from shmbroker.broker.common.ask import NoAnswer, PatientAsk
from tests.conftest import TEST_MODELS, launch_broker, wait_until

TINY_ONLY = TEST_MODELS.split("[models.nsfw]")[0]


def test_a_question_held_by_a_broker_that_stops_is_asked_again_of_the_next(tmp_path: Path) -> None:
    """A HEALTH wait held by a broker that is not ready (its worker dead, restarted only after a minute) is lost
    when that broker stops; it is asked again on the new broker's connection, which answers it."""
    a = launch_broker(tmp_path, models=TINY_ONLY, extra="restart_backoff_ms = 60000", name="a")
    try:
        assert a.health(wait_s=90).ready, a.log()
        (worker,) = a.worker_pids()
        os.kill(worker, signal.SIGKILL)
        wait_until(lambda: not a.health().ready, "the broker sees its worker dead")
        asked: list[float] = []
        sent = threading.Event()

        def question(left: float) -> msgspec.Struct:
            asked.append(left)
            sent.set()
            return P.Health(wait_ms=int(left * 1000))

        with PatientAsk(a.runtime_dir) as asker, ThreadPoolExecutor(1) as pool:
            answer = pool.submit(asker.ask, question, time.monotonic() + 120)
            assert sent.wait(60), "the question never went out"
            assert a.stop() == 0, a.log()  # holds the question: it answers a HEALTH wait only when ready
            b = launch_broker(tmp_path, models=TINY_ONLY, name="b")
            try:
                reply = answer.result(150)
            finally:
                assert b.stop() == 0, b.log()
        assert isinstance(reply, P.HealthReply) and reply.ready, reply
        assert len(asked) >= 2 and asked[1] < asked[0], asked  # asked again, with the time left then
    finally:
        a.stop()


def test_no_broker_is_told_at_the_deadline_with_what_was_seen(tmp_path: Path) -> None:
    with PatientAsk(tmp_path) as asker, pytest.raises(NoAnswer, match=r"broker\.sock does not exist") as info:
        asker.ask(lambda _left: P.Health(0), time.monotonic() + 0.3)
    assert not info.value.connected
