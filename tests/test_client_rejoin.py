"""A broker restart: requests in flight fail WorkerDied, and the same Client serves again once it is back."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import numpy as np
import psutil
import pytest

from shmbroker.client import Client, WorkerDied
from tests.conftest import RunningBroker, arr, start_broker
from tests.models import direct

X = np.ones((1, 256), np.float32)


def _kill(b: RunningBroker) -> None:
    """The broker and its workers die at once, as in a crash (kill -9)."""
    procs = [psutil.Process(b.proc.pid), *psutil.Process(b.proc.pid).children(recursive=True)]
    for p in procs:
        p.kill()
    b.proc.wait(30)
    psutil.wait_procs(procs, timeout=30)


@pytest.mark.parametrize("how", ["sigterm", "crash"])
@pytest.mark.parametrize("mode", ["process", "thread"])
def test_the_same_client_serves_again_after_a_broker_restart(tmp_path: Path, mode: str, how: str) -> None:
    b = start_broker(tmp_path, mode)
    c = Client(b.runtime_dir)
    try:
        np.testing.assert_allclose(arr(c.infer("tiny", X)), direct("tiny", X), rtol=0, atol=1e-5)
        first = c.segment.name
        if how == "sigterm":
            assert b.stop() == 0, b.log()
        else:
            _kill(b)
        with pytest.raises(WorkerDied):  # no broker: fails at once, whichever words say why
            c.infer("tiny", X)
        b = start_broker(tmp_path, mode)  # the same runtime directory, a new instance
        c.wait_ready("tiny", timeout=60)
        assert c.connected and c.segment.name != first  # a ring of the new broker instance
        for _ in range(3):
            np.testing.assert_allclose(arr(c.infer("tiny", X)), direct("tiny", X), rtol=0, atol=1e-5)
        assert len(b.segments()) == 1  # the new session's ring only
    finally:
        c.close()
        assert b.stop() == 0, b.log()


def test_a_request_in_flight_when_the_broker_dies_fails_worker_died(tmp_path: Path) -> None:
    b = start_broker(tmp_path, "process")
    c = Client(b.runtime_dir)
    try:
        c.infer("tiny", X)
        for pid in b.worker_pids():
            os.kill(pid, signal.SIGSTOP)  # the request below stays in flight
        fut = c.submit("tiny", X)
        _kill(b)
        with pytest.raises(WorkerDied):
            fut.result(30)
        b = start_broker(tmp_path, "process")
        c.wait_ready("tiny", timeout=60)
        np.testing.assert_allclose(arr(c.infer("tiny", X)), direct("tiny", X), rtol=0, atol=1e-5)
    finally:
        c.close()
        assert b.stop() == 0, b.log()
