"""The worker's rings are really page-locked: a 64 MiB input region of a ring slot, registered the way a GPU
worker registers a session (``WorkerSession.ensure_registered``), copies to the device at DMA speed, measured
in the same run as the same copy from ordinary (pageable) memory. Skipped where there is no CUDA device."""

from __future__ import annotations

import os
import secrets
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import zmq

from shmbroker.broker.common import protocol as P
from shmbroker.broker.common.peergate import PeerGate
from shmbroker.broker.common.ring import RingLayout, Segment, segment_name
from shmbroker.gpu_worker import cuda
from shmbroker.gpu_worker.sessions import WorkerSession

pytestmark = pytest.mark.skipif(not cuda.available(), reason="needs a CUDA device and cuda-python")

MIB64 = 64 << 20
REPS = 10
MIN_GBPS = 40.0


@pytest.fixture
def big_session(tmp_path: Path) -> Iterator[WorkerSession]:
    """A real segment with one 64 MiB slot, attached as a GPU worker attaches a session."""
    layout = RingLayout(session_id=7, n_slots=1, in_capacity=MIB64, out_capacity=4096)
    seg = Segment.create(segment_name("t" + secrets.token_hex(4), 0), layout)
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    attach = P.Attach(7, 1234, layout.total_bytes, 1, layout.slot_stride, MIB64, 4096, 1, os.getuid())
    gate = PeerGate(ctx)
    session = WorkerSession(ctx, attach, Segment.from_fd(seg.duplicate(), layout), 0, tmp_path, 0o600, None, gate)
    try:
        yield session
    finally:
        session.close()
        seg.close()
        gate.close()
        ctx.term()


def _h2d_gbps(src: int, dst: int, stream: cuda.Stream) -> float:
    """GB/s of REPS back-to-back 64 MiB host-to-device copies (one untimed first)."""
    cuda.memcpy_async(dst, src, MIB64, "h2d", stream.handle)
    stream.synchronize()
    t0 = time.perf_counter()
    for _ in range(REPS):
        cuda.memcpy_async(dst, src, MIB64, "h2d", stream.handle)
    stream.synchronize()
    return REPS * MIB64 / (time.perf_counter() - t0) / 1e9


def _memory_type(addr: int) -> str:
    from cuda.bindings import runtime as rt

    err, attrs = rt.cudaPointerGetAttributes(addr)
    if err != rt.cudaError_t.cudaSuccess:
        raise AssertionError(f"cudaPointerGetAttributes: {err}")
    return str(rt.cudaMemoryType(attrs.type).name)


def test_a_registered_ring_slot_copies_at_dma_speed(big_session: WorkerSession) -> None:
    cuda.set_device(0)
    seg = big_session.segment
    slot_input = seg.address + seg.layout.input_bases[0]
    pattern = np.random.default_rng(3).integers(0, 256, MIB64, dtype=np.uint8)
    np.frombuffer(seg.buf, np.uint8, MIB64, seg.layout.input_bases[0])[:] = pattern  # the client's write
    pageable = pattern.copy()
    stream = cuda.Stream()
    try:
        with cuda.DeviceBuffer(MIB64) as dev:
            assert _memory_type(slot_input) == "cudaMemoryTypeUnregistered"
            pageable_gbps = _h2d_gbps(pageable.ctypes.data, dev.ptr, stream)
            assert big_session.ensure_registered()
            assert _memory_type(slot_input) == "cudaMemoryTypeHost"
            ring_gbps = _h2d_gbps(slot_input, dev.ptr, stream)
            back = np.empty(MIB64, np.uint8)
            cuda.memcpy(back.ctypes.data, dev.ptr, MIB64, "d2h")
    finally:
        stream.close()
    print(f"H2D of 64 MiB: ring slot (registered) {ring_gbps:.1f} GB/s, pageable {pageable_gbps:.1f} GB/s")
    assert np.array_equal(back, pattern)
    assert ring_gbps >= MIN_GBPS, f"registered ring slot: {ring_gbps:.1f} GB/s (pageable {pageable_gbps:.1f})"
    assert ring_gbps > pageable_gbps


def test_registration_happens_once_and_close_releases_it(big_session: WorkerSession) -> None:
    cuda.set_device(0)
    seg = big_session.segment
    assert big_session.ensure_registered() and big_session.ensure_registered()  # the second is a no-op
    base = seg.address
    big_session.close()  # unregisters, then unmaps
    with pytest.raises(cuda.CudaError) as info:
        cuda.host_unregister(base)  # nothing is registered there any more
    assert info.value.name == "cudaErrorHostMemoryNotRegistered"
