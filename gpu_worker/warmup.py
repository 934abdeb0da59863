"""Warm-up: run each model once at the smallest and largest batch and check what comes out."""

from __future__ import annotations

import time

import numpy as np

from shmbroker.gpu_worker.engines.base import Engine, EngineError
from shmbroker.gpu_worker.intake import ModelView
from shmbroker.gpu_worker.runner import BatchRunner, Progress, quiet


def prime(runner: BatchRunner, progress: Progress = quiet) -> None:
    """Warm a model up before READY: the engine (outputs checked, one-row time measured), then the runner's
    own resources (a GPU pipeline runs each stream slot's context at 1 and ``max_batch`` rows), telling
    ``progress`` each step.

    The one-row time primes the inline choice of a host engine; a GPU runner launches inline only while its
    device is idle, whatever the time.
    """
    progress(f"warming up its engine at 1 and {runner.model.max_batch} rows")
    runner.avg_run_s = warm_up(runner.engine, runner.model)
    runner.warm_up(progress)


def warm_up(engine: Engine, model: ModelView, repeats: int = 5) -> float:
    """Raise EngineError unless batches of 1 and max_batch rows give outputs of the declared shapes.

    Returns the median CPU seconds of a one-row run on this thread, which primes the runner's choice of running inline.
    """
    one = {s.name: np.zeros((1, *s.item_shape), dtype=s.dtype) for s in engine.inputs}
    times = []
    for _ in range(repeats):
        t0 = time.thread_time()  # as the runner measures it: CPU time, not the machine's noise
        engine.run(one)
        times.append(time.thread_time() - t0)
    for rows in sorted({1, model.max_batch}):
        feeds = {s.name: np.zeros((rows, *s.item_shape), dtype=s.dtype) for s in engine.inputs}
        outputs = engine.run(feeds)
        if len(outputs) != len(model.outputs):
            raise EngineError(f"model {model.name!r} returned {len(outputs)} outputs, declared {len(model.outputs)}")
        for arr, spec in zip(outputs, model.outputs, strict=True):
            want = (rows, *spec.item_shape)
            if tuple(arr.shape) != want or arr.dtype != spec.dtype:
                raise EngineError(
                    f"model {model.name!r} output {spec.name!r} came back {arr.dtype}{list(arr.shape)}, "
                    f"declared {spec.dtype}{list(want)}"
                )
    return sorted(times)[len(times) // 2]
