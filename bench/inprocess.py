"""The in-process limit: the worker's own engine class, run directly in the bench process, no broker at all.

``OnnxRuntimeEngine`` is built exactly as the worker builds it (same session options), in two shapes:
the model as the config serves it (``instances`` threads running batches at once on one session, each run
with ``intra_op_threads``), and, where that differs, one instance on all the cores this process may use.
Each shape runs back to back at each batch size for a fixed time (all of them take turns, in rounds of
about a second); the sweep (``limit``) finds the best shape and batch size. ``Pinned`` keeps that one loaded
and measures it again in windows that take turns with the broker's (bench/paired.py): the best the CPU does
in-process, measured under the same machine state as the broker, is what the broker, which adds IPC,
batching and scheduling, is measured against. So a config that serves a model with several instances is
measured against the best the CPU does in-process, not against a weaker single-instance figure.
"""

from __future__ import annotations

import os
import threading
import time

import numpy as np

from shmbroker.bench.common import Figures, Progress
from shmbroker.broker.common.config import Config
from shmbroker.gpu_worker import model_source
from shmbroker.gpu_worker.engines.onnxruntime import OnnxRuntimeEngine

MIN_RUNS = 3
WARMUP_RUNS = 2
ROUND_S = 1.0  # shapes and batch sizes take turns in rounds of about this long, so a change in load hits all alike


class _Shape:
    """One engine run by ``instances`` threads at once; accumulates runs and seconds per batch size."""

    def __init__(self, source: str | bytes, instances: int, intra_op_threads: int, batch_sizes: list[int]) -> None:
        self.instances = instances
        self.intra_op_threads = intra_op_threads
        self.name = f"{instances} instance{'s' if instances > 1 else ''} x {intra_op_threads} " \
                    f"thread{'s' if intra_op_threads != 1 else ''}"
        self.engine = OnnxRuntimeEngine(source, intra_op_threads=intra_op_threads)
        self.runs = dict.fromkeys(batch_sizes, 0)
        self.seconds = dict.fromkeys(batch_sizes, 0.0)

    def window(self, feeds: dict[str, np.ndarray], b: int, seconds: float, min_runs: int) -> tuple[int, float]:
        """``instances`` threads run batches of ``b`` back to back for ``seconds`` (at least ``min_runs`` in all);
        (runs, seconds) of this window, also added to the totals."""
        counts = [0] * self.instances
        t0 = time.perf_counter()

        def loop(i: int) -> None:
            while True:
                self.engine.run(feeds)
                counts[i] += 1
                if time.perf_counter() - t0 >= seconds and sum(counts) >= min_runs:
                    return

        threads = [threading.Thread(target=loop, args=(i,)) for i in range(1, self.instances)]
        for t in threads:
            t.start()
        loop(0)
        for t in threads:
            t.join()
        took = time.perf_counter() - t0
        self.runs[b] += sum(counts)
        self.seconds[b] += took
        return sum(counts), took

    def rate(self, b: int) -> float:
        return self.runs[b] * b / self.seconds[b] if self.seconds[b] else 0.0

    def figures(self) -> Figures:
        return {
            str(b): {"runs": self.runs[b], "seconds": round(self.seconds[b], 3),
                     "ms_per_batch": round(1e3 * self.seconds[b] * self.instances / self.runs[b], 2),
                     "items_per_s": round(self.rate(b), 2)}
            for b in self.runs
        }


def _feeds(engine: OnnxRuntimeEngine, b: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    return {s.name: rng.random((b, *s.item_shape), dtype=np.float32).astype(s.dtype) for s in engine.inputs}


def limit(cfg: Config, model: str, batch_sizes: list[int], duration_s: float, progress: Progress,
          seed: int = 7) -> Figures:
    """``duration_s`` of back-to-back runs per shape and batch size, interleaved in rounds; the best items/s wins."""
    mc = cfg.models[model]
    source = model_source.resolve(cfg.model_path(model))
    # "all cores" as the cores this process may use: ONNX Runtime's 0 sizes its pool by the machine, past
    # a taskset or cgroup limit, and would measure more cores than the broker's processes get
    cores = len(os.sched_getaffinity(0))
    wanted = [(mc.instances, mc.intra_op_threads or cores)]
    if wanted[0] != (1, cores):
        wanted.append((1, cores))
    shapes = [_Shape(source, n, t, batch_sizes) for n, t in wanted]
    rng = np.random.default_rng(seed)
    rounds = max(1, round(duration_s / ROUND_S))
    try:
        feeds = {b: _feeds(shapes[0].engine, b, rng) for b in batch_sizes}
        for shape in shapes:
            for b in batch_sizes:
                for _ in range(WARMUP_RUNS):
                    shape.engine.run(feeds[b])
        for r in range(rounds):
            last = r == rounds - 1
            for shape in shapes:
                for b in batch_sizes:
                    shape.window(feeds[b], b, duration_s / rounds, MIN_RUNS - shape.runs[b] if last else 1)
            progress.tick(f"round {r + 1}/{rounds}: " + "; ".join(
                f"{shape.name}: " + ", ".join(f"b{b} {shape.rate(b):.1f}/s" for b in batch_sizes) for shape in shapes))
    finally:
        for shape in shapes:
            shape.engine.close()
    by_shape = {shape.name: shape.figures() for shape in shapes}
    best_shape, best = max(((name, b) for name, fig in by_shape.items() for b in fig),
                           key=lambda nb: by_shape[nb[0]][nb[1]]["items_per_s"])
    winner = next(shape for shape in shapes if shape.name == best_shape)
    return {
        "model": model,
        "engine": "onnxruntime (gpu_worker.engines.onnxruntime.OnnxRuntimeEngine, in the bench process)",
        "instances": mc.instances,
        "intra_op_threads": mc.intra_op_threads,
        "batch_sizes": batch_sizes,
        "duration_s_per_batch_size": duration_s,
        "rounds": rounds,
        "by_shape": by_shape,
        "best_shape": best_shape,
        "best_instances": winner.instances,
        "best_intra_op_threads": winner.intra_op_threads,
        "by_batch": by_shape[best_shape],
        "best_batch": int(best),
        "items_per_s": by_shape[best_shape][best]["items_per_s"],
    }


class Pinned:
    """The best shape and batch size of a ``limit`` sweep, loaded once and measured again window by window.

    Measured again rather than taken from the sweep: the sweep's best of several noisy figures is biased
    upwards by its own noise; a window of the chosen shape and batch is not, and is taken when the broker's is.
    """

    def __init__(self, cfg: Config, model: str, sweep: Figures, seed: int = 7) -> None:
        self.batch = int(sweep["best_batch"])
        self.shape = _Shape(model_source.resolve(cfg.model_path(model)), int(sweep["best_instances"]),
                            int(sweep["best_intra_op_threads"]), [self.batch])
        self.feeds = _feeds(self.shape.engine, self.batch, np.random.default_rng(seed))
        for _ in range(WARMUP_RUNS):
            self.shape.engine.run(self.feeds)

    def __enter__(self) -> Pinned:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shape.engine.close()

    def measure(self, seconds: float) -> Figures:
        """One window: ``seconds`` of back-to-back batches (at least ``MIN_RUNS``); ``per_s`` is items/s."""
        runs, took = self.shape.window(self.feeds, self.batch, seconds, MIN_RUNS)
        return {"shape": self.shape.name, "batch": self.batch, "runs": runs, "seconds": round(took, 3),
                "ms_per_batch": round(1e3 * took * self.shape.instances / runs, 2),
                "per_s": round(runs * self.batch / took, 2)}
