"""gpu_worker.runner: the inline choice follows a model's real cost, not one run stretched by the machine; several
instances run batches at once, each from its own buffers."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np

from shmbroker.gpu_worker import model_source
from shmbroker.gpu_worker.batcher import Batcher
from shmbroker.gpu_worker.batching import BatchPolicy
from shmbroker.gpu_worker.engines import load_engine
from shmbroker.gpu_worker.engines.base import IOSpec
from shmbroker.gpu_worker.intake import ModelView
from shmbroker.gpu_worker.runner import INLINE_BELOW_S, ModelRunner
from shmbroker.gpu_worker.warmup import prime
from shmbroker.gpu_worker.work import ModelCounters, Work
from tests.conftest import ring_session, ring_work


def tiny_runner() -> ModelRunner:
    engine = load_engine("onnxruntime", model_source.resolve("builtin:tiny"), device="cpu", intra_op_threads=1)
    view = ModelView(0, "tiny", 8, engine.inputs, engine.outputs, 500)
    batcher: Batcher[Work] = Batcher(BatchPolicy(8, 0, (), 64, "triton"))
    return ModelRunner(view, engine, batcher, ModelCounters())


def test_warm_up_finds_tiny_cheap_and_one_stalled_run_does_not_change_that() -> None:
    r = tiny_runner()
    prime(r)
    assert r.cheap, f"tiny measured {r.avg_run_s * 1e6:.0f} us at warm-up"
    r.note_run_time(0.008)  # one run that lost its core for 8 ms
    assert r.cheap
    for _ in range(3):
        r.note_run_time(0.003)
    assert r.cheap, "three outliers in a row must not move a 20 us model to its runner thread"


def test_a_model_that_really_became_costly_goes_to_its_runner_and_comes_back() -> None:
    r = tiny_runner()
    prime(r)
    for _ in range(30):
        r.note_run_time(0.002)
    assert not r.cheap
    for _ in range(30):
        r.note_run_time(INLINE_BELOW_S / 10)
    assert r.cheap


class _BothAtOnce:
    """An engine whose runs return only once two of them are inside ``run`` together: y = 2 x, of the inputs
    as they are after both batches were gathered."""

    def __init__(self) -> None:
        self.inputs = [IOSpec("x", np.dtype("float32"), (-1, 4))]
        self.outputs = [IOSpec("y", np.dtype("float32"), (-1, 4))]
        self.together = threading.Barrier(2, timeout=10)

    def run(self, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        self.together.wait()
        return [feeds["x"] * 2]

    def close(self) -> None:
        pass


def test_two_instances_run_two_batches_at_once_each_from_its_own_inputs(tmp_path: Path) -> None:
    engine = _BothAtOnce()
    view = ModelView(0, "double", 2, engine.inputs, engine.outputs, 5000)
    batcher: Batcher[Work] = Batcher(BatchPolicy(2, 0, (), 64, "triton"))
    runner = ModelRunner(view, engine, batcher, ModelCounters(), instances=2)
    with ring_session(tmp_path) as (session, all_answered):
        xs = [np.full((1, 4), 10.0 * (slot + 1), np.float32) for slot in range(4)]
        batcher.put_many([ring_work(session, slot, x) for slot, x in enumerate(xs)])  # two batches of two
        runner.start()
        answered = all_answered.wait(10)
        runner.stop()
        assert answered, "the two batches did not both finish (did they run at once?)"
        for slot, x in enumerate(xs):
            y = session.segment.output_view(slot, 0, np.dtype("float32"), (1, 4))
            np.testing.assert_array_equal(y, 2 * x, err_msg=f"slot {slot} got another request's outputs")


class _Recording:
    """An engine that notes each run under its name; ``hold`` keeps a run inside until released."""

    def __init__(self, name: str, runs: list[str], hold: threading.Event | None = None) -> None:
        self.inputs = [IOSpec("x", np.dtype("float32"), (-1, 4))]
        self.outputs = [IOSpec("y", np.dtype("float32"), (-1, 4))]
        self.name, self.runs, self.hold = name, runs, hold
        self.entered = threading.Event()

    def run(self, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        self.runs.append(self.name)
        self.entered.set()
        if self.hold is not None:
            assert self.hold.wait(10)
        return [feeds["x"] * 2]

    def close(self) -> None:
        pass


def test_a_batch_that_runs_alone_uses_every_instances_threads(tmp_path: Path) -> None:
    """The lone engine runs a batch that starts with no other batch running; a batch that starts while it
    runs takes the instance's own engine."""
    runs: list[str] = []
    release = threading.Event()
    lone, own = _Recording("lone", runs, release), _Recording("own", runs)
    view = ModelView(0, "double", 1, own.inputs, own.outputs, 5000)
    batcher: Batcher[Work] = Batcher(BatchPolicy(1, 0, (), 64, "triton"))
    runner = ModelRunner(view, own, batcher, ModelCounters(), instances=2, lone=lone)
    with ring_session(tmp_path) as (session, all_answered):
        session.in_flight.difference_update({2, 3})
        runner.start()
        try:
            batcher.put(ring_work(session, 0, np.ones((1, 4), np.float32)))
            assert lone.entered.wait(10)  # alone: on the lone engine, held there
            batcher.put(ring_work(session, 1, np.ones((1, 4), np.float32)))
            assert own.entered.wait(10)  # the other instance, while the first batch still runs
        finally:
            release.set()
        assert all_answered.wait(10)
        runner.stop()
    assert runs == ["lone", "own"]
