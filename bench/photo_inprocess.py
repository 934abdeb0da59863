"""(a) of the photo bench: the in-process limit of decode + preprocess + engine, no broker at all.

Each shape (``instances`` threads x the engine's intra-op threads) is the worker's own photo runner, built by the
worker's builder (``gpu_worker.models.photo_runner``) from the config's model section: each thread decodes and
preprocesses a batch of encoded photos into its own engine input (``PhotoRunner.decode_rows``, the path a
request's rows take in the worker), then runs the engine on it (``PhotoRunner.feeds``), back to back, as the
runner's instance threads do; on a GPU worker the one shape is its device stage and stream slots
(bench/photo_device.py). ``Limit.sweep`` finds the best shape and batch size; ``Limit.measure`` times that
one again in windows that take turns with the broker's (bench/paired.py), as bench/inprocess.py does for tensors.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import msgspec
import numpy as np

from shmbroker.bench.common import BenchError, Figures, Progress
from shmbroker.bench.photo_device import DeviceShape, device_shape
from shmbroker.bench.photo_tally import Tally, batches, on_threads, tally_figures
from shmbroker.broker.common.config import Config
from shmbroker.gpu_worker import model_source, models
from shmbroker.gpu_worker.batcher import Batcher
from shmbroker.gpu_worker.batching import BatchPolicy
from shmbroker.gpu_worker.engines import is_device_engine, load_engine
from shmbroker.gpu_worker.engines.base import EngineError
from shmbroker.gpu_worker.photorunner import PhotoRunner
from shmbroker.gpu_worker.work import Work

MIN_RUNS = 3
WARMUP_RUNS = 2
ROUND_S = 1.0  # shapes and batch sizes take turns in rounds of about this long (bench/inprocess.py)


@dataclass
class Shape:
    """The worker's photo runner with ``instances`` threads on an engine of ``threads`` intra-op threads."""

    instances: int
    threads: int
    runner: PhotoRunner
    inputs: list[np.ndarray] = field(default_factory=list)  # each instance thread's engine input

    @property
    def name(self) -> str:
        return (f"{self.instances} instance{'s' if self.instances > 1 else ''} x {self.threads} "
                f"thread{'s' if self.threads != 1 else ''}")

    what = "gpu_worker.photorunner.PhotoRunner (decode_rows, then the engine)"

    @property
    def decoder(self) -> str:
        decoder = self.runner.prep.decoder
        return decoder.backend if decoder is not None else "none (frames)"

    def window(self, images: Sequence[memoryview], b: int, seconds: float, min_runs: int) -> Tally:
        """``instances`` threads decode and run batches of ``b`` back to back for ``seconds`` (at least
        ``min_runs`` batches in all)."""
        tallies = [Tally() for _ in range(self.instances)]
        t0 = time.perf_counter()

        def total() -> int:
            return sum(t.runs for t in tallies)

        def loop(i: int) -> None:
            tally, batch, runner = tallies[i], self.inputs[i], self.runner
            plan = batches(len(images), b, i, self.instances)
            while True:
                for rows in plan:
                    ta = time.perf_counter()
                    error = runner.decode_rows([images[k] for k in rows], batch, 0)
                    if error is not None:
                        raise BenchError(f"a photo of the set does not decode: {error}")
                    tb = time.perf_counter()
                    runner.engine.run(runner.feeds(batch, b))
                    tc = time.perf_counter()
                    tally.runs += 1
                    tally.decode_s += tb - ta
                    tally.engine_s += tc - tb
                    if tc - t0 >= seconds and total() >= min_runs:
                        return

        return on_threads(loop, tallies, "bench-photo")

    def close(self) -> None:
        self.runner.engine.close()


def load_shape(cfg: Config, model: str, instances: int, threads: int) -> Shape | DeviceShape:
    """The model's photo runner as the worker builds it, with ``instances`` and ``intra_op_threads`` replaced (a
    GPU worker's: its device stage and stream slots, warmed up); BenchError says why the worker could not build
    it."""
    mc = msgspec.structs.replace(cfg.models[model], instances=instances, intra_op_threads=threads)
    device = str(cfg.worker.devices[0])
    try:
        engine = load_engine(mc.engine, model_source.resolve(cfg.model_path(model)), device=device, model=mc)
    except (EngineError, model_source.ModelSourceError) as exc:
        raise BenchError(f"model {model!r}: {exc}") from None
    try:
        view = models.model_view(0, model, mc, engine)
        batcher: Batcher[Work] = Batcher(BatchPolicy.from_config(mc, device=is_device_engine(engine)))
        runner = models.photo_runner(view, engine, batcher, mc, None)
    except EngineError as exc:
        engine.close()
        raise BenchError(f"model {model!r} on {device}: {exc}") from None
    if is_device_engine(engine):
        try:
            return device_shape(runner)
        except BaseException:
            runner.stop()
            engine.close()
            raise
    if not isinstance(runner, PhotoRunner):
        engine.close()
        raise BenchError(f"model {model!r}: the worker's runner is a {type(runner).__name__}, not a PhotoRunner")
    return Shape(instances, threads, runner, [runner.new_batch() for _ in range(instances)])


def decoder_name(shape: Shape | DeviceShape, device: str) -> str:
    """Where and with what the worker decodes: ``cpu:simplejpeg 1.9.0``, ``0:nvImageCodec ...``."""
    return f"{device}:{shape.decoder}"


class Limit:
    """The shapes of the sweep, loaded once: the model as the config serves it and, where that differs, one instance
    on every core this process may use (ONNX Runtime's own 0 would size its pool past a taskset)."""

    def __init__(self, cfg: Config, model: str) -> None:
        mc = cfg.models[model]
        cores = len(os.sched_getaffinity(0))
        wanted = [(mc.instances, mc.intra_op_threads or cores)]
        if str(cfg.worker.devices[0]) != "cpu":
            wanted = [(1, 0)]  # a GPU worker's stage: one issuing thread, its stream slots
        elif wanted[0] != (1, cores):
            wanted.append((1, cores))
        self.model = model
        self.max_batch = mc.max_batch
        self.shapes: list[Shape | DeviceShape] = []
        try:
            for n, t in wanted:
                self.shapes.append(load_shape(cfg, model, n, t))
        except BaseException:
            self.close()
            raise
        self.best: tuple[Shape | DeviceShape, int] | None = None
        self.decoder = decoder_name(self.shapes[0], str(cfg.worker.devices[0]))

    def close(self) -> None:
        for shape in self.shapes:
            shape.close()

    def __enter__(self) -> Limit:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def batch_sizes(self, wanted: Sequence[int]) -> list[int]:
        """``wanted`` capped at the model's ``max_batch`` (the worker's runner never runs more), with it."""
        return sorted({b for b in wanted if b <= self.max_batch} | {self.max_batch})

    def sweep(self, images: Sequence[memoryview], batch_sizes: list[int], duration_s: float,
              progress: Progress) -> Figures:
        """``duration_s`` of back-to-back batches per shape and batch size, in rounds; the best images/s wins and
        is what ``measure`` runs."""
        tallies = {(s.name, b): Tally() for s in self.shapes for b in batch_sizes}
        for shape in self.shapes:
            for b in batch_sizes:
                shape.window(images, b, 0.0, WARMUP_RUNS)
        rounds = max(1, round(duration_s / ROUND_S))
        for r in range(rounds):
            last = r == rounds - 1
            for shape in self.shapes:
                for b in batch_sizes:
                    left = MIN_RUNS - tallies[shape.name, b].runs if last else 1
                    tallies[shape.name, b].add(shape.window(images, b, duration_s / rounds, left))
            progress.tick(f"round {r + 1}/{rounds}: " + "; ".join(
                f"{s.name}: " + ", ".join(
                    f"b{b} {tally_figures(tallies[s.name, b], b, s.instances)['items_per_s']:.1f}/s"
                    for b in batch_sizes) for s in self.shapes))
        by_shape = {s.name: {str(b): tally_figures(tallies[s.name, b], b, s.instances) for b in batch_sizes}
                    for s in self.shapes}
        best_name, best_b = max(((name, b) for name, fig in by_shape.items() for b in fig),
                                key=lambda nb: by_shape[nb[0]][nb[1]]["items_per_s"])
        shape = next(s for s in self.shapes if s.name == best_name)
        self.best = (shape, int(best_b))
        return {"model": self.model, "runner": self.shapes[0].what,
                "decoder": self.decoder, "batch_sizes": batch_sizes, "duration_s_per_batch_size": duration_s,
                "rounds": rounds, "by_shape": by_shape, "best_shape": best_name, "best_batch": int(best_b),
                "items_per_s": by_shape[best_name][best_b]["items_per_s"]}

    def measure(self, images: Sequence[memoryview], seconds: float) -> Figures:
        """One window of the sweep's best shape and batch size; ``per_s`` is images/s."""
        if self.best is None:
            raise BenchError("the in-process limit was measured before its sweep")
        shape, b = self.best
        f = tally_figures(shape.window(images, b, seconds, MIN_RUNS), b, shape.instances)
        return {"shape": shape.name, "batch": b, "decoder": self.decoder, **f, "per_s": f["items_per_s"]}
