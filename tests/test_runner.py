"""gpu_worker.runner: the inline choice follows a model's real cost, not one run stretched by the machine."""

from __future__ import annotations

from gpu_worker import model_source
from gpu_worker.batcher import Batcher
from gpu_worker.engines import load_engine
from gpu_worker.intake import ModelView
from gpu_worker.runner import INLINE_BELOW_S, ModelCounters, ModelRunner, Work
from gpu_worker.warmup import prime


def tiny_runner() -> ModelRunner:
    engine = load_engine("onnxruntime", model_source.resolve("builtin:tiny"), device="cpu", intra_op_threads=1)
    view = ModelView(0, "tiny", 8, engine.inputs, engine.outputs, 500)
    batcher: Batcher[Work] = Batcher(8, 0, [], 64)
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
