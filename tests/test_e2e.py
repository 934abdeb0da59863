"""End to end over real processes: broker -> worker -> client, in both worker modes (process, thread)."""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import threading
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path

import numpy as np
import pytest

from shmbroker.client import AsyncClient, BadInput, Client, RequestTimeout, UnknownModel
from shmbroker.client.client import Outputs
from tests.conftest import HINT_MODELS, TEST_MODELS, RunningBroker, arr, run_client_processes, start_broker, wait_until
from tests.models import direct


def test_every_batch_size_matches_onnxruntime(broker: RunningBroker) -> None:
    rng = np.random.default_rng(1)
    with Client(max_items=16) as c:
        for rows in range(1, c.models["tiny"].info.max_batch + 1):
            x = rng.standard_normal((rows, 256), dtype=np.float32)
            y = c.infer("tiny", x)
            assert isinstance(y, np.ndarray) and y.shape == (rows, 256)
            np.testing.assert_allclose(y, direct("tiny", x), rtol=0, atol=1e-5)
        for rows in range(1, c.models["nsfw"].info.max_batch + 1):
            x = rng.random((rows, 224, 224, 3), dtype=np.float32)
            y = c.infer("nsfw", x)
            assert isinstance(y, np.ndarray) and y.shape == (rows, 2)
            np.testing.assert_allclose(y, direct("nsfw", x), rtol=0, atol=1e-5)


def test_one_slot_reused_with_other_rows_and_inputs_answers_each_from_its_own(broker: RunningBroker) -> None:
    """The worker keeps views of a slot's tensors per row count (gpu_worker.runner): a slot that comes back
    with other inputs, or with another row count and then the first again, must be read and written afresh."""
    rng = np.random.default_rng(7)
    with Client(slots=1, max_items=4) as c:
        for rows in [1, 1, 3, 1, 2, 3, 1]:
            x = rng.standard_normal((rows, 256), dtype=np.float32)
            y = arr(c.infer("tiny", x))
            assert y.shape == (rows, 256)
            np.testing.assert_allclose(y, direct("tiny", x), rtol=0, atol=1e-5)


def _client_process(seed: int, n: int, runtime_dir: str, q: mp.Queue) -> None:  # type: ignore[type-arg]
    """One of several concurrent clients: its own inputs, 8 in flight, every result checked locally."""
    rng = np.random.default_rng(seed)
    xs = [rng.standard_normal((1 + i % 3, 256), dtype=np.float32) for i in range(n)]
    wrong = 0
    with Client(runtime_dir, slots=8, max_items=4) as c:
        futures = [c.submit("tiny", x) for x in xs[:8]]
        done = 0
        while futures:
            y = arr(futures.pop(0).result(30))
            x = xs[done]
            wrong += int(not np.allclose(y, direct("tiny", x), rtol=0, atol=1e-5))
            done += 1
            if done + len(futures) < n:
                futures.append(c.submit("tiny", xs[done + len(futures)]))
    q.put((seed, done, wrong))


def test_concurrent_clients_get_their_own_results_and_batches_form(broker: RunningBroker) -> None:
    results = run_client_processes(_client_process, [(seed, 300, str(broker.runtime_dir)) for seed in range(4)], 120)
    assert sorted(r[0] for r in results) == [0, 1, 2, 3]
    assert all(done == 300 and wrong == 0 for _s, done, wrong in results), results
    tiny = next(m for w in broker.stats().workers for m in w.models if m.name == "tiny")
    rows = sum(int(k) * v for k, v in tiny.batch_items.items())
    assert rows >= 4 * 300
    assert rows / tiny.batches > 1.0, f"mean batch size {rows / tiny.batches:.2f}: batches did not form"


def test_zero_copy_request_reads_and_writes_in_place(broker: RunningBroker) -> None:
    x = np.random.default_rng(2).standard_normal((2, 256), dtype=np.float32)
    with Client() as c, c.request("tiny", rows=2) as req:
        req.inputs["x"][...] = x
        y = req.run()
        assert isinstance(y, np.ndarray)
        assert not y.flags.owndata  # a view into the ring slot, not a copy
        np.testing.assert_allclose(y, direct("tiny", x), rtol=0, atol=1e-5)


def test_async_client_under_uvloop(broker: RunningBroker) -> None:
    uvloop = pytest.importorskip("uvloop")
    xs = [np.full((1, 256), i / 100, dtype=np.float32) for i in range(40)]

    async def main() -> list[np.ndarray]:
        async with AsyncClient(slots=8) as c:
            outs = await asyncio.gather(*(c.infer("tiny", x) for x in xs))
            return [np.asarray(o) for o in outs]

    outs = uvloop.run(main())
    for x, y in zip(xs, outs, strict=True):
        np.testing.assert_allclose(y, direct("tiny", x), rtol=0, atol=1e-5)


def test_client_side_errors_name_the_field(broker: RunningBroker) -> None:
    with Client() as c:
        with pytest.raises(UnknownModel) as e1:
            c.infer("nope", np.zeros((1, 256), np.float32))
        assert e1.value.code == "UNKNOWN_MODEL"
        with pytest.raises(BadInput) as e2:
            c.infer("tiny", np.zeros((1, 256), np.float64))
        assert e2.value.code == "BAD_DTYPE" and "inputs['x'].dtype" in str(e2.value)
        with pytest.raises(BadInput) as e3:
            c.infer("tiny", np.zeros((1, 255), np.float32))
        assert e3.value.code == "BAD_SHAPE" and "inputs['x'].shape" in str(e3.value)
        with pytest.raises(BadInput) as e4:
            c.infer("tiny", np.zeros((17, 256), np.float32))
        assert e4.value.code == "BAD_SHAPE"
        with pytest.raises(RequestTimeout) as e5:
            c.infer("nsfw", np.zeros((1, 224, 224, 3), np.float32), timeout=1e-6)
        assert e5.value.code == "TIMEOUT"
        x = np.ones((1, 256), np.float32)
        np.testing.assert_allclose(arr(c.infer("tiny", x)), direct("tiny", x), rtol=0, atol=1e-5)


def test_callbacks_can_submit_with_a_single_slot(broker: RunningBroker) -> None:
    """A done-callback runs on the client's IO thread; the slot it finished is free again for the next submit."""
    finished = threading.Event()
    results: list[np.ndarray] = []
    xs = [np.full((1, 256), i, np.float32) for i in range(20)]
    with Client(slots=1) as c:

        def chain(fut: Future[Outputs]) -> None:
            results.append(arr(fut.result()))
            if len(results) == len(xs):
                finished.set()
            else:
                c.submit("tiny", xs[len(results)]).add_done_callback(chain)

        c.submit("tiny", xs[0]).add_done_callback(chain)
        assert finished.wait(60), f"the chain stopped after {len(results)} results"
    for x, y in zip(xs, results, strict=True):
        np.testing.assert_allclose(y, direct("tiny", x), rtol=0, atol=1e-5)


def test_lone_requests_meet_a_short_deadline_with_a_queue_delay(broker: RunningBroker) -> None:
    """tiny waits up to 2 ms for company (max_queue_delay_us); a lone request must still run by its deadline."""
    x = np.ones((1, 256), np.float32)
    with Client() as c:
        for _ in range(10):
            np.testing.assert_allclose(arr(c.infer("tiny", x, timeout=0.25)), direct("tiny", x), rtol=0, atol=1e-5)


def test_call_delivers_outputs_and_errors_to_the_callback(broker: RunningBroker) -> None:
    got: list[tuple[object, object]] = []
    done = threading.Event()
    xs = [np.full((1, 256), i / 7, np.float32) for i in range(6)]

    def callback(outputs: object, error: object) -> None:
        got.append((outputs, error))
        if len(got) == 1:
            raise RuntimeError("a faulty callback must not stop the client")
        if len(got) == len(xs) + 1:
            done.set()

    with Client() as c:
        for x in xs:
            c.call("tiny", x, callback)
        c.call("nsfw", np.zeros((1, 224, 224, 3), np.float32), callback, timeout=1e-6)
        assert done.wait(60), f"{len(got)} callbacks ran"
        np.testing.assert_allclose(arr(c.infer("tiny", xs[0])), direct("tiny", xs[0]), rtol=0, atol=1e-5)
    oks = [arr(o) for o, e in got if e is None]
    errors = [e for o, e in got if e is not None]
    assert len(oks) == len(xs) and all(o is None for o, e in got if e is not None)
    assert len(errors) == 1 and isinstance(errors[0], RequestTimeout)
    for y in oks:  # each output is one of the inputs' results (callbacks may run in any order)
        assert min(float(np.abs(y - direct("tiny", x)).max()) for x in xs) < 1e-5


class _CountingPush:
    """A link's PUSH socket that counts the SUBMITs sent through it."""

    def __init__(self, sock: object) -> None:
        self.sock = sock
        self.sent = 0

    def send_multipart(self, frames: list[bytes], *args: object, **kwargs: object) -> object:
        self.sent += 1
        return self.sock.send_multipart(frames, *args, **kwargs)  # type: ignore[attr-defined]

    def __getattr__(self, name: str) -> object:
        return getattr(self.sock, name)


@pytest.mark.parametrize("worker_mode", ["process", "thread"])
def test_blocking_calls_send_no_submit_for_a_request_the_worker_took_from_its_hint(
        tmp_path: Path, worker_mode: str) -> None:
    """infer() and Request.run() get the right answers either way; a spinning worker (process mode) takes some
    requests from their slot header and clears the hint, and those requests' SUBMITs are never sent. A worker
    that never spins (thread mode) gets every SUBMIT."""
    models = HINT_MODELS
    b = start_broker(tmp_path, worker_mode, models=models)
    try:
        rng = np.random.default_rng(5)
        xs = [rng.standard_normal((1, 256), dtype=np.float32) for _ in range(32)]
        refs = [direct("tiny", x) for x in xs]  # beforehand: the worker spins only while requests come quickly
        n = 600
        got = []
        with Client(b.runtime_dir) as c:
            link = c._links.current[0]
            counting = _CountingPush(link.push)
            link.push = counting  # type: ignore[assignment]
            for i in range(n):
                x = xs[i % len(xs)]
                if i % 10 == 9:
                    with c.request("tiny") as req:
                        req.inputs["x"][...] = x
                        got.append(arr(req.run()).copy())
                else:
                    got.append(arr(c.infer("tiny", x)))
            link.push = counting.sock  # type: ignore[assignment]
        for i, y in enumerate(got):
            np.testing.assert_allclose(y, refs[i % len(xs)], rtol=0, atol=1e-5)
        if worker_mode == "process":
            assert counting.sent < n, "no request was taken from its hint"
        else:
            assert counting.sent == n
    finally:
        assert b.stop() == 0, b.log()


def _nsfw_client(seed: int, runtime_dir: str, q: mp.Queue) -> None:  # type: ignore[type-arg]
    """Eight 2-image nsfw requests in flight at once; how many came back different from onnxruntime's."""
    rng = np.random.default_rng(seed)
    xs = [rng.random((2, 224, 224, 3), dtype=np.float32) for _ in range(8)]
    with Client(runtime_dir, slots=8, max_items=2) as c:
        futures = [c.submit("nsfw", x) for x in xs]
        ys = [arr(f.result(60)) for f in futures]
    q.put(sum(int(not np.allclose(y, direct("nsfw", x), rtol=0, atol=1e-5)) for x, y in zip(xs, ys, strict=True)))


@pytest.mark.parametrize("worker_mode", ["process", "thread"])
def test_instances_run_batches_at_once_and_each_batch_answers_its_own_requests(
        tmp_path: Path, worker_mode: str) -> None:
    """``instances = 2``: two batches gathered and run at the same time (each instance has its own batch
    buffers), from two processes' requests; every request gets the outputs of its own images."""
    models = TEST_MODELS.replace("max_queue_size = 3\n", "max_queue_size = 64\ninstances = 2\nintra_op_threads = 1\n")
    b = start_broker(tmp_path, worker_mode, models=models)
    try:
        wrong = run_client_processes(_nsfw_client, [(s, str(b.runtime_dir)) for s in (11, 12)], timeout=180)
        assert wrong == [0, 0]
    finally:
        assert b.stop() == 0, b.log()


IDLE_MODELS = """
[models.tiny]
path = "builtin:tiny"
max_batch = 16
max_queue_delay_us = 10000000
max_queue_size = 64
timeout_ms = 2000
intra_op_threads = 1
batching = "{rule}"
"""


@pytest.mark.parametrize("worker_mode", ["process", "thread"])
@pytest.mark.parametrize("idle", [True, False])
def test_idle_dispatch_runs_a_lone_request_without_the_queue_delay(tmp_path: Path, worker_mode: str,
                                                                   idle: bool) -> None:
    """A queue delay of 10 s against a 2 s deadline: with idle dispatch the idle runner takes the lone request
    at once and it succeeds; by Triton's rule it waits for company until its deadline passes."""
    b = start_broker(tmp_path, worker_mode, models=IDLE_MODELS.format(rule="idle" if idle else "triton"))
    x = np.full((1, 256), 0.5, np.float32)
    try:
        with Client(b.runtime_dir) as c:
            for _ in range(3):
                if idle:
                    np.testing.assert_allclose(arr(c.infer("tiny", x)), direct("tiny", x), rtol=0, atol=1e-5)
                else:
                    with pytest.raises(RequestTimeout):
                        c.infer("tiny", x)
    finally:
        assert b.stop() == 0, b.log()


GROUPED_MODELS = """
[models.tiny]
path = "builtin:tiny"
max_batch = 4
max_queue_delay_us = 10000000
max_queue_size = 64
timeout_ms = 6000
intra_op_threads = 1
batching = "triton"
batch_by_session = {grouped}
"""


@pytest.mark.parametrize("worker_mode", ["process", "thread"])
@pytest.mark.parametrize("grouped", [True, False])
def test_batch_by_session_takes_a_clients_queued_requests_together(tmp_path: Path, worker_mode: str,
                                                                     grouped: bool) -> None:
    """Client A's 2 rows, then B's 1 row, then A's 2 more, 4 rows a batch and a queue delay of 10 s against a
    6 s deadline (room for the stats round trips between the sends): by session, A's two requests make the batch
    and B's waits until its deadline passes; in arrival order, A's first and B's make it and A's second times
    out."""
    b = start_broker(tmp_path, worker_mode, models=GROUPED_MODELS.format(grouped=str(grouped).lower()))
    rows = {"a1": np.full((2, 256), 0.25, np.float32), "b1": np.full((1, 256), -0.5, np.float32),
            "a2": np.full((2, 256), 0.75, np.float32)}
    got: dict[str, np.ndarray | Exception] = {}
    all_in = threading.Event()

    def answered(name: str) -> Callable[[Outputs | None, Exception | None], None]:
        def done(out: Outputs | None, err: Exception | None) -> None:
            got[name] = err if err is not None else arr(out)
            if len(got) == len(rows):
                all_in.set()
        return done

    def queued(n: int) -> Callable[[], bool]:
        return lambda: b.stats().workers[0].models[0].queue_depth == n

    try:
        with Client(b.runtime_dir) as ca, Client(b.runtime_dir) as cb:
            for c, name, depth in ((ca, "a1", 1), (cb, "b1", 2), (ca, "a2", 0)):
                c.call("tiny", rows[name], answered(name))
                if depth:  # in the queue before the next is sent, so that the arrival order is known
                    wait_until(queued(depth), f"{name} queued")
            assert all_in.wait(30)
    finally:
        assert b.stop() == 0, b.log()
    late = "b1" if grouped else "a2"
    assert isinstance(got[late], RequestTimeout), got[late]
    for name in set(rows) - {late}:
        out = got[name]
        assert isinstance(out, np.ndarray), out
        np.testing.assert_allclose(out, direct("tiny", rows[name]), rtol=0, atol=1e-5)


def test_an_async_request_cancelled_while_in_flight_frees_its_slot(broker: RunningBroker) -> None:
    """A task cancelled while it awaits infer() gets CancelledError; its slot comes back with the answer, so
    later requests on a one-slot client run, and they get their own answers."""
    x, y = np.full((1, 256), 0.5, np.float32), np.full((1, 256), -0.5, np.float32)

    async def main() -> np.ndarray:
        async with AsyncClient(slots=1) as c:
            await c.infer("tiny", x)  # linked and warm
            task = asyncio.ensure_future(c.infer("tiny", x))
            await asyncio.sleep(0)  # the request is written and sent
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            return np.asarray(await asyncio.wait_for(c.infer("tiny", y), 20))

    np.testing.assert_allclose(asyncio.run(main()), direct("tiny", y), rtol=0, atol=1e-5)
