"""In the bench process, no broker: (a'') the worker's data path on the device, copies included.

The copy-free limit (``gpu_inprocess.limit``) is what the GPU can do with the model. The broker also moves
every input from a ring to the device and every output back, on the same device, while other batches
compute. This figure runs that device work alone: the worker's own stream slots (``StreamSlot``) take batches
of ``rows`` round-robin, each batch one copy per row and tensor from a registered ring segment into the slot's
input buffers (one ``cudaMemcpyBatchAsync`` where the runtime has it, as the worker issues them), ``enqueue``,
the outputs back into the ring, the end event; a slot is reused once its end has completed. No sockets,
no intake, no completion thread: against it, what the broker loses on the host; against the copy-free limit,
what the copies cost the device.
"""

from __future__ import annotations

import contextlib
import secrets
import time
from collections.abc import Iterator

from shmbroker.bench.common import Figures
from shmbroker.broker.common.ring import RingLayout, Segment, segment_name
from shmbroker.gpu_worker import cuda
from shmbroker.gpu_worker.engines.base import DeviceEngine
from shmbroker.gpu_worker.streams import EVENT_STAGES, StreamSlot, issue

MIN_BATCHES = 8  # per stream slot, whatever the duration

CopyLists = tuple[list[int], list[int], list[int]]


def copy_lists(engine: DeviceEngine, slot: StreamSlot, seg: Segment, rows: int) -> tuple[CopyLists, CopyLists]:
    """(H2D, D2H) lists (destinations, sources, sizes) of one batch: row ``r`` lives in ring slot ``r``, its
    tensors one after another in the slot's input and output regions, as a client lays them out."""
    h2d: CopyLists = ([], [], [])
    d2h: CopyLists = ([], [], [])
    for r in range(rows):
        off = 0
        for k, spec in enumerate(engine.inputs):
            _add(h2d, slot.ctx.input_ptrs[k] + r * spec.item_bytes, seg.address + seg.layout.input_bases[r] + off,
                 spec.item_bytes)
            off += spec.item_bytes
        off = 0
        for k, spec in enumerate(engine.outputs):
            _add(d2h, seg.address + seg.layout.output_bases[r] + off, slot.ctx.output_ptrs[k] + r * spec.item_bytes,
                 spec.item_bytes)
            off += spec.item_bytes
    return h2d, d2h


def _add(lists: CopyLists, dst: int, src: int, nbytes: int) -> None:
    lists[0].append(dst)
    lists[1].append(src)
    lists[2].append(nbytes)


def with_copies(engine: DeviceEngine, streams: int, rows: int, duration_s: float) -> Figures:
    """Batches of ``rows`` on ``streams`` stream slots with their copies, for about ``duration_s``: wall-clock
    images/s and the mean event-timed H2D, compute and D2H of a batch (compute stretches where batches share
    the device).

    Raises:
        cuda.CudaError: a copy, launch or context failed (the caller reports it as this figure's error).
    """
    in_bytes = sum(s.item_bytes for s in engine.inputs)
    out_bytes = sum(s.item_bytes for s in engine.outputs)
    slots: list[StreamSlot] = []
    with registered_ring(RingLayout(1, rows, in_bytes, out_bytes)) as seg:
        try:
            for i in range(streams):
                slots.append(StreamSlot(i, engine, rows))
            return run_batches(engine, slots, seg, rows, duration_s)
        finally:
            for s in slots:
                s.stream.synchronize()
                s.close()


@contextlib.contextmanager
def registered_ring(layout: RingLayout) -> Iterator[Segment]:
    """A ring segment of ``layout``, page-locked for DMA (cudaHostRegister) as a session's ring is, for the
    span of a ``with``; its copies must be finished when the block ends."""
    seg = Segment.create(segment_name("bench" + secrets.token_hex(4), 0), layout)
    try:
        cuda.host_register(seg.address, seg.nbytes)
        try:
            yield seg
        finally:
            cuda.host_unregister(seg.address)
    finally:
        seg.close()


def run_batches(engine: DeviceEngine, slots: list[StreamSlot], seg: Segment, rows: int, duration_s: float) -> Figures:
    """Batches of ring slots ``0..rows-1`` round-robin on ``slots`` (registered ``seg``), at least MIN_BATCHES a
    slot; the figures of ``with_copies``. Every batch's outputs are in the ring when this returns."""
    batched = cuda.has_memcpy_batch()
    lists = [copy_lists(engine, s, seg, rows) for s in slots]

    def launch(i: int) -> None:
        slot, (h2d, d2h) = slots[i], lists[i]
        h = slot.stream.handle
        slot.start.record(slot.stream)
        issue(*h2d, "h2d", h, batched)
        slot.copied_in.record(slot.stream)
        slot.began.record(slot.stream)
        slot.ctx.enqueue(rows)
        slot.computed.record(slot.stream)
        issue(*d2h, "d2h", h, batched)
        slot.end.record(slot.stream)

    for i in range(len(slots)):  # warm: graphs, the registration's first touch
        launch(i)
    for s in slots:
        s.end.synchronize()
    sums = [0.0] * len(EVENT_STAGES)
    n = 0
    t0 = time.perf_counter()
    while n < MIN_BATCHES * len(slots) or time.perf_counter() - t0 < duration_s:
        i = n % len(slots)
        if n >= len(slots):
            _reuse(slots[i], sums)
        launch(i)
        n += 1
    for i in range(max(0, n - len(slots)), n):
        _reuse(slots[i % len(slots)], sums)
    wall = time.perf_counter() - t0
    return {"streams": len(slots), "batch": rows, "batches": n, "seconds": round(wall, 3),
            "batched_copies": batched, "items_per_s": round(n * rows / wall, 1),
            **{f"{name}_ms": round(v / n, 4) for name, v in zip(EVENT_STAGES, sums, strict=True)}}


def _reuse(slot: StreamSlot, sums: list[float]) -> None:
    """Wait for the slot's last batch and add its stages."""
    slot.end.synchronize()
    for k, ms in enumerate(slot.stage_ms()):
        sums[k] += ms
