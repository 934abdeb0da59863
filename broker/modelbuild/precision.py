"""``check-precision``: a converted model against its float32 original on evaluation data, with ONNX Runtime on
the CPU (an inductor package, ``.pt2``, on CUDA device 0): argmax agreement, max and mean absolute difference of
the outputs, and each model's throughput."""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import TypeAlias

import numpy as np
import onnxruntime as ort

from shmbroker.broker.modelbuild.calibration import Data, batches, rows
from shmbroker.gpu_worker.engines import Engine, load_engine

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Comparison:
    """The candidate's outputs against the reference's over ``rows`` evaluation rows (the first output)."""

    rows: int
    argmax_agreement: float  # share of rows whose argmax over the last axis is the same
    max_abs_diff: float
    mean_abs_diff: float


class EngineSession:
    """A GPU engine behind the part of InferenceSession that check-precision uses (``get_outputs``, ``run``)."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        self._names = [s.name for s in engine.outputs]

    def get_outputs(self) -> list[SimpleNamespace]:
        return [SimpleNamespace(name=n) for n in self._names]

    def run(self, names: list[str] | None, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        outs = self._engine.run(feeds)
        return outs if names is None else [outs[self._names.index(n)] for n in names]


Session: TypeAlias = ort.InferenceSession | EngineSession


def open_model(path: str, threads: int = 0) -> Session:
    """``session(path, threads)``, or for an inductor package (``.pt2``) the inductor engine on CUDA device 0
    (EngineError without one)."""
    if path.endswith(".pt2"):
        return EngineSession(load_engine("inductor", path, device="0"))
    return session(path, threads)


def session(path: str, threads: int = 0) -> ort.InferenceSession:
    """A CPU InferenceSession of the model at ``path`` with ``threads`` intra-op threads (0: ONNX Runtime's)."""
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    return ort.InferenceSession(path, sess_options=opts, providers=["CPUExecutionProvider"])


def outputs(sess: Session, data: Data, batch: int, advance: Callable[[int], None] | None = None
            ) -> np.ndarray:
    """The first output of ``sess`` over all rows of ``data``, as float32, batch by batch."""
    name = sess.get_outputs()[0].name
    parts = []
    for part in batches(data, batch):
        parts.append(np.asarray(sess.run([name], part)[0], dtype=np.float32))
        if advance is not None:
            advance(rows(part))
    return np.concatenate(parts)


def compare(reference: np.ndarray, candidate: np.ndarray) -> Comparison:
    """Compare two output arrays of the same shape, rows along axis 0."""
    if reference.shape != candidate.shape:
        raise ValueError(f"outputs differ in shape: reference {reference.shape}, candidate {candidate.shape}")
    diff = np.abs(reference.astype(np.float64) - candidate.astype(np.float64))
    ref2, cand2 = reference.reshape(len(reference), -1), candidate.reshape(len(candidate), -1)
    agree = float(np.mean(ref2.argmax(axis=1) == cand2.argmax(axis=1)))
    return Comparison(len(reference), agree, float(diff.max()), float(diff.mean()))


def throughput(sess: Session, data: Data, batch: int, min_seconds: float = 2.0) -> float:
    """Rows per second of ``sess`` on batches of ``data``, after one warm-up batch, over at least ``min_seconds``."""
    parts = list(batches(data, batch))
    sess.run(None, parts[0])
    done, start = 0, time.perf_counter()
    while True:
        for part in parts:
            sess.run(None, part)
            done += rows(part)
        elapsed = time.perf_counter() - start
        if elapsed >= min_seconds:
            return done / elapsed


def report_lines(names: list[str], comparisons: dict[str, Comparison], rates: dict[str, float]) -> list[str]:
    """The table check-precision prints: one line per model file, the reference (no comparison) first."""
    lines = [f"{'model':<40} {'agreement':>9} {'max abs':>10} {'mean abs':>10} {'rows/s':>9}"]
    for name in names:
        c = comparisons.get(name)
        figures = (f"{c.argmax_agreement:>9.2%} {c.max_abs_diff:>10.6f} {c.mean_abs_diff:>10.6f}" if c
                   else f"{'(reference)':>31}")
        rate = f"{rates[name]:>9.1f}" if name in rates else f"{'-':>9}"
        lines.append(f"{Path(name).name:<40} {figures} {rate}")  # file names: full paths break the columns
    return lines
