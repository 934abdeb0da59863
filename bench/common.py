"""What every part of the benchmark shares: progress on stderr, latency summaries, the SUBMIT-sized message."""

from __future__ import annotations

import json
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from shmbroker.broker.common import protocol as P

Figures = dict[str, Any]  # one measurement, as it goes into the JSON document


class BenchError(RuntimeError):
    """A phase could not run (a child failed, the broker did not start); the text says which and why."""


class ChainSet:
    """``n`` request chains that each end once, under one lock: ``drained`` is set when the last has ended."""

    def __init__(self, n: int) -> None:
        self.lock = threading.Lock()
        self.live = n
        self.drained = threading.Event()

    def _ended(self) -> None:
        with self.lock:
            self.live -= 1
            if self.live <= 0:
                self.drained.set()


class Progress:
    """Phase names and elapsed time on stderr: one line per event, timestamped from the start of the run."""

    def __init__(self, stream: Any = None) -> None:
        self._stream = stream if stream is not None else sys.stderr
        self.t0 = time.monotonic()
        self._phase = ""
        self._phase_t0 = self.t0

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def _write(self, text: str) -> None:
        self._stream.write(f"[bench {self.elapsed():6.1f}s] {text}\n")
        self._stream.flush()

    def phase(self, name: str) -> None:
        self._phase = name
        self._phase_t0 = time.monotonic()
        self._write(f"{name} ...")

    def note(self, text: str) -> None:
        self._write(f"  {text}")

    def tick(self, detail: str) -> None:
        self._write(f"  ... {detail} ({time.monotonic() - self._phase_t0:.1f} s into the phase)")

    def done(self, summary: str) -> None:
        self._write(f"  done in {time.monotonic() - self._phase_t0:.1f} s: {summary}")


def emit(doc: Figures, out: str | None) -> None:
    """The JSON document on stdout, and into ``out`` too when given (a small bench's whole output)."""
    text = json.dumps(doc, indent=2) + "\n"
    if out:
        Path(out).write_text(text)
    sys.stdout.write(text)


def latency_summary(samples_ns: Sequence[int] | np.ndarray) -> Figures:
    """p50/p90/p99/mean/min/max in microseconds of round-trip times given in nanoseconds."""
    a = np.asarray(samples_ns, dtype=np.float64) / 1e3
    if a.size == 0:
        return {"samples": 0}
    p50, p90, p99, p999 = np.percentile(a, [50, 90, 99, 99.9])
    return {
        "samples": int(a.size),
        "p50_us": round(float(p50), 2),
        "p90_us": round(float(p90), 2),
        "p99_us": round(float(p99), 2),
        "p999_us": round(float(p999), 2),
        "mean_us": round(float(a.mean()), 2),
        "min_us": round(float(a.min()), 2),
        "max_us": round(float(a.max()), 2),
    }


def submit_sized_message() -> list[bytes]:
    """The exact frames of a SUBMIT carrying one request with one tensor: the echo's payload.

    Built with the protocol's own encoder, so the echo carries the same bytes the client sends for one
    ``tiny`` request (4-byte envelope + 24 + 32 + 88 = 144-byte body).
    """
    tensor = P.TensorDesc(0, int(P.DType.FP32), 0, 256 * 4, (1, 256))
    request = P.SubmitRequest(1, 0, 1, 1, 0, [tensor])
    frames = P.encode_submit(P.SubmitBatch(1, 0x0123_4567_89AB_CDEF, [request]))
    expected = [P.ENVELOPE.size, P.SUBMIT_HEADER.size + P.REQUEST.size + P.TENSOR.size]
    if [len(f) for f in frames] != expected:
        raise BenchError(f"a one-request SUBMIT is {[len(f) for f in frames]} bytes of frames, expected {expected}")
    return frames
