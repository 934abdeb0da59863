"""A device in host memory for the GPU pipeline's logic on a machine without one (tests/test_pipeline.py).

``HostDevice.install`` replaces the CUDA runtime calls of ``gpu_worker.cuda`` that the pipeline makes. Work
takes effect when it is issued (a copy is a memmove, the engine computes with numpy at ``enqueue``), and
each stream keeps a timeline on ``time.monotonic()``: an operation ends its given device time after the
later of the stream's last one and, for compute, the device's; an event records where its stream's timeline
is, and waiting on one waits until then. So batches take device time, overlap their copies with other
batches' compute and end in order, as on a GPU, while the data is always already where it goes.
"""

from __future__ import annotations

import ctypes
import itertools
import threading
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest

from shmbroker.gpu_worker import cuda
from shmbroker.gpu_worker.engines.base import IOSpec

ROW_S = 0.002  # device time of one row of compute
COPY_S = 0.0001  # of one copy


def _sleep_until(t: float) -> None:
    """The host waits for the device's timeline (what a blocking event wait does)."""
    wait = t - time.monotonic()
    if wait > 0:
        time.sleep(wait)


class HostDevice:
    """One device: a compute timeline that every stream's compute queues on, and memory that is the host's."""

    def __init__(self, row_s: float = ROW_S, copy_s: float = COPY_S) -> None:
        self.row_s, self.copy_s = row_s, copy_s
        self.lock = threading.Lock()
        self.compute_until = 0.0
        self.stall_s = 0.0
        self.streams: dict[int, _Stream] = {}
        self.pinned: dict[int, np.ndarray] = {}
        self._ids = itertools.count(1)

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        dev = self

        class Stream(_Stream):
            def __init__(self, *, non_blocking: bool = True) -> None:
                super().__init__(dev)

        class Event(_Event):
            def __init__(self, *, timing: bool = False, blocking: bool = False) -> None:
                super().__init__(dev)

        for name, value in {
            "Stream": Stream, "Event": Event, "set_device": lambda ordinal: None,
            "memcpy_async": self.memcpy_async, "memcpy_batch_async": self.memcpy_batch_async,
            "has_memcpy_batch": lambda: True, "host_alloc_pinned": self.host_alloc_pinned,
            "free_host": self.free_host, "host_register": lambda addr, nbytes: None,
            "host_unregister": lambda addr: None,
            "elapsed_ms": lambda start, end: (end.at - start.at) * 1e3,
        }.items():
            monkeypatch.setattr(cuda, name, value)

    def stream(self, handle: Any) -> _Stream:
        return self.streams[handle.handle if isinstance(handle, _Stream) else handle]

    def memcpy_async(self, dst: int, src: int, nbytes: int, kind: str, stream: int) -> None:
        ctypes.memmove(dst, src, nbytes)
        self.stream(stream).advance(self.copy_s)

    def memcpy_batch_async(self, dsts: Sequence[int], srcs: Sequence[int], sizes: Sequence[int], stream: int,
                           *, prefer_overlap: bool = False) -> None:
        for d, s, n in zip(dsts, srcs, sizes, strict=True):
            ctypes.memmove(d, s, n)
        self.stream(stream).advance(self.copy_s * len(dsts))

    def free_host(self, ptr: int) -> None:
        del self.pinned[ptr]

    def host_alloc_pinned(self, nbytes: int) -> int:
        buf = np.zeros(max(1, nbytes), np.uint8)
        self.pinned[buf.ctypes.data] = buf
        return int(buf.ctypes.data)

    def compute(self, stream: int, seconds: float) -> None:
        """Queue ``seconds`` of compute on ``stream``: after its earlier work and the device's other compute;
        the first compute after ``stall_s`` was set takes that much longer."""
        with self.lock:
            s = self.streams[stream]
            s.at = max(s.at, self.compute_until, time.monotonic()) + seconds + self.stall_s
            self.stall_s = 0.0
            self.compute_until = s.at


class _Stream:
    def __init__(self, dev: HostDevice) -> None:
        self.dev = dev
        self.at = 0.0
        self.handle = next(dev._ids)
        dev.streams[self.handle] = self

    def advance(self, seconds: float) -> None:
        with self.dev.lock:
            self.at = max(self.at, time.monotonic()) + seconds

    def synchronize(self) -> None:
        _sleep_until(self.at)

    def wait(self, event: _Event) -> None:
        with self.dev.lock:
            self.at = max(self.at, event.at)

    def close(self) -> None:
        self.dev.streams.pop(self.handle, None)


class _Event:
    def __init__(self, dev: HostDevice) -> None:
        self.dev = dev
        self.at = 0.0

    def record(self, stream: Any) -> None:
        self.at = self.dev.stream(stream).at

    def synchronize(self) -> None:
        _sleep_until(self.at)

    def query(self) -> bool:
        return time.monotonic() >= self.at

    def close(self) -> None:
        pass


class DoublingEngine:
    """A DeviceEngine on a HostDevice: y = 2 x for 4 float32s a row; a batch pads to the next of ``sizes``."""

    def __init__(self, dev: HostDevice, sizes: Sequence[int] = (1, 2, 4, 8)) -> None:
        self.dev = dev
        self.device = 0
        self.sizes = sorted(sizes)
        self.inputs = [IOSpec("x", np.dtype("float32"), (-1, 4))]
        self.outputs = [IOSpec("y", np.dtype("float32"), (-1, 4))]
        self.batches: list[int] = []  # rows of each enqueue
        self.refuse = float("nan")  # a batch whose first input value is this fails its launch (cudaGraphLaunch)

    def run(self, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        return [feeds["x"] * 2]

    def create_context(self, index: int, stream: int, max_batch: int,
                       sizes: Sequence[int] | None = None) -> _Context:
        return _Context(self, stream, max_batch)

    def close(self) -> None:
        pass


class _Context:
    def __init__(self, engine: DoublingEngine, stream: int, max_batch: int) -> None:
        self.engine, self.stream = engine, stream
        self.sizes = [s for s in engine.sizes if s < max_batch] + [max_batch]
        self.x = np.zeros((max_batch, 4), np.float32)
        self.y = np.zeros((max_batch, 4), np.float32)
        self.input_ptrs = [int(self.x.ctypes.data)]
        self.output_ptrs = [int(self.y.ctypes.data)]

    def enqueue(self, rows: int) -> None:
        if self.x[0, 0] == self.engine.refuse:
            raise cuda.CudaError("cudaGraphLaunch", "cudaErrorLaunchFailure")
        size = min(s for s in self.sizes if s >= rows)
        self.y[:size] = self.x[:size] * 2
        self.engine.batches.append(rows)
        self.engine.dev.compute(self.stream, size * self.engine.dev.row_s)

    def close(self) -> None:
        pass
