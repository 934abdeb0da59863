"""ONNX Runtime on the CPU: the embedded default engine."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import numpy as np
import onnxruntime as ort

from shmbroker.gpu_worker.engines.base import EngineError
from shmbroker.gpu_worker.engines.meta import spec_of

if TYPE_CHECKING:
    from shmbroker.broker.common.config import ModelSection

log = logging.getLogger(__name__)

class OnnxRuntimeEngine:
    """One InferenceSession on the CPU provider; ``run`` is thread-safe (ONNX Runtime allows concurrent runs)."""

    @classmethod
    def from_config(cls, source: str | bytes, *, device: int | None, model: ModelSection) -> OnnxRuntimeEngine:
        """The table's constructor (broker/common/engines.py): reads ``intra_op_threads``; runs on the CPU."""
        return cls(source, intra_op_threads=model.intra_op_threads)

    def __init__(self, source: str | bytes, *, intra_op_threads: int = 0, spin: bool = False) -> None:
        """``spin``: let ONNX Runtime's pool threads spin between and after parallel sections (its default)."""
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = intra_op_threads
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        # ORT's pool spins after each run by default; on a small box that steals the cores the IO threads and
        # the clients need, and costs far more than the wake-up it saves, except for a batch that runs alone
        # on every core (bench/RESULTS.md#idle-dispatch)
        opts.add_session_config_entry("session.intra_op.allow_spinning", "1" if spin else "0")
        try:
            self._session = ort.InferenceSession(source, sess_options=opts, providers=["CPUExecutionProvider"])
        except Exception as exc:  # ORT raises its own untyped errors for unreadable models
            where = source if isinstance(source, str) else "<model bytes>"
            raise EngineError(f"onnxruntime cannot load {where}: {exc}") from exc
        self.inputs = [spec_of(a, "input") for a in self._session.get_inputs()]
        self.outputs = [spec_of(a, "output") for a in self._session.get_outputs()]
        self._output_names = [o.name for o in self.outputs]
        # The public run() re-validates every feed (about 15 us a call on a small box); the worker's intake
        # has already checked names, dtypes and shapes, so call the bound C++ session when it is there.
        inner = getattr(self._session, "_sess", None)
        self._inner_run = getattr(inner, "run", None)

    def run(self, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        if self._inner_run is not None:
            fast: list[np.ndarray] = self._inner_run(self._output_names, feeds, None)
            return fast
        result: list[np.ndarray] = self._session.run(self._output_names, feeds)
        return result

    def close(self) -> None:
        del self._session
