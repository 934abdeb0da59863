"""One model's runner thread: take a batch, gather it from the slots, run the engine, write results back.

``BatchRunner`` is what every runner shares (the batcher, counters, the thread, answering and completing
requests); ``ModelRunner`` runs a host engine (ONNX Runtime on the CPU); ``gpu_worker.pipeline`` drives a
device engine with the same base.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import ClassVar

import numpy as np

from shmbroker.broker.common import proc
from shmbroker.broker.common import protocol as P
from shmbroker.broker.common.protocol import SlotState
from shmbroker.gpu_worker.batcher import Batcher, Take
from shmbroker.gpu_worker.codec import ModelCodec
from shmbroker.gpu_worker.engines.base import Engine
from shmbroker.gpu_worker.intake import ModelView, input_arrays
from shmbroker.gpu_worker.work import ModelCounters, Work, complete_ok, reply

log = logging.getLogger(__name__)

Progress = Callable[[str], None]  # told each step of a long start (the worker sends it on to the broker)


def quiet(step: str) -> None:
    """A ``Progress`` that tells no one."""

INLINE_BELOW_S = 200e-6
# One sample moves the average by at most a tenth of this: a run stretched by the hypervisor or a
# preempted core (milliseconds on a busy virtual machine) must not flip a cheap model to its runner thread.
RUN_SAMPLE_CAP_S = 2 * INLINE_BELOW_S


class BatchRunner:
    """One model's batches: a thread runs ``_loop`` until ``stop``. Subclasses say how a batch runs.

    Contract: every Work taken from the batcher is answered exactly once (``complete_ok``, ``reply``).
    """

    # whether ``try_inline(watch=True)`` may leave a batch for the caller to poll (``end_seen``)
    watches_ends: ClassVar[bool] = False

    def __init__(self, model: ModelView, engine: Engine, batcher: Batcher[Work], counters: ModelCounters) -> None:
        self.model = model
        self.engine = engine
        self.codec = ModelCodec(model)
        self.batcher = batcher
        self.counters = counters
        self._stop = threading.Event()
        self._busy = threading.Lock()  # held while a batch runs, on the runner or inline
        self.avg_run_s = INLINE_BELOW_S  # moving average of the engine's run time; warm-up primes it
        self._thread = threading.Thread(target=self._loop, name=f"runner-{model.name}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Stop taking batches, let the running ones finish, answer what was still queued."""
        self._stop.set()
        left = self.batcher.close()
        for t in self._threads():
            t.join(timeout=30)
        self.answer_expired(left, P.Status.SHUTTING_DOWN, "the worker is shutting down")

    def _threads(self) -> list[threading.Thread]:
        return [self._thread]

    def answer_expired(self, entries: list[Work], status: P.Status, message: str) -> None:
        if entries:
            self.counters.count(status, len(entries))
            reply(entries, status, message)

    def answer_timed_out(self, take: Take[Work]) -> None:
        self.answer_expired(take.expired, P.Status.TIMEOUT,
                            f"deadline passed before model {self.model.name!r} could run it")

    def fail(self, works: list[Work], exc: BaseException) -> None:
        """An engine failure fails its batch, not the worker."""
        log.error("model %s failed a batch of %d requests: %s: %s", self.model.name, len(works),
                  type(exc).__name__, exc, exc_info=exc)
        self.counters.count(P.Status.INTERNAL, len(works))
        reply(works, P.Status.INTERNAL, f"model {self.model.name!r} failed: {type(exc).__name__}")

    def _loop(self) -> None:
        self._take_loop(self._run, self._busy)

    def _take_loop(self, run: Callable[[Take[Work]], None], lock: AbstractContextManager[object]) -> None:
        """Until stop: (1) take a due batch, then ``run`` it holding ``lock``."""
        proc.name_thread(threading.current_thread().name)
        while not self._stop.is_set():
            take = self.batcher.take(timeout=0.5)  # (1)
            if take is not None:
                with lock:
                    run(take)

    def _run(self, take: Take[Work]) -> None:
        raise NotImplementedError

    def warm_up(self, progress: Progress = quiet) -> None:
        """Prepare the runner's own resources after the engine's warm-up (the GPU pipeline's streams), telling
        ``progress`` each long step."""

    def try_inline(self, watch: bool = False) -> bool:
        """Run a due batch on the caller's (intake) thread when the model is cheap and the runner idle.

        For a model whose batches take less than ``INLINE_BELOW_S``, handing the batch to the runner thread
        costs more than running it; a slow model is always left to its runner so intake never stalls.
        ``watch``: the caller will poll ``end_seen`` and call ``unwatch`` (only a device runner keeps one).
        """
        if not self.cheap or not self._busy.acquire(blocking=False):
            self.batcher.kick()
            return False
        try:
            take = self.batcher.take_now()
            if take is None:
                self.batcher.kick()  # queued but not due yet: the runner waits out max_queue_delay_us
                return False
            self._run(take)
            return True
        finally:
            self._busy.release()

    def end_seen(self) -> bool:
        """For the intake thread's spin: answer the watched batch if it has ended (True). A device runner
        watches a lone batch launched with ``try_inline(watch=True)`` (gpu_worker.pipeline); a CPU runner's
        inline batch is answered before ``try_inline`` returns."""
        return False

    def unwatch(self) -> None:
        """The intake thread stops spinning: a batch it watched goes to the completion thread."""

    def note_run_time(self, seconds: float) -> None:
        """Feed the moving average of the engine's run time (warm-up primes it); a sample counts at most
        ``RUN_SAMPLE_CAP_S``, so only a run of costly batches, not one outlier, turns a model expensive."""
        self.avg_run_s += (min(seconds, RUN_SAMPLE_CAP_S) - self.avg_run_s) * 0.1

    @property
    def cheap(self) -> bool:
        return self.avg_run_s < INLINE_BELOW_S


class _Buffers:
    """One instance's batch buffers: a batch of several requests is gathered into them."""

    def __init__(self, model: ModelView) -> None:
        self.arrays = [np.empty((model.max_batch, *s.item_shape), dtype=s.dtype) for s in model.inputs]
        self.bytes = [b.data.cast("B") for b in self.arrays]


class ModelRunner(BatchRunner):
    """A host engine: (1) take a batch, (2) answer the expired, (3) gather, (4) run, (5) complete.

    ``instances`` batches run at once, each on its own thread with its own buffers (an engine's ``run`` is
    thread-safe). The first instance's thread and the inline runs share one set, serialized by ``_busy``.
    ``lone``: the same model on every instance's threads, for a batch that runs alone (no other batch of the
    model runs when it starts), so that the cores of idle instances help it instead of sitting idle.
    """

    inputs_run_time = False  # whether (3) counts as the batch's run time (which decides inline runs)

    def __init__(self, model: ModelView, engine: Engine, batcher: Batcher[Work], counters: ModelCounters,
                 instances: int = 1, lone: Engine | None = None) -> None:
        super().__init__(model, engine, batcher, counters)
        self.lone = lone
        self._bufs = _Buffers(model)
        # further instances: their own buffers, and no lock (only the first instance shares its buffers)
        self._more = [
            threading.Thread(target=self._take_loop, name=f"runner-{model.name}-{i}", daemon=True,
                             args=(functools.partial(self._run_on, bufs=_Buffers(model)), contextlib.nullcontext()))
            for i in range(1, instances)
        ]
        self._in_item_bytes = [s.item_bytes for s in model.inputs]
        self._names = [s.name for s in model.inputs]
        self._out_item_bytes = [s.item_bytes for s in model.outputs]

    def start(self) -> None:
        super().start()
        for t in self._more:
            t.start()

    def stop(self) -> None:
        super().stop()
        if self.lone is not None:  # made for this runner alone; the worker closes the shared engine
            self.lone.close()

    def _threads(self) -> list[threading.Thread]:
        return [self._thread, *self._more]

    def _run(self, take: Take[Work]) -> None:
        self._run_on(take, self._bufs)

    def _run_on(self, take: Take[Work], bufs: _Buffers) -> None:
        self.answer_timed_out(take)  # (2)
        if not take.batch:
            return
        works = take.batch
        try:
            try:
                # CPU time of this thread: wall time would count the hypervisor's steal and preemption
                t0 = time.thread_time() if self.inputs_run_time else 0.0
                works, feeds, rows = self._inputs(works, bufs)  # (3)
                if not works:
                    return
                if not self.inputs_run_time:
                    t0 = time.thread_time()
                lone = self.lone if self.batcher.running <= 1 else None  # this batch is the only one running
                outputs = (lone or self.engine).run(feeds)  # (4)
                self.note_run_time(time.thread_time() - t0)
            except Exception as exc:  # noqa: BLE001 - an engine failure fails this batch (logged), not the worker
                self.fail(works, exc)
                return
            self.counters.batch(rows)
            self._complete(works, outputs)  # (5)
        finally:
            self.batcher.done()  # the instance is free: with idle dispatch, what is queued may leave now

    def _inputs(self, works: list[Work], bufs: _Buffers) -> tuple[list[Work], dict[str, np.ndarray], int]:
        """(3) The requests that run, the engine's feeds and their rows; a subclass may answer some requests here
        (and then leaves them out)."""
        feeds, rows = self._gather(works, bufs)
        return works, feeds, rows

    def _gather(self, works: list[Work], bufs: _Buffers) -> tuple[dict[str, np.ndarray], int]:
        names = self._names
        if len(works) == 1:  # the slot itself is the batch: no copy
            w = works[0]
            canon = self.codec.rows.get(w.rows)
            if canon is not None and w.req.tensors is canon.in_descs:
                return self._slot_views(w)[0], w.rows
            # offsets of its own: views for this request only
            return dict(zip(names, input_arrays(w.session, w.req, self.model), strict=True)), w.rows
        row = 0
        item_bytes, buf_bytes = self._in_item_bytes, bufs.bytes
        for w in works:
            seg = w.session.segment
            base = seg.layout.input_bases[w.req.slot]
            for t in w.req.tensors:  # in any order: ``index`` says which input (checked unique at intake)
                ib = item_bytes[t.index]
                start = base + t.offset
                # a plain memcpy from the slot into the batch buffer; the descriptor was checked at intake
                buf_bytes[t.index][row * ib : (row + w.rows) * ib] = seg.buf[start : start + t.nbytes]
            row += w.rows
        return {n: b[:row] for n, b in zip(names, bufs.arrays, strict=True)}, row

    def _complete(self, works: list[Work], outputs: list[np.ndarray]) -> None:
        if len(works) == 1:
            self._complete_one(works[0], outputs)
            return
        sources = [np.ascontiguousarray(a, dtype=s.dtype).data.cast("B") for a, s in zip(outputs, self.model.outputs,
                                                                                          strict=True)]
        item_bytes = self._out_item_bytes
        canon = self.codec.rows
        row = 0
        for w in works:
            seg, rows = w.session.segment, w.rows
            base = seg.layout.output_bases[w.req.slot]
            for src, ib, off in zip(sources, item_bytes, canon[rows].out_offsets, strict=True):
                # canonical offsets, which fit out_capacity for every row count the session allows
                start = base + off
                seg.buf[start : start + rows * ib] = src[row * ib : (row + rows) * ib]
            row += rows
        complete_ok(self.codec, self.counters, works)

    def _complete_one(self, w: Work, outputs: list[np.ndarray]) -> None:
        """A batch of one request: its outputs go through the slot's canonical views."""
        for dst, src in zip(self._slot_views(w)[1], outputs, strict=True):
            np.copyto(dst, src, casting="unsafe")  # as ascontiguousarray(dtype=...) converts for a batch
        self.counters.count(P.Status.OK)
        w.session.finish([w.req.slot], SlotState.DONE, P.Status.OK, self.codec.done_ok(w.session.session_id, [w]))

    def _slot_views(self, w: Work) -> tuple[dict[str, np.ndarray], list[np.ndarray]]:
        """Views of ``w``'s slot at the canonical offsets of its row count (inputs by name, outputs), built at
        the first one-request batch in that slot with that row count and kept by the session."""
        key = (self.model.model_id, w.req.slot, w.rows)
        views = w.session.views.get(key)
        if views is None:
            seg, slot, rows = w.session.segment, w.req.slot, w.rows
            ins = {s.name: seg.input_view(slot, d.offset, s.dtype, d.shape)
                   for d, s in zip(self.codec.rows[rows].in_descs, self.model.inputs, strict=True)}
            outs = [seg.output_view(slot, off, s.dtype, (rows, *s.item_shape))
                    for off, s in zip(self.codec.rows[rows].out_offsets, self.model.outputs, strict=True)]
            views = w.session.views[key] = (ins, outs)
        return views
