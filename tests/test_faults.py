"""Processes die (issue 5, items 1-3): a worker, a client, the broker. Real processes, /dev/shm and ZeroMQ.

What a user sees is counted: every request submitted ends as a right result or an error with a code;
none hangs and none gets another request's result.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import numpy as np
import psutil
import pytest

from client import Client
from tests.conftest import RunningBroker, arr, start_broker
from tests.faultload import LoadGroup, LoadSpec, Tally
from tests.test_e2e import direct

TINY = """
[models.tiny]
path = "builtin:tiny"
max_batch = 16
max_queue_delay_us = 1000
max_queue_size = 256
timeout_ms = 2000
intra_op_threads = 1
"""
X = np.ones((1, 256), np.float32)
CLIENTS = 4


def wait_for_new_worker(b: RunningBroker, old: int, limit: float = 30.0) -> float:
    """Seconds until the broker has started a worker process other than ``old`` (a measurement, polled)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < limit:
        pids = b.worker_pids()
        if pids and old not in pids:
            return time.monotonic() - t0
        time.sleep(0.005)
    raise AssertionError(f"no new worker within {limit} s\n{b.log()}")


def assert_accounted(t: Tally) -> None:
    assert t.submitted == t.ok + t.failed_total + t.wrong + t.hung, t
    assert t.hung == 0, t
    assert t.wrong == 0, t
    assert not any(k.startswith("unexpected") for k in t.failed), t.failed


def test_worker_killed_under_load(tmp_path: Path) -> None:
    """Item 1: SIGKILL the worker under 4 client processes; every request completes or fails WORKER_DIED."""
    b = start_broker(tmp_path, "process", models=TINY)
    group = None
    try:
        group = LoadGroup([LoadSpec(b.runtime_dir, in_flight=4, seed=i, hung_after_s=15) for i in range(CLIENTS)])
        time.sleep(1.0)  # load runs for a while before the kill (a duration, not a readiness wait)
        (worker,) = b.worker_pids()
        t_kill = time.monotonic()
        os.kill(worker, signal.SIGKILL)
        restart_s = wait_for_new_worker(b, worker)
        ready = b.health(wait_s=60)
        assert ready.ready, ready.reason
        ready_s = time.monotonic() - t_kill
        group.mark.value = time.time()
        time.sleep(1.5)  # clients keep going on their own: no reconnect, no action
        t = group.finish()
        group = None
        print(f"worker killed: restarted after {restart_s:.3f} s, READY after {ready_s:.2f} s; "
              f"{t.submitted} submitted, {t.ok} ok, failed {t.failed}, {t.ok_after_mark} ok once it was ready")
        assert_accounted(t)
        assert set(t.failed) <= {"WorkerDied", "RequestTimeout"}, t.failed
        assert t.failed.get("WorkerDied", 0) >= 1, "the kill should have caught requests in flight"
        assert restart_s < 2.0, f"the broker took {restart_s:.2f} s to restart the worker"
        assert t.ok_after_mark >= CLIENTS, t  # new requests succeed without the clients doing anything
        assert b.stats().workers[0].restarts == 1
    finally:
        if group is not None:
            group.kill()
        assert b.stop() == 0, b.log()
        assert not b.segments()


@pytest.fixture
def tiny_broker(tmp_path: Path):
    b = start_broker(tmp_path, "process", models=TINY)
    try:
        yield b
    finally:
        assert b.stop() == 0, b.log()
        assert not b.segments()


def test_new_client_after_worker_restart(tiny_broker: RunningBroker) -> None:
    (worker,) = tiny_broker.worker_pids()
    os.kill(worker, signal.SIGKILL)
    wait_for_new_worker(tiny_broker, worker)
    assert tiny_broker.health(wait_s=60).ready
    with Client(tiny_broker.runtime_dir) as c:
        np.testing.assert_allclose(arr(c.infer("tiny", X)), direct("tiny", X), rtol=0, atol=1e-5)
    assert psutil.pid_exists(tiny_broker.proc.pid)
