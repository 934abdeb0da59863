"""gpu_worker.pipeline on a device in host memory (tests/hostdevice.py): every request is answered once with its
own result under each policy (BatchPolicy's GPU keys), batches form while the device computes and need no
padding, only a batch launched while another runs waits for its compute, requests one at a time keep to one
stream slot, batches fill on the device with early copies, a failed launch fails its batch only, and a stop
answers what is in flight, mid-fill too.

The CUDA runtime is the only part replaced; sessions, rings, the batcher and the runner are the real ones. On a
GPU, tests/gpu/test_pipeline_e2e.py runs the pipeline through a broker."""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

from shmbroker.broker.common import protocol as P
from shmbroker.gpu_worker.batcher import Batcher, Take
from shmbroker.gpu_worker.batching import BatchPolicy
from shmbroker.gpu_worker.intake import ModelView
from shmbroker.gpu_worker.pipeline import PipelineRunner
from shmbroker.gpu_worker.sessions import WorkerSession
from shmbroker.gpu_worker.streams import StreamSlot
from shmbroker.gpu_worker.work import ModelCounters, Work
from tests.conftest import ring_session, ring_work, wait_until
from tests.hostdevice import DoublingEngine, HostDevice

SLOTS = 32
MAX_BATCH = 8


@pytest.fixture
def session(tmp_path: Path) -> Iterator[tuple[WorkerSession, threading.Event]]:
    with ring_session(tmp_path, SLOTS) as s:
        yield s


def _runner(device: HostDevice, streams: int,
            policy: BatchPolicy | None = None) -> tuple[PipelineRunner, DoublingEngine, list[int]]:
    """A warm runner; the list gets the rows that each batch filled on the device (``_fill``) opened with."""
    engine = DoublingEngine(device)
    view = ModelView(0, "double", MAX_BATCH, engine.inputs, engine.outputs, 5000)
    batcher: Batcher[Work] = Batcher(policy or _policy())
    runner = PipelineRunner(view, engine, batcher, ModelCounters(), streams)
    runner.warm_up()
    engine.batches.clear()
    filled: list[int] = []
    fill = runner._fill

    def counting_fill(slot: StreamSlot, take: Take[Work]) -> None:
        filled.append(len(take.batch))
        fill(slot, take)

    runner._fill = counting_fill  # type: ignore[method-assign]
    return runner, engine, filled


def _policy(**gpu: bool) -> BatchPolicy:
    """Idle dispatch with no delay, and the given GPU keys."""
    return BatchPolicy(MAX_BATCH, 0, (), 256, "idle", executors=1, **gpu)


def _answered(session: WorkerSession, slot: int) -> bool:
    return slot not in session.in_flight


def _completed(runner: PipelineRunner, batches: int) -> bool:
    """The completion thread is through ``batches`` batches: answered, stream slots back, stages recorded."""
    return runner.stages["answer"].snapshot().count == batches


def _trickle(runner: PipelineRunner, session: WorkerSession, device: HostDevice, start: int = 0) -> list[np.ndarray]:
    """Queue one request per slot from ``start`` as the intake thread does (with its inline launch): the first
    alone on the idle device, where it computes for a second, then the rest in threes, a little apart, so that
    batches form while the device computes however slowly this machine queues them."""
    xs = [np.full((1, 4), float(slot + 1), np.float32) for slot in range(SLOTS)]
    device.stall_s = 1.0
    for slot, x in enumerate(xs[start:], start):
        runner.batcher.put(ring_work(session, slot, x), wake=not runner.cheap)
        runner.try_inline()
        if slot % 3 == 0:
            time.sleep(0.002)  # the arrival pattern under test, not a wait for readiness
    return xs


POLICIES = {
    "default": _policy(), "shared": _policy(serial_compute=False),
    "off": _policy(fill_while_busy=False, trim_to_sizes=False),
    "early": _policy(early_copies=True), "early-shared": _policy(early_copies=True, serial_compute=False),
}


@pytest.mark.parametrize(("streams", "policy"), [(1, "default"), (2, "default"), (4, "default"),
                                                 *[(2, name) for name in POLICIES if name != "default"]])
def test_every_request_gets_its_own_result(host_device: HostDevice, session: tuple[WorkerSession, threading.Event],
                                           streams: int, policy: str) -> None:
    ws, all_answered = session
    runner, engine, filled = _runner(host_device, streams, POLICIES[policy])
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
    for stage in ("h2d", "wait", "compute", "d2h", "wake", "answer"):
        assert runner.stages[stage].snapshot().count == len(engine.batches)
    if POLICIES[policy].early_copies:
        assert filled, "no batch filled on the device while another computed"


def test_while_a_batch_computes_the_next_takes_a_size_that_needs_no_padding(
        host_device: HostDevice, session: tuple[WorkerSession, threading.Event]) -> None:
    ws, all_answered = session
    runner, _, _ = _runner(host_device, 2, _policy(fill_while_busy=False))
    formed: list[tuple[int, int]] = []  # (batches running, rows) as each batch formed
    pop = runner.batcher._pop_batch

    def recording() -> list[Work]:
        running = runner.batcher.running
        batch = pop()
        formed.append((running, sum(w.rows for w in batch)))
        return batch

    runner.batcher._pop_batch = recording  # type: ignore[method-assign]
    runner.start()
    try:
        _trickle(runner, ws, host_device)
        assert all_answered.wait(30)
    finally:
        runner.stop()
    # a batch that formed on the idle device takes whatever was there; one formed while another ran, no padding
    busy = [rows for running, rows in formed if running]
    assert busy, f"no batch formed while another ran: {formed}"
    assert all(rows in (1, 2, 4, 8) for rows in busy), f"a batch formed while another ran was padded: {formed}"


def test_only_a_batch_launched_while_another_runs_waits_for_its_compute(
        host_device: HostDevice, session: tuple[WorkerSession, threading.Event]) -> None:
    ws, all_answered = session
    runner, engine, _ = _runner(host_device, 2)  # serial_compute, the default
    waits: list[int] = []  # for each wait of a stream on another batch's compute: the batches enqueued before it
    for stream_slot in runner.slots:
        wait = stream_slot.stream.wait

        def counting_wait(event: object, wait: object = wait) -> None:
            waits.append(len(engine.batches))
            wait(event)  # type: ignore[operator]

        stream_slot.stream.wait = counting_wait  # type: ignore[method-assign]
    runner.start()
    try:
        for slot in range(2):  # one at a time: each runs alone, after the one before it has ended
            runner.batcher.put(ring_work(ws, slot, np.ones((1, 4), np.float32)), wake=not runner.cheap)
            runner.try_inline()
            wait_until(functools.partial(_answered, ws, slot), f"request {slot} answered")
        assert waits == [], f"a batch alone on the idle device waited for another's compute ({waits})"
        _trickle(runner, ws, host_device, start=2)
        assert all_answered.wait(30)
    finally:
        runner.stop()
    assert waits, f"no batch launched while another ran waited for its compute, batches {engine.batches}"
    waited = runner.stages["wait"].snapshot()
    assert waited.count == len(engine.batches) and waited.max_us > 0, f"no wait in the stages: {waited}"


def test_requests_one_at_a_time_run_on_one_stream_slot(host_device: HostDevice,
                                                       session: tuple[WorkerSession, threading.Event]) -> None:
    ws, _ = session
    runner, _, _ = _runner(host_device, 4)
    used: list[int] = []  # the stream slot of each batch
    for stream_slot in runner.slots:
        enqueue = stream_slot.ctx.enqueue

        def recording(rows: int, enqueue: Callable[[int], None] = enqueue, index: int = stream_slot.index) -> None:
            used.append(index)
            enqueue(rows)

        stream_slot.ctx.enqueue = recording  # type: ignore[method-assign]
    runner.start()
    try:
        for slot in range(6):
            runner.batcher.put(ring_work(ws, slot, np.ones((1, 4), np.float32)), wake=not runner.cheap)
            runner.try_inline()
            wait_until(functools.partial(_completed, runner, slot + 1), f"request {slot}'s batch completed")
    finally:
        runner.stop()
    assert len(used) == 6 and len(set(used)) == 1, f"lone requests went round the stream slots: {used}"


def _watched_lone(runner: PipelineRunner, ws: WorkerSession, slot: int) -> np.ndarray:
    """Queue one request in ``slot`` and launch it from this thread, watched, as the spinning intake thread does."""
    x = np.full((1, 4), float(slot + 1), np.float32)
    runner.batcher.put(ring_work(ws, slot, x), wake=not runner.cheap)
    if not runner.try_inline(watch=True):
        raise AssertionError(f"request {slot} did not launch on the idle device")
    return x


def test_a_watched_lone_batch_is_answered_by_the_thread_that_sees_its_end(
        host_device: HostDevice, session: tuple[WorkerSession, threading.Event]) -> None:
    ws, _ = session
    host_device.row_s = 0.0005  # a batch short enough to be watched (POLL_END_MAX_MS)
    runner, _, _ = _runner(host_device, 2)
    runner.start()
    try:
        x = _watched_lone(runner, ws, 0)
        wait_until(runner.end_seen, "the watched batch was answered by the thread that polled its end")
        assert _answered(ws, 0)
    finally:
        runner.stop()
    np.testing.assert_array_equal(ws.segment.output_view(0, 0, np.dtype("float32"), (1, 4)), 2 * x)
    assert runner.stages["answer"].snapshot().count == 1


def test_watched_batches_reach_the_completion_thread_on_the_next_launch_on_unwatch_and_on_stop(
        host_device: HostDevice, session: tuple[WorkerSession, threading.Event]) -> None:
    """Nobody polls the ends here: a watched batch is answered only once a later launch, ``unwatch`` or the
    stop hands it over."""
    ws, _ = session
    host_device.row_s = 0.0005
    runner, _, _ = _runner(host_device, 2)
    runner.start()
    try:
        xs = [_watched_lone(runner, ws, 0)]
        wait_until(functools.partial(_device_idle, host_device), "the watched batch ended on the device")
        assert not _answered(ws, 0), "a watched batch was answered with nobody polling its end"
        xs.append(np.full((1, 4), 2.0, np.float32))
        runner.batcher.put(ring_work(ws, 1, xs[1]), wake=not runner.cheap)
        assert not runner.try_inline(watch=True)  # the watched batch still counts as running: the runner launches
        wait_until(lambda: not {0, 1} & ws.in_flight, "both batches answered by the completion thread")
        xs.append(_watched_lone(runner, ws, 2))
        runner.unwatch()
        wait_until(functools.partial(_answered, ws, 2), "the unwatched batch answered")
        xs.append(_watched_lone(runner, ws, 3))
    finally:
        runner.stop()
    assert not {0, 1, 2, 3} & ws.in_flight, f"{sorted({0, 1, 2, 3} & ws.in_flight)} were never answered"
    for slot, x in enumerate(xs):
        np.testing.assert_array_equal(ws.segment.output_view(slot, 0, np.dtype("float32"), (1, 4)), 2 * x)


def _device_idle(device: HostDevice) -> bool:
    return all(time.monotonic() >= s.at for s in list(device.streams.values()))


def test_a_stop_answers_every_request_in_flight(host_device: HostDevice,
                                               session: tuple[WorkerSession, threading.Event]) -> None:
    ws, all_answered = session
    host_device.row_s = 0.05  # batches still on the device at the stop
    runner, engine, _ = _runner(host_device, 2)
    runner.start()
    for slot in range(SLOTS):
        runner.batcher.put(ring_work(ws, slot, np.ones((1, 4), np.float32)), wake=not runner.cheap)
        runner.try_inline()
    runner.stop()
    assert all_answered.wait(30), f"{sorted(ws.in_flight)} were never answered"
    answered = runner.counters.requests
    assert answered[P.Status.OK.name] == sum(engine.batches)
    assert answered[P.Status.OK.name] + answered[P.Status.SHUTTING_DOWN.name] == SLOTS


def test_a_stop_while_a_batch_fills_answers_every_request(host_device: HostDevice,
                                                          session: tuple[WorkerSession, threading.Event]) -> None:
    ws, all_answered = session
    host_device.stall_s = 1.0  # the first batch computes long enough for the next to be filling at the stop
    runner, _, filled = _runner(host_device, 2, _policy(early_copies=True))
    runner.start()
    for slot in range(3):
        runner.batcher.put(ring_work(ws, slot, np.ones((1, 4), np.float32)), wake=not runner.cheap)
        runner.try_inline()
    deadline = time.monotonic() + 30
    while not filled and time.monotonic() < deadline:
        time.sleep(0.001)  # until the runner thread has opened a filling batch (a test's poll, no product wait)
    assert filled
    ws.in_flight.difference_update(range(3, SLOTS))  # only the three requests are in flight
    runner.stop()
    assert all_answered.wait(30), f"{sorted(ws.in_flight)} were never answered"


def test_a_launch_that_fails_fails_its_batch_only(host_device: HostDevice,
                                                 session: tuple[WorkerSession, threading.Event]) -> None:
    ws, all_answered = session
    runner, engine, _ = _runner(host_device, 1)
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

