"""gpu_worker.cuda on a real device: queries, memory, copies (registered, pageable, batched), streams, events."""

from __future__ import annotations

import ctypes
import mmap
import time

import numpy as np
import pytest

from shmbroker.gpu_worker import cuda
from tests.gpu.conftest import requires_cuda

pytestmark = requires_cuda


def test_device_queries() -> None:
    assert cuda.device_count() >= 1
    cuda.set_device(0)
    assert cuda.get_device() == 0
    name, cc = cuda.device_name(0), cuda.compute_capability(0)
    free_b, total_b = cuda.mem_get_info()
    print(f"\ndevice 0: {name}, compute capability {cc[0]}.{cc[1]}, {free_b >> 20} MiB free of {total_b >> 20}")
    assert name and cc >= (3, 0) and 0 < free_b <= total_b


def test_error_carries_the_cuda_name() -> None:
    with pytest.raises(cuda.CudaError) as info:
        cuda.set_device(10_000)
    assert info.value.call == "cudaSetDevice"
    assert info.value.name == "cudaErrorInvalidDevice"
    assert "cudaErrorInvalidDevice" in str(info.value)


def test_round_trip_sync_and_async(stream: cuda.Stream) -> None:
    src = np.arange(1 << 16, dtype=np.float32)
    back = np.zeros_like(src)
    with cuda.DeviceBuffer(src.nbytes) as buf:
        cuda.memcpy(buf.ptr, src.ctypes.data, src.nbytes, "h2d")
        cuda.memcpy(back.ctypes.data, buf.ptr, src.nbytes, "d2h")
        np.testing.assert_array_equal(back, src)
        other = cuda.DeviceBuffer(src.nbytes)
        done = cuda.Event()
        cuda.memcpy_async(other.ptr, buf.ptr, src.nbytes, "d2d", stream.handle)
        back[:] = 0
        cuda.memcpy_async(back.ctypes.data, other.ptr, src.nbytes, "d2h", stream.handle)
        done.record(stream)
        done.synchronize()
        assert done.query()
        np.testing.assert_array_equal(back, src)
        other.close()
        other.close()  # idempotent
        done.close()


def _gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


def test_registered_memory_copies_by_dma(stream: cuda.Stream) -> None:
    """A registered mapping (as the rings are) copies at DMA speed; pageable memory much slower."""
    nbytes = 64 << 20
    region = mmap.mmap(-1, nbytes)
    host = np.frombuffer(region, dtype=np.uint8)
    host[:] = np.arange(nbytes, dtype=np.uint64).astype(np.uint8)
    pageable = np.array(host)  # a fresh pageable copy
    start, end = cuda.Event(timing=True), cuda.Event(timing=True)
    with cuda.DeviceBuffer(nbytes) as dev:
        cuda.host_register(host.ctypes.data, nbytes)
        try:
            cuda.memcpy_async(dev.ptr, host.ctypes.data, nbytes, "h2d", stream.handle)  # warm the path
            start.record(stream)
            for _ in range(3):
                cuda.memcpy_async(dev.ptr, host.ctypes.data, nbytes, "h2d", stream.handle)
            end.record(stream)
            end.synchronize()
            registered = _gbps(3 * nbytes, cuda.elapsed_ms(start, end) / 1e3)
            back = np.zeros(nbytes, dtype=np.uint8)
            cuda.memcpy(back.ctypes.data, dev.ptr, nbytes, "d2h")
            assert np.array_equal(back, host)
        finally:
            cuda.host_unregister(host.ctypes.data)
        t0 = time.perf_counter()
        for _ in range(3):
            cuda.memcpy_async(dev.ptr, pageable.ctypes.data, nbytes, "h2d", stream.handle)
        stream.synchronize()
        paged = _gbps(3 * nbytes, time.perf_counter() - t0)
    del host
    region.close()
    print(f"\nH2D 64 MiB: registered mmap {registered:.1f} GB/s, pageable {paged:.1f} GB/s")
    assert registered > paged


def test_batch_copy_gathers_rows(stream: cuda.Stream) -> None:
    if not cuda.has_memcpy_batch():
        pytest.skip("these bindings have no cudaMemcpyBatchAsync")
    rows, row_bytes = 8, 4096 + 64
    pinned = cuda.host_alloc_pinned(rows * 2 * row_bytes)
    try:
        host = np.ctypeslib.as_array((ctypes.c_uint8 * (rows * 2 * row_bytes)).from_address(pinned))
        host[:] = np.random.default_rng(1).integers(0, 255, host.size, dtype=np.uint8)
        with cuda.DeviceBuffer(rows * row_bytes) as dev:
            srcs = [pinned + 2 * r * row_bytes for r in range(rows)]  # every other row: a gather
            dsts = [dev.ptr + r * row_bytes for r in range(rows)]
            cuda.memcpy_batch_async(dsts, srcs, [row_bytes] * rows, stream.handle)
            back = np.zeros(rows * row_bytes, dtype=np.uint8)
            cuda.memcpy_async(back.ctypes.data, dev.ptr, back.nbytes, "d2h", stream.handle)
            stream.synchronize()
        want = host.reshape(rows, 2 * row_bytes)[:, :row_bytes].reshape(-1)
        np.testing.assert_array_equal(back, want)
    finally:
        cuda.free_host(pinned)


def test_stream_waits_for_event_of_another() -> None:
    a, b = cuda.Stream(), cuda.Stream()
    src = np.full(1 << 20, 7, dtype=np.uint8)
    back = np.zeros_like(src)
    ev = cuda.Event(blocking=True)
    with cuda.DeviceBuffer(src.nbytes) as buf:
        cuda.memcpy_async(buf.ptr, src.ctypes.data, src.nbytes, "h2d", a.handle)
        ev.record(a)
        b.wait(ev)
        cuda.memcpy_async(back.ctypes.data, buf.ptr, src.nbytes, "d2h", b.handle)
        b.synchronize()
    assert (back == 7).all()
    for obj in (ev, a, b):
        obj.close()
