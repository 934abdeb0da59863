"""A model's stream slots, and the copies of one batch between ring slots and a slot's device buffers.

A stream slot is everything one batch in flight needs, made once at start: a CUDA stream, the engine's
context for that stream (device input and output buffers for ``max_batch`` rows), and five timing events
that split the batch into its stages (H2D, wait, compute, D2H). Nothing here allocates per batch.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

from shmbroker.gpu_worker import cuda
from shmbroker.gpu_worker.codec import ModelCodec
from shmbroker.gpu_worker.engines.base import DeviceContext, DeviceEngine
from shmbroker.gpu_worker.work import Work

log = logging.getLogger(__name__)

EVENT_STAGES = ("h2d", "wait", "compute", "d2h")  # the names of ``StreamSlot.stage_ms``'s figures, in order


class StreamSlot:
    """One batch in flight at a time. Owned by the runner thread from launch, by the completion thread from
    the hand-off until it is returned to the free pool."""

    def __init__(self, index: int, engine: DeviceEngine, max_batch: int) -> None:
        self.index = index
        self.stream = cuda.Stream()
        self.events: list[cuda.Event] = []
        self.context: DeviceContext | None = None
        try:
            self.events = [cuda.Event(timing=True) for _ in range(4)]
            # the completion thread sleeps on this one in the driver instead of spinning a core
            self.events.append(cuda.Event(timing=True, blocking=True))
            self.context = engine.create_context(index, self.stream.handle, max_batch)
        except BaseException:
            self.close()
            raise
        # began: where the compute may start, after the previous batch's compute (serial_compute)
        self.start, self.copied_in, self.began, self.computed, self.end = self.events
        self.works: list[Work] = []
        self.rows = 0
        self.launched = 0.0  # time.monotonic() of the last launch
        self.issue_s = 0.0  # how long the host took to issue it
        self.expected_s = 0.0  # its expected device time (``LaunchPlan.launched``)
        self.filled = False  # its rows were copied while it filled (``PipelineRunner._fill``)

    @property
    def ctx(self) -> DeviceContext:
        if self.context is None:
            raise RuntimeError(f"stream slot {self.index} is closed")
        return self.context

    def stage_ms(self) -> tuple[float, float, float, float]:
        """(H2D, wait, compute, D2H) milliseconds of the last batch; its end event must have completed. The
        wait is from its inputs' arrival to the end of the compute it waited for, if any."""
        return (cuda.elapsed_ms(self.start, self.copied_in), cuda.elapsed_ms(self.copied_in, self.began),
                cuda.elapsed_ms(self.began, self.computed), cuda.elapsed_ms(self.computed, self.end))

    def close(self) -> None:
        """Release the context, events and stream (idempotent); the stream's work must be finished."""
        if self.context is not None:
            self.context.close()
            self.context = None
        for ev in self.events:
            ev.close()
        self.stream.close()


class CopyPlan:
    """Builds one batch's copy lists (destination, source, size) and issues them on a stream.

    Inputs go from each request's slot (``segment.address`` + the slot's input base + the tensor's offset)
    into its rows of the context's input buffers; outputs from the context's output buffers into the
    request's own slot at the canonical offsets, where the CPU runner writes them too.
    ``batched``: one cudaMemcpyBatchAsync per direction instead of one cudaMemcpyAsync per tensor.
    """

    def __init__(self, codec: ModelCodec, batched: bool) -> None:
        self.codec = codec
        self.batched = batched
        self.in_items = [s.item_bytes for s in codec.model.inputs]
        self.out_items = [s.item_bytes for s in codec.model.outputs]

    def inputs(self, works: list[Work], ptrs: list[int], row: int = 0) -> tuple[list[int], list[int], list[int], int]:
        """The H2D copies of ``works`` into rows from ``row`` on, and the row after them."""
        dsts: list[int] = []
        srcs: list[int] = []
        sizes: list[int] = []
        in_items = self.in_items
        for w in works:
            session = w.session
            session.ensure_registered()
            base = session.segment.address + session.layout.input_bases[w.req.slot]
            for t in w.req.tensors:  # in any order: ``index`` says which input (checked unique at intake)
                dsts.append(ptrs[t.index] + row * in_items[t.index])
                srcs.append(base + t.offset)
                sizes.append(t.nbytes)
            row += w.rows
        return dsts, srcs, sizes, row

    def outputs(self, works: list[Work], ptrs: list[int]) -> tuple[list[int], list[int], list[int]]:
        dsts: list[int] = []
        srcs: list[int] = []
        sizes: list[int] = []
        row = 0
        out_items = self.out_items
        canon = self.codec.rows
        for w in works:
            session = w.session
            # a photo model's requests reach the device through its stage, never ``inputs``: into a pageable
            # ring, cudaMemcpyAsync would hold the runner until the batch had computed
            session.ensure_registered()
            base = session.segment.address + session.layout.output_bases[w.req.slot]
            rows = w.rows
            for k, off in enumerate(canon[rows].out_offsets):  # fit every row count the session allows
                dsts.append(base + off)
                srcs.append(ptrs[k] + row * out_items[k])
                sizes.append(rows * out_items[k])
            row += rows
        return dsts, srcs, sizes

    def issue(self, dsts: Sequence[int], srcs: Sequence[int], sizes: Sequence[int], kind: str, stream: int) -> None:
        issue(dsts, srcs, sizes, kind, stream, self.batched)


def issue(dsts: Sequence[int], srcs: Sequence[int], sizes: Sequence[int], kind: str, stream: int,
          batched: bool) -> None:
    """Queue the copies on ``stream``: one cudaMemcpyBatchAsync, or one cudaMemcpyAsync each."""
    if batched and len(dsts) > 1:
        cuda.memcpy_batch_async(dsts, srcs, sizes, stream)
        return
    for d, s, n in zip(dsts, srcs, sizes, strict=True):
        cuda.memcpy_async(d, s, n, kind, stream)


def probe_batched_copies(slot: StreamSlot, item_bytes: int, rows: int, reps: int = 20) -> dict[str, float | bool]:
    """Whether one cudaMemcpyBatchAsync issues ``rows`` row copies faster than one cudaMemcpyAsync per row.

    Measured on this machine at warm-up: the issuing thread's time (which the pipeline pays while holding
    the GIL), best of ``reps``, copying from page-locked host memory (allocated and freed here, never on the
    request path) into the slot's first input buffer. ``batched`` is False where the call is missing or fails.
    """
    out: dict[str, float | bool] = {"batched": False, "rows": rows}
    if rows < 2 or not cuda.has_memcpy_batch():
        return out
    host = cuda.host_alloc_pinned(rows * item_bytes)
    dsts = [slot.ctx.input_ptrs[0] + i * item_bytes for i in range(rows)]
    srcs = [host + i * item_bytes for i in range(rows)]
    sizes = [item_bytes] * rows
    try:
        for name, batched in (("per_call_us", False), ("batched_us", True)):
            best = float("inf")
            for _ in range(reps):
                t0 = time.perf_counter()
                issue(dsts, srcs, sizes, "h2d", slot.stream.handle, batched)
                best = min(best, time.perf_counter() - t0)
                slot.stream.synchronize()
            out[name] = round(best * 1e6, 1)
        out["batched"] = out["batched_us"] < out["per_call_us"]
    except cuda.CudaError as exc:
        log.warning("cudaMemcpyBatchAsync probe failed (%s); one copy call per tensor", exc)
        out["batched"] = False
    finally:
        slot.stream.synchronize()
        cuda.free_host(host)
    return out
