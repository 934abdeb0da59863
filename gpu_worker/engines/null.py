"""The null engine, for benchmarks of the host path: a GPU engine with a model's IO and no model.

Each batch computes for a fixed device-side time (``null_compute_us``, a spinning kernel), whatever its rows,
and writes each output row from the first values of the same row of the first input (cast, repeated where
the output is larger), so the real stream slots, copies, events and answers run as with a model and every
answer still shows which request it belongs to. What the broker serves over it is the ceiling of the host
path at that compute time (bench/RESULTS.md#the-host-paths-ceiling).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from shmbroker.gpu_worker.engines.base import EngineError, IOSpec, gpu_ordinal
from shmbroker.gpu_worker.engines.graphed import Body, GraphedContext, graph_ladder, torch_dtype, torch_module
from shmbroker.gpu_worker.engines.meta import onnx_file_specs

if TYPE_CHECKING:
    from shmbroker.broker.common.config import ModelSection

CALIBRATION_CYCLES = 2_000_000  # long enough that the launch is noise beside it


def expected_outputs(first_input: np.ndarray, outputs: Sequence[IOSpec]) -> list[np.ndarray]:
    """What the null engine answers for ``first_input`` ([rows, *item_shape]): the host-side twin of its body."""
    rows = first_input.shape[0]
    flat = first_input.reshape(rows, -1)
    out = []
    for spec in outputs:
        count = math.prod(spec.item_shape)
        idx = np.arange(count) % flat.shape[1]
        out.append(flat[:, idx].astype(spec.dtype).reshape(rows, *spec.item_shape))
    return out


class NullEngine:
    """A DeviceEngine (base.py) and GraphedEngine (graphed.py) on CUDA device ``device`` whose every batch spins
    the device for ``compute_us`` microseconds. ``source``: an ONNX file, read for its inputs and outputs only."""

    @classmethod
    def from_config(cls, source: str | bytes, *, device: int | None, model: ModelSection) -> NullEngine:
        """The table's constructor: reads ``null_compute_us`` and ``cuda_graphs``."""
        return cls(source, device=gpu_ordinal(device, "null"), compute_us=model.null_compute_us,
                   cuda_graphs=model.cuda_graphs)

    def __init__(self, source: str | bytes, *, device: int, compute_us: int, cuda_graphs: bool = True) -> None:
        if compute_us < 0:
            raise EngineError(f"engine 'null': null_compute_us is {compute_us}; give 0 or more microseconds")
        torch = torch_module()
        if not torch.cuda.is_available() or device >= torch.cuda.device_count():
            raise EngineError(f"engine 'null': PyTorch sees no CUDA device {device} (worker.devices)")
        self.inputs, self.outputs = onnx_file_specs(source)
        if not self.inputs:
            raise EngineError("engine 'null': the model declares no input to echo")
        self.device = device
        self.compute_us = compute_us
        self.cuda_graphs = cuda_graphs
        self.graphs_failed: str | None = None
        self._dev = torch.device("cuda", device)
        self._cycles = round(compute_us * _cycles_per_us(torch, self._dev)) if compute_us else 0
        first = math.prod(self.inputs[0].item_shape)
        self._index = [torch.arange(math.prod(s.item_shape), device=self._dev) % first for s in self.outputs]
        self._dtypes = [torch_dtype(s.dtype) for s in self.outputs]
        self._create_lock = threading.Lock()

    def _compute(self, inputs: list[Any], rows: int) -> list[Any]:
        torch = torch_module()
        if self._cycles:
            torch.cuda._sleep(self._cycles)
        flat = inputs[0][:rows].reshape(rows, -1)
        return [flat[:, idx].to(dt).reshape(rows, *s.item_shape)
                for idx, dt, s in zip(self._index, self._dtypes, self.outputs, strict=True)]

    def run(self, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        """Host arrays in, host arrays out; synchronous (warm-up and tests)."""
        torch = torch_module()
        with torch.inference_mode(), torch.cuda.device(self._dev):
            tensors = [torch.as_tensor(np.ascontiguousarray(feeds[s.name]), device=self._dev) for s in self.inputs]
            outs = self._compute(tensors, int(tensors[0].shape[0]))
            return [o.cpu().numpy() for o in outs]

    def bind(self, index: int) -> Body:
        return self._compute

    def prepared_sizes(self, max_batch: int, wanted: Sequence[int] | None) -> list[int]:
        return sorted(set(wanted)) if wanted else graph_ladder(max_batch)

    def create_context(self, index: int, stream: int, max_batch: int,
                       sizes: Sequence[int] | None = None) -> GraphedContext:
        with self._create_lock:
            return GraphedContext(self, index, stream, max_batch, sizes)

    def close(self) -> None:
        self._index.clear()


def _cycles_per_us(torch: Any, device: Any) -> float:
    """The device's spin-kernel clock, timed once with CUDA events (the clock the kernel counts in)."""
    with torch.cuda.device(device):
        torch.cuda._sleep(CALIBRATION_CYCLES // 10)  # load the kernel
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.cuda._sleep(CALIBRATION_CYCLES)
        end.record()
        end.synchronize()
        return float(CALIBRATION_CYCLES / (start.elapsed_time(end) * 1e3))
