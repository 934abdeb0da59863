"""gpu_worker.pipeline on a device in host memory (tests/hostdevice.py): every request is answered once with its
own result, batches form while the device computes, a failed launch fails its batch only, and a stop answers
what is in flight.

The CUDA runtime is the only part replaced; sessions, rings, the batcher and the runner are the real ones. On a
GPU, tests/gpu/test_pipeline_e2e.py runs the pipeline through a broker."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from shmbroker.broker.common import protocol as P
from shmbroker.gpu_worker.batcher import Batcher
from shmbroker.gpu_worker.intake import ModelView
from shmbroker.gpu_worker.pipeline import PipelineRunner
from shmbroker.gpu_worker.sessions import WorkerSession
from shmbroker.gpu_worker.work import ModelCounters, Work
from tests.conftest import ring_session, ring_work
from tests.hostdevice import DoublingEngine, HostDevice

SLOTS = 32
MAX_BATCH = 8


@pytest.fixture
def session(tmp_path: Path) -> Iterator[tuple[WorkerSession, threading.Event]]:
    with ring_session(tmp_path, SLOTS) as s:
        yield s


def _runner(device: HostDevice, streams: int) -> tuple[PipelineRunner, DoublingEngine]:
    engine = DoublingEngine(device)
    view = ModelView(0, "double", MAX_BATCH, engine.inputs, engine.outputs, 5000)
    batcher: Batcher[Work] = Batcher(MAX_BATCH, 0, [], 256, idle_below=1)
    runner = PipelineRunner(view, engine, batcher, ModelCounters(), streams)
    runner.warm_up()
    engine.batches.clear()
    return runner, engine


def _trickle(runner: PipelineRunner, session: WorkerSession, device: HostDevice) -> list[np.ndarray]:
    """Queue one request per slot as the intake thread does (with its inline launch): the first alone on the
    idle device, where it computes for a second, then the rest in threes, a little apart, so that batches form
    while the device computes however slowly this machine queues them."""
    xs = [np.full((1, 4), float(slot + 1), np.float32) for slot in range(SLOTS)]
    device.stall_s = 1.0
    for slot, x in enumerate(xs):
        runner.batcher.put(ring_work(session, slot, x), wake=not runner.cheap)
        runner.try_inline()
        if slot % 3 == 0:
            time.sleep(0.002)  # the arrival pattern under test, not a wait for readiness
    return xs


@pytest.mark.parametrize("streams", [1, 2, 4])
def test_every_request_gets_its_own_result(host_device: HostDevice, session: tuple[WorkerSession, threading.Event],
                                           streams: int) -> None:
    ws, all_answered = session
    runner, engine = _runner(host_device, streams)
    runner.start()
    try:
        xs = _trickle(runner, ws, host_device)
        assert all_answered.wait(30), f"not every request was answered: {sorted(ws.in_flight)} still in flight"
    finally:
        runner.stop()
    for slot, x in enumerate(xs):
        y = ws.segment.output_view(slot, 0, np.dtype("float32"), (1, 4))
        np.testing.assert_array_equal(y, 2 * x, err_msg=f"slot {slot} got another request's outputs")
    assert sum(engine.batches) == SLOTS
    assert max(engine.batches) > 1, f"batches never formed while the device computed: {engine.batches}"
    assert runner.counters.requests[P.Status.OK.name] == SLOTS
    for stage in ("h2d", "compute", "d2h", "answer"):
        assert runner.stages[stage].snapshot().count == len(engine.batches)


def test_a_stop_answers_every_request_in_flight(host_device: HostDevice,
                                               session: tuple[WorkerSession, threading.Event]) -> None:
    ws, all_answered = session
    host_device.row_s = 0.05  # batches still on the device at the stop
    runner, engine = _runner(host_device, 2)
    runner.start()
    for slot in range(SLOTS):
        runner.batcher.put(ring_work(ws, slot, np.ones((1, 4), np.float32)), wake=not runner.cheap)
        runner.try_inline()
    runner.stop()
    assert all_answered.wait(30), f"{sorted(ws.in_flight)} were never answered"
    answered = runner.counters.requests
    assert answered[P.Status.OK.name] == sum(engine.batches)
    assert answered[P.Status.OK.name] + answered[P.Status.SHUTTING_DOWN.name] == SLOTS



def test_a_launch_that_fails_fails_its_batch_only(host_device: HostDevice,
                                                 session: tuple[WorkerSession, threading.Event]) -> None:
    ws, all_answered = session
    runner, engine = _runner(host_device, 1)
    engine.refuse = -1.0
    bad = 2
    runner.start()
    statuses = []
    ws.in_flight.clear()  # ring_session's event is then set by each answer
    try:
        for slot in range(8):  # one at a time: each request is its own batch on the one stream slot
            all_answered.clear()
            x = np.full((1, 4), -1.0 if slot == bad else float(slot), np.float32)
            runner.batcher.put(ring_work(ws, slot, x), wake=not runner.cheap)
            runner.try_inline()
            assert all_answered.wait(30), f"slot {slot} was never answered"
            statuses.append(ws.segment.read_slot(slot)[3])
    finally:
        runner.stop()
    assert statuses[bad] == P.Status.INTERNAL
    assert [s for i, s in enumerate(statuses) if i != bad] == [P.Status.OK] * 7, "a failed launch harmed others"
    for slot in range(bad + 1, 8):  # the stream slot came back, and later requests got their own results
        y = ws.segment.output_view(slot, 0, np.dtype("float32"), (1, 4))
        np.testing.assert_array_equal(y, np.full((1, 4), 2.0 * slot, np.float32))
    assert runner.counters.requests[P.Status.INTERNAL.name] == 1
