"""The in-process limit: the worker's own engine class, run directly in the bench process, no broker at all.

``OnnxRuntimeEngine`` is built exactly as the worker builds it (same session options, the model's
``intra_op_threads``), then run back to back at each batch size for a fixed time (the batch sizes take
turns, in rounds of about a second); the best images/s over the batch sizes is what the broker, which adds
IPC, batching and scheduling, is measured against.
"""

from __future__ import annotations

import time

import numpy as np

from bench.common import Figures, Progress
from broker.config import Config
from gpu_worker import model_source
from gpu_worker.engines.onnxruntime import OnnxRuntimeEngine

MIN_RUNS = 3
WARMUP_RUNS = 2
ROUND_S = 1.0  # batch sizes take turns in rounds of about this long, so a change in machine load hits all alike


def limit(cfg: Config, model: str, batch_sizes: list[int], duration_s: float, progress: Progress,
          seed: int = 7) -> Figures:
    """``duration_s`` of back-to-back runs per batch size, interleaved in rounds; the best items/s wins."""
    mc = cfg.models[model]
    engine = OnnxRuntimeEngine(model_source.resolve(cfg.model_path(model)), intra_op_threads=mc.intra_op_threads)
    rng = np.random.default_rng(seed)
    rounds = max(1, round(duration_s / ROUND_S))
    runs = dict.fromkeys(batch_sizes, 0)
    seconds = dict.fromkeys(batch_sizes, 0.0)
    try:
        feeds = {b: {s.name: rng.random((b, *s.item_shape), dtype=np.float32).astype(s.dtype) for s in engine.inputs}
                 for b in batch_sizes}
        for b in batch_sizes:
            for _ in range(WARMUP_RUNS):
                engine.run(feeds[b])
        for r in range(rounds):
            last = r == rounds - 1
            for b in batch_sizes:
                t0 = time.perf_counter()
                n = 0
                while True:
                    engine.run(feeds[b])
                    n += 1
                    elapsed = time.perf_counter() - t0
                    if elapsed >= duration_s / rounds and (not last or runs[b] + n >= MIN_RUNS):
                        break
                runs[b] += n
                seconds[b] += elapsed
            progress.tick(f"round {r + 1}/{rounds}: " + ", ".join(
                f"b{b} {runs[b] * b / seconds[b]:.1f}/s" for b in batch_sizes))
    finally:
        engine.close()
    by_batch: dict[str, Figures] = {
        str(b): {"runs": runs[b], "seconds": round(seconds[b], 3), "ms_per_batch": round(1e3 * seconds[b] / runs[b], 2),
                 "items_per_s": round(runs[b] * b / seconds[b], 2)}
        for b in batch_sizes
    }
    best = max(by_batch, key=lambda k: by_batch[k]["items_per_s"])
    return {
        "model": model,
        "engine": "onnxruntime (gpu_worker.engines.onnxruntime.OnnxRuntimeEngine, in the bench process)",
        "intra_op_threads": mc.intra_op_threads,
        "batch_sizes": batch_sizes,
        "duration_s_per_batch_size": duration_s,
        "rounds": rounds,
        "by_batch": by_batch,
        "best_batch": int(best),
        "items_per_s": by_batch[best]["items_per_s"],
    }
