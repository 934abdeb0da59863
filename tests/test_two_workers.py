"""Two workers serving the same model (``devices = ["cpu", "cpu"]``, the CPU stand-in for two GPUs):
clients spread their load by least-outstanding choice, and a killed worker leaves the other serving."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from shmbroker.client import Client, WorkerDied
from tests.conftest import RunningBroker, arr, run_client_processes, start_broker
from tests.models import direct

MODELS = """
[models.tiny]
path = "builtin:tiny"
max_batch = 16
max_queue_delay_us = 500
max_queue_size = 1024
timeout_ms = 5000
intra_op_threads = 1
"""
CLIENTS = 4
REQUESTS = 400  # per client
IN_FLIGHT = 6  # per client


@pytest.fixture
def two_workers(tmp_path: Path) -> Iterator[RunningBroker]:
    b = start_broker(tmp_path, "process", extra='[worker]\ndevices = ["cpu", "cpu"]\n', models=MODELS)
    try:
        yield b
    finally:
        assert b.stop_released() == 0, b.log()


def _load(seed: int, runtime_dir: str, q: Any) -> None:
    """A client process keeping IN_FLIGHT requests in flight; reports (seed, ok, wrong)."""
    rng = np.random.default_rng(seed)
    ok = wrong = 0
    with Client(runtime_dir, slots=IN_FLIGHT) as c:
        pending = []
        for _ in range(REQUESTS):
            x = rng.standard_normal((1, 256), dtype=np.float32)
            pending.append((x, c.submit("tiny", x)))
            if len(pending) == IN_FLIGHT:
                x0, f = pending.pop(0)
                good = np.allclose(arr(f.result(30)), direct("tiny", x0), rtol=0, atol=1e-5)
                ok, wrong = ok + good, wrong + (not good)
        for x0, f in pending:
            good = np.allclose(arr(f.result(30)), direct("tiny", x0), rtol=0, atol=1e-5)
            ok, wrong = ok + good, wrong + (not good)
    q.put((seed, ok, wrong))


def _ok_per_worker(b: RunningBroker) -> dict[int, int]:
    return {w.worker_id: sum(m.requests.get("OK", 0) for m in w.models if m.name == "tiny")
            for w in b.stats().workers}


def test_load_spreads_over_both_workers_and_one_survives_the_others_death(two_workers: RunningBroker) -> None:
    b = two_workers
    assert len(b.worker_pids()) == 2
    before = _ok_per_worker(b)
    results = run_client_processes(_load, [(s, str(b.runtime_dir)) for s in range(CLIENTS)], 240)
    assert sum(r[2] for r in results) == 0, results
    assert sum(r[1] for r in results) == CLIENTS * REQUESTS
    after = _ok_per_worker(b)
    counts = [after[w] - before.get(w, 0) for w in sorted(after)]
    assert len(counts) == 2 and sum(counts) >= CLIENTS * REQUESTS, counts
    assert min(counts) >= 0.8 * max(counts), f"per-worker counts {counts} differ by more than 20 %"

    # kill one worker: the other keeps serving, with no action by the client
    victim = b.worker_pids()[0]
    x = np.ones((1, 256), np.float32)
    with Client(b.runtime_dir) as c:
        np.testing.assert_allclose(arr(c.infer("tiny", x)), direct("tiny", x), rtol=0, atol=1e-5)
        os.kill(victim, signal.SIGKILL)
        served = died = 0
        for _ in range(200):
            try:
                np.testing.assert_allclose(arr(c.infer("tiny", x)), direct("tiny", x), rtol=0, atol=1e-5)
                served += 1
            except WorkerDied:
                died += 1  # a request that was routed to the killed worker before its death was known
        print(f"per-worker OK counts {counts}; after the kill: {served} served, {died} WorkerDied")
        assert served >= 190 and died <= 10, (served, died)
