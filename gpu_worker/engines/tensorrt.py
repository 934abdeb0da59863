"""TensorRT 10/11: deserialize a plan and run it on the pipeline's streams, one execution context per slot.

Imports ``tensorrt`` (the full package) or else the lean runtime (``tensorrt_lean``, or ``tensorrt_lean_bindings``
as the tensorrt-lean-cu13 wheel names it). The lean runtime runs only version-compatible plans. A plan's
sidecar ``<plan>.json`` (see ``engines/meta.py``) is checked before deserializing, so a plan built by another
TensorRT version or for another GPU fails with an error that names both. TensorRT's own reason for a failed
deserialization goes only to its logger; a capturing logger puts it into the EngineError.
"""

from __future__ import annotations

import importlib
import logging
import re
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from shmbroker.gpu_worker import cuda
from shmbroker.gpu_worker.engines.base import EngineError, IOSpec, gpu_ordinal
from shmbroker.gpu_worker.engines.meta import read_sidecar, spec_from_dims, specs_from_json

if TYPE_CHECKING:
    from shmbroker.broker.common.config import ModelSection

log = logging.getLogger(__name__)

_MODULES = ("tensorrt", "tensorrt_lean", "tensorrt_lean_bindings")
_LEVELS = {
    "INTERNAL_ERROR": logging.CRITICAL,
    "ERROR": logging.ERROR,
    "WARNING": logging.WARNING,
    "INFO": logging.DEBUG,  # TensorRT's INFO is chatty (memory usage, layer counts): debug here
    "VERBOSE": logging.DEBUG,
}


def import_tensorrt() -> Any:
    """The first of tensorrt, tensorrt_lean, tensorrt_lean_bindings that imports; EngineError names the wheels."""
    failures = []
    for name in _MODULES:
        try:
            return importlib.import_module(name)
        except ImportError as exc:
            failures.append(f"{name}: {exc}")
    raise EngineError(
        "engine 'tensorrt' needs TensorRT 10 or newer: pip install tensorrt-lean-cu13 (version-compatible plans) "
        f"or the full tensorrt-cu13 from NVIDIA's index ({'; '.join(failures)})"
    )


def _make_logger(trt: Any) -> Any:
    class CapturingLogger(trt.ILogger):  # type: ignore[misc]  # the base comes from the untyped bindings
        """Forwards TensorRT's messages to logging and keeps its warnings and errors for the next EngineError."""

        def __init__(self) -> None:
            trt.ILogger.__init__(self)
            self._lock = threading.Lock()
            self._kept: list[str] = []

        def log(self, severity: Any, msg: str) -> None:
            level = _LEVELS.get(getattr(severity, "name", str(severity)), logging.WARNING)
            if level >= logging.WARNING:
                with self._lock:
                    self._kept.append(msg.strip())
                    del self._kept[:-20]  # the last messages say why; older ones are in the log
            log.log(level, "TensorRT: %s", msg.strip())

        def take(self) -> str:
            """The kept messages, joined, and forget them."""
            with self._lock:
                text, self._kept = " | ".join(self._kept), []
            return text or "TensorRT logged no reason"

    return CapturingLogger()


_shared: dict[str, Any] = {}
_shared_lock = threading.Lock()


def shared_logger(trt: Any) -> Any:
    """The one capturing logger of the process. TensorRT keeps the logger of the first runtime for every later
    one (it says so: "the current new logger is ignored"), so a logger per engine would miss its own messages
    and could be freed while TensorRT still calls it; this one lives as long as the process."""
    with _shared_lock:
        if "logger" not in _shared:
            _shared["logger"] = _make_logger(trt)
        return _shared["logger"]


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(p) for p in re.findall(r"\d+", text)[:3])


def _flag(flags: set[str], word: str) -> bool:
    return any(word in f for f in flags)


def check_plan_meta(
    meta: dict[str, Any], *, where: str, trt_version: str, gpu_name: str, capability: tuple[int, int]
) -> None:
    """Refuse, before deserializing, a plan whose sidecar says it was built by another TensorRT or for another GPU.

    A version-compatible plan (flag VERSION_COMPATIBLE) runs on the same major version, same or newer; any
    other plan needs the same major.minor.patch. A hardware-compatible plan (flag AMPERE_PLUS) runs on compute
    capability 8.0 and newer; any other plan needs the same compute capability. Messages name theirs and ours.
    """
    flags = {str(f).upper() for f in meta.get("flags", [])}
    rebuild = "rebuild the plan on this machine (shmbroker build)"
    theirs = str(meta.get("tensorrt_version", "") or "")
    if theirs:
        t, o = _version(theirs), _version(trt_version)
        vc = _flag(flags, "VERSION_COMPATIBLE")
        fits = t[:1] == o[:1] and o >= t if vc else t == o
        if not fits:
            kind = "a version-compatible plan" if vc else "a plan"
            raise EngineError(
                f"{where} is {kind} built with TensorRT {theirs}; this worker runs TensorRT {trt_version} "
                f"(sidecar field tensorrt_version): {rebuild}"
            )
    raw_cc = meta.get("compute_capability")
    if raw_cc is None:
        return
    parts = _version(str(raw_cc)) if not isinstance(raw_cc, list) else tuple(int(x) for x in raw_cc)
    if len(parts) < 2:
        raise EngineError(f"{where}: sidecar compute_capability {raw_cc!r} is not 'major.minor'")
    their_cc = (parts[0], parts[1])
    fits = capability >= (8, 0) if _flag(flags, "AMPERE_PLUS") else their_cc == capability
    their_gpu = meta.get("gpu_name") or "an unnamed GPU"
    if not fits:
        raise EngineError(
            f"{where} was built for {their_gpu} (compute capability {their_cc[0]}.{their_cc[1]}); this worker's GPU "
            f"is {gpu_name} ({capability[0]}.{capability[1]}) (sidecar fields gpu_name, compute_capability): {rebuild}"
        )
    if meta.get("gpu_name") and meta["gpu_name"] != gpu_name:
        log.warning("%s was built on %s, runs on %s: TensorRT advises against it", where, their_gpu, gpu_name)


def check_plan_io(meta: dict[str, Any], inputs: list[IOSpec], outputs: list[IOSpec], where: str) -> None:
    """Refuse a plan whose sidecar ``inputs``/``outputs`` differ from the plan's own IO (a stale sidecar, or a
    plan swapped under it); the message names the sidecar field and the first differing tensor."""
    side = f"sidecar of {where}"
    for field, role, actual in (("inputs", "input", inputs), ("outputs", "output", outputs)):
        declared = specs_from_json(meta.get(field), role, side)
        if _same_io(declared, actual):
            continue
        theirs = {(s.name, s.dtype.name, s.shape) for s in declared}
        ours = {(s.name, s.dtype.name, s.shape) for s in actual}
        raise EngineError(
            f"{side}: field {field!r} declares {sorted(theirs - ours)}, the plan has {sorted(ours - theirs)}: "
            "the sidecar is stale or the plan was replaced, rebuild (shmbroker build)"
        )


def _engine_specs(trt: Any, engine: Any, where: str) -> tuple[list[IOSpec], list[IOSpec]]:
    inputs: list[IOSpec] = []
    outputs: list[IOSpec] = []
    for i in range(engine.num_io_tensors):
        name = engine.get_tensor_name(i)
        is_input = engine.get_tensor_mode(name) == trt.TensorIOMode.INPUT
        role = "input" if is_input else "output"
        if engine.get_tensor_location(name) != trt.TensorLocation.DEVICE:
            raise EngineError(f"{where}: {role} {name!r} lives on the host (a shape tensor); shmbroker feeds tensors")
        try:
            dtype = np.dtype(trt.nptype(engine.get_tensor_dtype(name)))
        except TypeError as exc:
            raise EngineError(f"{where}: {role} {name!r} has a type without a numpy twin") from exc
        spec = spec_from_dims(name, dtype, list(engine.get_tensor_shape(name)), role)
        (inputs if is_input else outputs).append(spec)
    return inputs, outputs


def _read_plan(path: str) -> bytes:
    try:
        with open(path, "rb") as fh:
            return fh.read()
    except OSError as exc:
        raise EngineError(f"cannot read the plan {path}: {exc}") from exc


def _same_io(declared: list[IOSpec], actual: list[IOSpec]) -> bool:
    return [(s.name, s.dtype, s.shape) for s in declared] == [(s.name, s.dtype, s.shape) for s in actual]


class TensorRTEngine:
    """A deserialized TensorRT plan on CUDA device ``device``; a DeviceEngine (see base.py).

    IO dtypes are the plan's own (a plan built with fp32 IO takes fp32 whatever it computes in).
    """

    @classmethod
    def from_config(cls, source: str | bytes, *, device: int | None, model: ModelSection) -> TensorRTEngine:
        """The table's constructor: reads ``max_batch`` (checked against the plan's first profile)."""
        return cls(source, device=gpu_ordinal(device, "tensorrt"), max_batch=model.max_batch)

    def __init__(self, source: str | bytes, *, device: int, max_batch: int = 0) -> None:
        trt = import_tensorrt()
        self._trt = trt
        self.device = device
        where = "<plan bytes>" if isinstance(source, bytes) else source
        self.version = str(getattr(trt, "__version__", "unknown"))
        try:
            cuda.set_device(device)
            gpu, capability = cuda.device_name(device), cuda.compute_capability(device)
        except cuda.CudaError as exc:
            raise EngineError(f"engine 'tensorrt' cannot use CUDA device {device} (worker.devices): {exc}") from exc
        meta = None if isinstance(source, bytes) else read_sidecar(source)
        if meta is not None:
            check_plan_meta(meta, where=where, trt_version=self.version, gpu_name=gpu, capability=capability)
        data = source if isinstance(source, bytes) else _read_plan(source)
        self._logger = shared_logger(trt)
        self._logger.take()  # forget what earlier engines left: what follows is this plan's
        self._runtime = trt.Runtime(self._logger)
        # a version-compatible plan embeds its own lean runtime, which runs only when host code is allowed;
        # plans are trusted like TorchScript files (both carry code), and other plans ignore the setting
        self._runtime.engine_host_code_allowed = True
        self._engine = self._runtime.deserialize_cuda_engine(data)
        if self._engine is None:
            raise EngineError(
                f"TensorRT {self.version} cannot deserialize {where} on {gpu} ({capability[0]}.{capability[1]}): "
                f"{self._logger.take()}"
            )
        self.inputs, self.outputs = _engine_specs(trt, self._engine, where)
        if meta is not None and "inputs" in meta:
            check_plan_io(meta, self.inputs, self.outputs, where)
        self.profiles = int(self._engine.num_optimization_profiles)
        if max_batch:
            self.check_profile(0, max_batch)
        self._run_lock = threading.Lock()
        self._run_state: tuple[cuda.Stream, TensorRTContext] | None = None

    def check_profile(self, index: int, max_batch: int) -> None:
        """EngineError unless optimization profile ``index`` exists and covers batches 1..max_batch."""
        if index >= self.profiles:
            raise EngineError(
                f"the plan has {self.profiles} optimization profile(s) and stream slot {index} needs its own: "
                f"rebuild it with --streams {index + 1} or more, or lower the model's streams"
            )
        for spec in self.inputs:
            low, _, high = self._engine.get_tensor_profile_shape(spec.name, index)
            if low[0] > 1 or high[0] < max_batch:
                raise EngineError(
                    f"optimization profile {index} of input {spec.name!r} covers batches {low[0]}..{high[0]}; "
                    f"the model's max_batch is {max_batch}: rebuild with --max-batch {max_batch}"
                )

    def create_context(self, index: int, stream: int, max_batch: int,
                       sizes: Sequence[int] | None = None) -> TensorRTContext:
        """Stream slot ``index``: its own execution context on optimization profile ``index`` (it runs any batch
        size of the profile, so ``sizes`` has nothing to prepare)."""
        self.check_profile(index, max_batch)
        return TensorRTContext(self, index, stream, max_batch)

    def run(self, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        """Host arrays in, host arrays out, synchronous (warm-up, tests). It uses a context of its own on
        profile 0: never call it while the pipeline's slot 0 may be running."""
        rows = int(next(iter(feeds.values())).shape[0])
        with self._run_lock:
            cuda.set_device(self.device)
            if self._run_state is None or self._run_state[1].max_batch < rows:
                stream = cuda.Stream()
                high = self._engine.get_tensor_profile_shape(self.inputs[0].name, 0)[2]
                self._run_state = stream, TensorRTContext(self, 0, stream.handle, max(rows, int(high[0])))
            stream, ctx = self._run_state
            staged = [np.ascontiguousarray(feeds[s.name], dtype=s.dtype) for s in self.inputs]  # alive until sync
            for arr, ptr in zip(staged, ctx.input_ptrs, strict=True):
                cuda.memcpy_async(ptr, arr.ctypes.data, arr.nbytes, "h2d", stream.handle)
            ctx.enqueue(rows)
            outs = [np.empty((rows, *s.item_shape), dtype=s.dtype) for s in self.outputs]
            for out, ptr in zip(outs, ctx.output_ptrs, strict=True):
                cuda.memcpy_async(out.ctypes.data, ptr, out.nbytes, "d2h", stream.handle)
            stream.synchronize()
            return outs

    def reasons(self) -> str:
        """What TensorRT logged (warnings and errors) since the last call."""
        text: str = self._logger.take()
        return text

    def close(self) -> None:
        with self._run_lock:
            if self._run_state is not None:
                self._run_state[1].close()
                self._run_state[0].close()
                self._run_state = None
        self._engine = None
        self._runtime = None


class TensorRTContext:
    """One stream slot of a TensorRTEngine (a DeviceContext): an execution context on profile ``index``,
    device buffers for ``max_batch`` rows bound once with ``set_tensor_address``.

    ``enqueue`` is not reentrant (one thread per context); the calling thread's current device must be the
    engine's (``cuda.set_device``), and the stream stays alive longer than the context.
    """

    def __init__(self, engine: TensorRTEngine, index: int, stream: int, max_batch: int) -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch must be at least 1, got {max_batch}")
        self._engine = engine
        self.index = index
        self.max_batch = max_batch
        self._stream = stream
        cuda.set_device(engine.device)
        ctx = engine._engine.create_execution_context()
        if ctx is None:
            raise EngineError(f"TensorRT cannot create execution context {index}: {engine.reasons()}")
        if not ctx.set_optimization_profile_async(index, stream):
            raise EngineError(f"TensorRT cannot select optimization profile {index}: {engine.reasons()}")
        self._ctx = ctx
        self._buffers = [cuda.DeviceBuffer(max_batch * s.item_bytes) for s in engine.inputs + engine.outputs]
        for spec, buf in zip(engine.inputs + engine.outputs, self._buffers, strict=True):
            if not ctx.set_tensor_address(spec.name, buf.ptr):
                raise EngineError(f"TensorRT refused the address of {spec.name!r}: {engine.reasons()}")
        self.input_ptrs = [b.ptr for b in self._buffers[: len(engine.inputs)]]
        self.output_ptrs = [b.ptr for b in self._buffers[len(engine.inputs) :]]
        self._shapes = [(s.name, s.item_shape) for s in engine.inputs]
        self._rows = 0  # the batch size the input shapes are set for

    def enqueue(self, rows: int) -> None:
        """Run rows [0, rows) of the input buffers into the output buffers on the stream; asynchronous."""
        if not 1 <= rows <= self.max_batch:
            raise ValueError(f"rows must be in [1, {self.max_batch}], got {rows}")
        if rows != self._rows:
            for name, item_shape in self._shapes:
                if not self._ctx.set_input_shape(name, (rows, *item_shape)):
                    raise EngineError(f"TensorRT refused shape {[rows, *item_shape]} for {name!r}: {self._why()}")
            self._rows = rows
        if not self._ctx.execute_async_v3(self._stream):
            raise EngineError(f"TensorRT execute_async_v3 failed: {self._why()}")

    def _why(self) -> str:
        return self._engine.reasons()

    def close(self) -> None:
        """Release the context and its buffers; call it once the stream has finished the context's work."""
        self._ctx = None
        for buf in self._buffers:
            buf.close()
        self._buffers.clear()
