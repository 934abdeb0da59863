"""Checked CUDA runtime calls through cuda-python (``cuda.bindings.runtime``): devices, memory, streams, events.

Every call unpacks the ``(err, *values)`` tuple the bindings return and raises ``CudaError`` carrying the
CUDA error name (``cudaGetErrorName``), as NVIDIA's samples/python/common_runtime.py does. The module imports
on a machine without cuda-python; the first call then raises ``CudaUnavailable``.

Threads: the runtime's current device is per host thread. A worker thread that allocates, copies or records
on a device other than 0 calls ``set_device`` first. Handles (pointers, streams, events) are plain ints so they
cross into torch (``torch.cuda.ExternalStream``) and TensorRT (``execute_async_v3``) unchanged.
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Sequence
from typing import Any

log = logging.getLogger(__name__)

_rt: Any = None  # cuda.bindings.runtime once loaded
_load_lock = threading.Lock()
_kinds: dict[str, Any] = {}
_batch_attrs: dict[bool, Any] = {}

# the runtime's answers that mean "no usable CUDA here" rather than a fault of the call
_UNAVAILABLE = frozenset({"cudaErrorNoDevice", "cudaErrorInsufficientDriver", "cudaErrorCallRequiresNewerDriver"})
_INSTALL_HINT = "install cuda-python (pip install 'shmbroker[gpu]') on a machine with an NVIDIA driver"


class CudaError(RuntimeError):
    """A CUDA runtime call failed; ``call`` is the runtime function, ``name`` the CUDA error name."""

    def __init__(self, call: str, name: str, detail: str = "") -> None:
        self.call = call
        self.name = name
        super().__init__(f"{call} failed: {name}" + (f" ({detail})" if detail else ""))


class CudaUnavailable(CudaError):
    """cuda-python is not installed, there is no driver or no device: nothing CUDA can run here."""


def _runtime() -> Any:
    global _rt
    if _rt is None:
        with _load_lock:
            if _rt is None:
                try:
                    from cuda.bindings import runtime
                except ImportError as exc:
                    raise CudaUnavailable("import cuda.bindings.runtime", type(exc).__name__, _INSTALL_HINT) from exc
                _rt = runtime
    return _rt


def _error_name(rt: Any, err: Any) -> str:
    res = rt.cudaGetErrorName(err)
    if res[0] != rt.cudaError_t.cudaSuccess or res[1] is None:
        return f"cudaError {int(err)}"
    name = res[1]
    return name.decode() if isinstance(name, bytes) else str(name)


def _call(name: str, *args: Any) -> tuple[Any, ...]:
    """Run ``cuda.bindings.runtime.<name>(*args)``; the values after the error code, or CudaError."""
    rt = _runtime()
    result = getattr(rt, name)(*args)
    err = result[0]
    if err != rt.cudaError_t.cudaSuccess:
        err_name = _error_name(rt, err)
        cls = CudaUnavailable if err_name in _UNAVAILABLE else CudaError
        raise cls(name, err_name)
    return tuple(result[1:])


def available() -> bool:
    """True when cuda-python imports, a driver answers and at least one device is visible."""
    try:
        return device_count() > 0
    except CudaError as exc:
        log.debug("CUDA not available: %s", exc)
        return False


def device_count() -> int:
    """Number of visible CUDA devices (CUDA_VISIBLE_DEVICES applies)."""
    return int(_call("cudaGetDeviceCount")[0])


def set_device(ordinal: int) -> None:
    """Make ``ordinal`` the calling thread's current device (per thread: call it in every worker thread)."""
    _call("cudaSetDevice", ordinal)


def get_device() -> int:
    """The calling thread's current device."""
    return int(_call("cudaGetDevice")[0])


def device_name(ordinal: int) -> str:
    """The marketing name of the device, e.g. 'NVIDIA H200'."""
    props = _call("cudaGetDeviceProperties", ordinal)[0]
    raw = props.name
    text = raw.decode(errors="replace") if isinstance(raw, bytes) else str(raw)
    return text.split("\x00", 1)[0].strip()


def compute_capability(ordinal: int) -> tuple[int, int]:
    """(major, minor), e.g. (9, 0) for Hopper."""
    attr = _runtime().cudaDeviceAttr
    major = _call("cudaDeviceGetAttribute", attr.cudaDevAttrComputeCapabilityMajor, ordinal)[0]
    minor = _call("cudaDeviceGetAttribute", attr.cudaDevAttrComputeCapabilityMinor, ordinal)[0]
    return int(major), int(minor)


def mem_get_info() -> tuple[int, int]:
    """(free, total) bytes of the current device."""
    free_b, total_b = _call("cudaMemGetInfo")
    return int(free_b), int(total_b)


def device_synchronize() -> None:
    """Wait for all work on the current device (tests and shutdown only, never on the request path)."""
    _call("cudaDeviceSynchronize")


# ---- memory


def malloc(nbytes: int) -> int:
    """cudaMalloc on the current device; the device address."""
    return int(_call("cudaMalloc", nbytes)[0])


def free(ptr: int) -> None:
    """cudaFree (synchronizes the device: never on the request path)."""
    _call("cudaFree", ptr)


def host_alloc_pinned(nbytes: int) -> int:
    """cudaMallocHost: page-locked host memory, for benchmarks and tests (the rings are registered instead)."""
    return int(_call("cudaMallocHost", nbytes)[0])


def free_host(ptr: int) -> None:
    """cudaFreeHost of a ``host_alloc_pinned`` address."""
    _call("cudaFreeHost", ptr)


def host_register(addr: int, nbytes: int) -> None:
    """cudaHostRegister(Portable): page-lock existing host memory (a mapped ring) so copies from it go by DMA.

    Portable: the pinning holds for every device, not only the current one. Unregister before unmapping.
    """
    _call("cudaHostRegister", addr, nbytes, _runtime().cudaHostRegisterPortable)


def host_unregister(addr: int) -> None:
    """cudaHostUnregister of the address given to ``host_register``."""
    _call("cudaHostUnregister", addr)


def _free_quietly(ptr: int, host: bool) -> None:
    # finalizers run at garbage collection or interpreter exit, when the runtime may be unloading already;
    # a failure there must not raise into an unrelated frame
    try:
        (free_host if host else free)(ptr)
    except CudaError as exc:
        log.debug("freeing %#x at finalization failed: %s", ptr, exc)


class DeviceBuffer:
    """``nbytes`` of device memory on the current device, freed by ``close()``, ``with`` or garbage collection."""

    def __init__(self, nbytes: int) -> None:
        if nbytes <= 0:
            raise ValueError(f"DeviceBuffer needs a positive size, got {nbytes}")
        self.nbytes = nbytes
        self.ptr = malloc(nbytes)
        self._finalizer = weakref.finalize(self, _free_quietly, self.ptr, False)

    def close(self) -> None:
        """Free the memory now (idempotent)."""
        self._finalizer()

    def __enter__(self) -> DeviceBuffer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ---- copies


def _kind(kind: str) -> Any:
    if not _kinds:
        mk = _runtime().cudaMemcpyKind
        _kinds.update(
            h2d=mk.cudaMemcpyHostToDevice,
            d2h=mk.cudaMemcpyDeviceToHost,
            d2d=mk.cudaMemcpyDeviceToDevice,
            default=mk.cudaMemcpyDefault,
        )
    try:
        return _kinds[kind]
    except KeyError:
        raise ValueError(f"copy kind {kind!r} is not one of {sorted(_kinds)}") from None


def memcpy_async(dst: int, src: int, nbytes: int, kind: str, stream: int) -> None:
    """cudaMemcpyAsync on ``stream``; kind is 'h2d', 'd2h', 'd2d' (or 'default': inferred from the pointers).

    Asynchronous only when the host side is page-locked (registered or pinned); pageable memory is copied
    through a staging buffer and the call returns after the source has been read.
    """
    _call("cudaMemcpyAsync", dst, src, nbytes, _kind(kind), stream)


def memcpy(dst: int, src: int, nbytes: int, kind: str) -> None:
    """Synchronous cudaMemcpy (tests, warm-up and the classic-server baseline)."""
    _call("cudaMemcpy", dst, src, nbytes, _kind(kind))


def has_memcpy_batch() -> bool:
    """True when the bindings have cudaMemcpyBatchAsync (CUDA 12.8+); the driver must support it too."""
    try:
        return hasattr(_runtime(), "cudaMemcpyBatchAsync")
    except CudaUnavailable:
        return False


def memcpy_batch_async(
    dsts: Sequence[int], srcs: Sequence[int], sizes: Sequence[int], stream: int, *, prefer_overlap: bool = False
) -> None:
    """cudaMemcpyBatchAsync: many pointer-to-pointer copies in one call, in stream order as a whole.

    The copies of one batch may run in any order among themselves. ``prefer_overlap`` sets the hint
    cudaMemcpyFlagPreferOverlapWithCompute. ``stream`` must not be the legacy default stream (0).
    """
    rt = _runtime()
    if not hasattr(rt, "cudaMemcpyBatchAsync"):
        raise CudaUnavailable("cudaMemcpyBatchAsync", "not in these bindings", "needs cuda-python 12.8 or newer")
    count = len(dsts)
    if len(srcs) != count or len(sizes) != count:
        raise ValueError(f"memcpy_batch_async: {count} dsts, {len(srcs)} srcs, {len(sizes)} sizes")
    if count == 0:
        return
    attrs = _batch_attrs.get(prefer_overlap)
    if attrs is None:
        # one attribute set for every copy; srcAccessOrder must be set (its zero value is 'invalid')
        attrs = rt.cudaMemcpyAttributes()
        attrs.srcAccessOrder = rt.cudaMemcpySrcAccessOrder.cudaMemcpySrcAccessOrderStream
        if prefer_overlap:
            attrs.flags = rt.cudaMemcpyFlags.cudaMemcpyFlagPreferOverlapWithCompute
        _batch_attrs[prefer_overlap] = attrs
    _call("cudaMemcpyBatchAsync", list(dsts), list(srcs), list(sizes), count, [attrs], [0], 1, stream)


# ---- streams and events


def _destroy_quietly(call: str, handle: Any) -> None:
    try:
        _call(call, handle)
    except CudaError as exc:
        log.debug("%s at finalization failed: %s", call, exc)


class Stream:
    """A CUDA stream on the current device; non-blocking (no implicit sync with the legacy default stream)."""

    def __init__(self, *, non_blocking: bool = True) -> None:
        rt = _runtime()
        flags = rt.cudaStreamNonBlocking if non_blocking else rt.cudaStreamDefault
        self._obj = _call("cudaStreamCreateWithFlags", flags)[0]
        self.handle = int(self._obj)  # the cudaStream_t as an int, for torch.cuda.ExternalStream and TensorRT
        self._finalizer = weakref.finalize(self, _destroy_quietly, "cudaStreamDestroy", self._obj)

    def synchronize(self) -> None:
        """Block the calling thread until all work queued on the stream has finished."""
        _call("cudaStreamSynchronize", self.handle)

    def wait(self, event: Event) -> None:
        """Make later work on this stream wait for ``event`` (no host blocking)."""
        _call("cudaStreamWaitEvent", self.handle, event.handle, 0)

    def close(self) -> None:
        """Destroy the stream (idempotent); queued work still completes."""
        self._finalizer()


class Event:
    """A CUDA event. ``timing=False`` (default) is the cheaper kind; ``blocking=True`` makes ``synchronize``
    sleep in the driver instead of spinning a core (good for a completion thread that waits a long time)."""

    def __init__(self, *, timing: bool = False, blocking: bool = False) -> None:
        rt = _runtime()
        flags = 0 if timing else rt.cudaEventDisableTiming
        if blocking:
            flags |= rt.cudaEventBlockingSync
        self._obj = _call("cudaEventCreateWithFlags", flags)[0]
        self.handle = int(self._obj)
        self.timing = timing
        self._finalizer = weakref.finalize(self, _destroy_quietly, "cudaEventDestroy", self._obj)

    def record(self, stream: Stream | int) -> None:
        """Record the event at the current end of ``stream`` (a Stream or a raw handle)."""
        _call("cudaEventRecord", self.handle, stream.handle if isinstance(stream, Stream) else stream)

    def synchronize(self) -> None:
        """Block until the work before the last ``record`` has finished."""
        _call("cudaEventSynchronize", self.handle)

    def query(self) -> bool:
        """True when the recorded work has finished, False while it runs; never blocks."""
        rt = _runtime()
        err = rt.cudaEventQuery(self.handle)[0]
        if err == rt.cudaError_t.cudaSuccess:
            return True
        if err == rt.cudaError_t.cudaErrorNotReady:
            return False
        raise CudaError("cudaEventQuery", _error_name(rt, err))

    def close(self) -> None:
        """Destroy the event (idempotent)."""
        self._finalizer()


def elapsed_ms(start: Event, end: Event) -> float:
    """Milliseconds between two recorded, completed timing events (``Event(timing=True)``)."""
    return float(_call("cudaEventElapsedTime", start.handle, end.handle)[0])


__all__ = [
    "CudaError",
    "CudaUnavailable",
    "DeviceBuffer",
    "Event",
    "Stream",
    "available",
    "compute_capability",
    "device_count",
    "device_name",
    "device_synchronize",
    "elapsed_ms",
    "free",
    "free_host",
    "get_device",
    "has_memcpy_batch",
    "host_alloc_pinned",
    "host_register",
    "host_unregister",
    "malloc",
    "mem_get_info",
    "memcpy",
    "memcpy_async",
    "memcpy_batch_async",
    "set_device",
]
