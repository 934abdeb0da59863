"""The GPU runner: one model's batches go through a pool of stream slots, several in flight at once.

Runner thread, per batch: (1) take a free stream slot, then a batch (while every slot is busy, requests
keep queueing, so batches grow with the load; while the device computes, a batch that is not full waits
until the device is about to need it, ``LaunchPlan``, and takes a size the engine runs without padding; with
early copies it opens at once and fills on the device, ``_fill``);
while the device is idle the intake thread launches a due batch itself (``try_inline``), so a lone request
waits for no thread's wake-up; (2) answer the expired;
(3) gather: async H2D of each request from its registered ring slot straight into its rows of the slot's
device input buffer; (4) enqueue the engine on the slot's stream, behind the previous batch's compute while
that one still runs (``serial_compute``); (5) async D2H of each request's rows straight into its own ring
slot; (6) record the end event and hand the slot to the completion thread (a lone short batch that the
spinning intake thread launched stays with it: it polls the end in its spin and answers the batch itself,
``end_seen``, until it stops spinning or another batch launches).
Completion thread: (7) wait for each batch's end event in launch order (polling a lone short batch's,
sleeping in the driver on any other), mark its slots DONE and send DONE (``runner.complete_ok``, the same
code the CPU runner uses), return the stream slot, feed the stage histograms.

Nothing on this path allocates device or page-locked memory: the contexts' buffers are made at start and
the rings are registered once per session (``WorkerSession.ensure_registered``).
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time

from shmbroker.broker.common import proc
from shmbroker.broker.common import protocol as P
from shmbroker.gpu_worker import cuda
from shmbroker.gpu_worker.batcher import Batcher, Take
from shmbroker.gpu_worker.engines.base import DeviceEngine
from shmbroker.gpu_worker.histogram import Histogram
from shmbroker.gpu_worker.intake import ModelView
from shmbroker.gpu_worker.launchplan import LaunchPlan
from shmbroker.gpu_worker.runner import BatchRunner, Progress, quiet
from shmbroker.gpu_worker.streams import EVENT_STAGES, CopyPlan, StreamSlot, issue, probe_batched_copies
from shmbroker.gpu_worker.work import ModelCounters, Work, complete_ok

log = logging.getLogger(__name__)

# per request: queue; per batch: h2d, wait (for the previous batch's compute), compute, d2h (CUDA events),
# answer (host: from the batch's end on the device, as far as launch time plus its event-timed stages tells,
# to its last DONE sent) and wake (the first part of answer: until the completion thread saw the end)
STAGES = ("queue", *EVENT_STAGES, "wake", "answer")
POLL_S = 0.5  # how often a waiting runner looks at its stop flag
BATCHED_COPIES = False  # until warm_up has measured which way of issuing copies costs this thread less
# A lone batch expected to take at most this long has its end event polled: the driver's blocking wait wakes
# the completion thread 100-200 us after the device ends (bench/RESULTS.md#a-lone-request-on-the-h200).
POLL_END_MAX_MS = 2.0
# with early copies, a filling batch's rows go to the device in chunks of this many (a runner wake-up each),
# and the plan's lead covers one chunk's issue and H2D
EARLY_CHUNK = 32


class PipelineRunner(BatchRunner):
    """A device engine's runner. Invariant: a stream slot is free, launched (in ``_launched``) or being
    completed; its requests are answered exactly once, by the completion thread or by ``_abandon``."""

    watches_ends = True

    def __init__(self, model: ModelView, engine: DeviceEngine, batcher: Batcher[Work], counters: ModelCounters,
                 streams: int, batched_copies: bool = BATCHED_COPIES) -> None:
        """How batches share the device is the batcher's policy (``BatchPolicy``: ``serial_compute``,
        ``fill_while_busy``, ``early_copies``)."""
        super().__init__(model, engine, batcher, counters)
        policy = batcher.policy
        self.device_engine = engine
        self.device = engine.device
        self.copies = CopyPlan(self.codec, batched_copies)
        self.stages = {name: Histogram() for name in STAGES}
        counters.stages = self.stages
        # the most recently freed first: requests one at a time keep to the slot whose buffers and graph the
        # device used last, and the others stay idle
        self._free: queue.LifoQueue[StreamSlot] = queue.LifoQueue()
        self._launched: queue.SimpleQueue[StreamSlot | None] = queue.SimpleQueue()
        self._completer = threading.Thread(target=self._complete_loop, name=f"complete-{model.name}", daemon=True)
        self._launching = threading.Lock()  # one launch at a time: the runner thread's or the intake's
        # A lone batch that the intake thread launched and whose end it polls while it spins for the next
        # request (end_seen): one spinning thread in the worker, not two taking the GIL from each other
        # (bench/RESULTS.md#a-lone-request-on-the-h200). Any other launch hands it to the completion thread
        # first, so batches still complete in launch order.
        self._watched: StreamSlot | None = None
        self._watch_lock = threading.Lock()
        self.serial_compute = policy.serial_compute
        # while the device is busy, a batch that is not full grows until the device is about to need it
        # with early copies, a batch opened while the device computes is copied in as its requests come (_fill)
        self.early = policy.early
        self.plan = (LaunchPlan(model.max_batch, self._expected_s, lead_rows=EARLY_CHUNK if self.early else 0)
                     if policy.fill_while_busy else None)
        self._told_batcher = False  # Batcher.device_ready: at warm-up, else at start
        self._last_computed: cuda.Event | None = None  # the last launched batch's, with serial_compute
        self._on_device = threading.local()  # threads that made this runner's device current
        self.slots: list[StreamSlot] = []
        try:
            for i in range(streams):
                self.slots.append(StreamSlot(i, engine, model.max_batch))
        except BaseException:
            self._close_slots()
            raise
        for slot in self.slots:
            self._free.put(slot)
        self.max_batch_ms: float | None = None  # compute time of one max batch, measured by warm_up
        self.one_row_ms: float | None = None  # and of one row
        self.copy_probe: dict[str, float | bool] = {}

    @property
    def cheap(self) -> bool:
        """While no batch runs: the intake thread then launches a due batch itself (tens of microseconds of
        issuing, no wait for the device) rather than wake the runner thread. Under load, never: launches of
        large batches would stall intake, and the runner thread's wake-up is hidden behind running batches."""
        return self.batcher.running == 0

    def try_inline(self, watch: bool = False) -> bool:
        """Launch a due batch from the caller's (intake) thread while the device is idle and a stream slot free;
        otherwise leave it to the runner thread (woken here). ``watch``: the caller polls the end of a lone
        batch expected within ``POLL_END_MAX_MS`` (``end_seen``) until it calls ``unwatch``."""
        if self.batcher.running or not self._launching.acquire(blocking=False):
            self.batcher.kick()
            return False
        try:
            try:
                slot = self._free.get_nowait()
            except queue.Empty:
                self.batcher.kick()
                return False
            take = self.batcher.take_now()
            if take is None:
                self._free.put(slot)
                self.batcher.kick()  # queued but not due: the runner waits out max_queue_delay_us
                return False
            self._use_device()
            self._launch(slot, take, watch)
            return True
        finally:
            self._launching.release()

    def _use_device(self) -> None:
        """Make the runner's device current on the calling thread (once per thread: it is per thread)."""
        if not getattr(self._on_device, "set", False):
            cuda.set_device(self.device)
            self._on_device.set = True

    def start(self) -> None:
        if not self._told_batcher:  # no warm-up: no prepared sizes known
            self._tell_batcher([])
        self._completer.start()
        super().start()

    def _tell_batcher(self, sizes: list[int]) -> None:
        """The batcher's device bound: the engine's prepared batch sizes."""
        self.batcher.device_ready(sizes)
        self._told_batcher = True

    def stop(self) -> None:
        """Stop launching, let every launched batch complete and be answered, answer the queue, free the slots."""
        self._stop.set()
        left = self.batcher.close()
        if self._thread.is_alive():
            self._thread.join(timeout=30)
        self.unwatch()
        self._launched.put(None)
        if self._completer.is_alive():
            self._completer.join(timeout=30)
        self.answer_expired(left, P.Status.SHUTTING_DOWN, "the worker is shutting down")
        self._close_slots()

    def _close_slots(self) -> None:
        for slot in self.slots:
            try:
                slot.close()
            except cuda.CudaError as exc:
                log.error("model %s: closing stream slot %d failed: %s", self.model.name, slot.index, exc)

    # -- warm-up -------------------------------------------------------------------------------------------
    def warm_up(self, progress: Progress = quiet) -> None:
        """Run every stream slot's context at 1 row and ``max_batch`` rows (CUDA graphs are captured then, not
        on the first requests), and time one max batch with the slot's events; then tell the batcher the
        prepared batch sizes and the launch plan's bound (``Batcher.device_ready``)."""
        slot = self._warm_contexts(progress)
        self.copy_probe = probe_batched_copies(slot, self.model.inputs[0].item_bytes, self.model.max_batch)
        self.copies.batched = bool(self.copy_probe["batched"])
        if self.plan is not None:
            self.plan.prime(_lead_per_row_s(slot, self.model, self.copies.batched))
        self._tell_batcher(list(getattr(slot.ctx, "sizes", None) or ()))
        log.info("model %s: %d stream slots warm; one row computes in %.3f ms, a batch of %d rows in %.3f ms; "
                 "copies of a batch issued %s (%s)", self.model.name, len(self.slots), self.one_row_ms,
                 self.model.max_batch, self.max_batch_ms,
                 "in one cudaMemcpyBatchAsync" if self.copies.batched else "one call per tensor", self.copy_probe)

    def _warm_contexts(self, progress: Progress) -> StreamSlot:
        """Run every slot's context at 1 row and ``max_batch`` rows, and time both on the first slot (its events,
        the median of three), which it returns."""
        progress(f"running its {len(self.slots)} stream slots at 1 and {self.model.max_batch} rows")
        cuda.set_device(self.device)
        for slot in self.slots:
            for rows in sorted({1, self.model.max_batch}):
                slot.ctx.enqueue(rows)
            slot.stream.synchronize()
        first = self.slots[0]
        self.one_row_ms = _median_ms(first, 1)
        self.max_batch_ms = _median_ms(first, self.model.max_batch)
        return first

    # -- runner thread -------------------------------------------------------------------------------------
    def _loop(self) -> None:
        proc.name_thread(self._thread.name)
        self._use_device()
        while not self._stop.is_set():
            try:
                slot = self._free.get(timeout=POLL_S)  # (1) a free stream slot first: batches grow meanwhile
            except queue.Empty:
                continue
            take = self.batcher.take(timeout=POLL_S)
            if take is None:
                self._free.put(slot)
                continue
            if self.early and self.batcher.running > 1:
                self._fill(slot, take)
                continue
            with self._launching:
                self._launch(slot, take)

    def _fill(self, slot: StreamSlot, take: Take[Work]) -> None:
        """(1b) A batch opened while the device computes: its rows go to the device as they come, in chunks,
        and it launches once the plan says the device will need it, once full, or once no other batch runs."""
        if not self._opened(slot, take):
            return
        opened = time.monotonic()
        works: list[Work] = []
        rows, batch, close = 0, take.batch, False
        try:
            with self._launching:
                slot.start.record(slot.stream.handle)
            while True:
                if batch:
                    self._queued(batch)
                    works += batch
                    with self._launching:
                        rows = self._copy_in(slot, batch, rows)  # (3), a chunk
                if close or rows >= self.model.max_batch or self._stop.is_set():
                    break
                more = self.batcher.take_more(self.model.max_batch - rows, EARLY_CHUNK, POLL_S)
                self.answer_expired(more.expired, P.Status.TIMEOUT,
                                    f"deadline passed before model {self.model.name!r} could run it")
                batch, close = more.batch, more.close
            with self._launching:
                issuing = time.monotonic()
                self._compute_out(slot, works, rows)  # (4)-(6)
        except Exception as exc:  # noqa: BLE001 - a failed launch fails its batch (logged), not the worker
            self._abandon(slot, works, exc)
            return
        self._launched_batch(slot, works, rows, opened, issuing, filled=True)

    def _launch(self, slot: StreamSlot, take: Take[Work], watch: bool = False) -> None:
        if not self._opened(slot, take):
            return
        now = time.monotonic()
        works = take.batch
        self._queued(works)
        try:
            slot.start.record(slot.stream.handle)
            works, rows = self._inputs_in(slot, works)  # (3)
            if not works:  # every request was answered at (3)
                slot.rows = 0
                slot.stream.synchronize()  # what (3) queued on the stream, before the slot is reused
                self._finished(slot)
                return
            self._compute_out(slot, works, rows)  # (4)-(6)
        except Exception as exc:  # noqa: BLE001 - a failed launch fails its batch (logged), not the worker
            self._abandon(slot, works, exc)
            return
        self._launched_batch(slot, works, rows, now, now, filled=False, watch=watch)

    def _inputs_in(self, slot: StreamSlot, works: list[Work]) -> tuple[list[Work], int]:
        """(3) The batch's inputs into the slot's buffers, on its stream: the requests that go on to the engine
        (a subclass may answer others here) and their rows."""
        return works, self._copy_in(slot, works, 0)

    def _opened(self, slot: StreamSlot, take: Take[Work]) -> bool:
        """(2) Answer the take's timed-out requests; whether a batch is left (if not, the slot goes back)."""
        self.answer_timed_out(take)
        if not take.batch:
            self._free.put(slot)
            return False
        slot.expected_s = 0.0  # not in the plan until its issue ends
        return True

    def _queued(self, works: list[Work]) -> None:
        now = time.monotonic()
        self.stages["queue"].add_all([(now - w.enqueued) * 1e6 for w in works])

    def _launched_batch(self, slot: StreamSlot, works: list[Work], rows: int, opened: float, issuing: float, *,
                        filled: bool, watch: bool = False) -> None:
        """The batch is queued on the device: into the plan, and to the completion thread, or watched by the
        intake thread (``watch`` and a lone short batch). ``filled``: its rows were copied as they came
        (``_fill``)."""
        slot.filled = filled
        slot.works = works
        slot.rows = rows
        slot.launched = opened
        issued = time.monotonic()
        slot.issue_s = issued - issuing
        if self.plan is not None:
            slot.expected_s, hold = self.plan.launched(issued, rows)
            self.batcher.hold(hold.until, hold.per_row_s)
        self.counters.batch(rows)
        if watch and self._lone_short_ms(rows) is not None:
            with self._watch_lock:
                self._watched = slot
            return
        self.unwatch()  # first: the completion thread takes batches in launch order
        self._launched.put(slot)

    def end_seen(self) -> bool:
        """For the intake thread's spin: answer the watched batch if the device has finished it (True)."""
        slot = self._watched
        if slot is None:
            return False
        try:
            if not slot.end.query():
                return False
        except cuda.CudaError:
            self.unwatch()  # the completion thread's wait reports the error and fails the batch
            return False
        with self._watch_lock:
            if self._watched is not slot:
                return False  # handed to the completion thread meanwhile
            self._watched = None
        self._complete(slot, ended=True)
        return True

    def unwatch(self) -> None:
        """Hand the watched batch, if any, to the completion thread."""
        with self._watch_lock:
            slot, self._watched = self._watched, None
        if slot is not None:
            self._launched.put(slot)

    def _lone_short_ms(self, rows: int) -> float | None:
        """The expected device time of a batch of ``rows`` that runs alone and within ``POLL_END_MAX_MS``;
        None for any other."""
        expected = self.expected_ms(rows)
        if self.batcher.running != 1 or expected is None or expected > POLL_END_MAX_MS:
            return None
        return expected

    def _copy_in(self, slot: StreamSlot, works: list[Work], row: int) -> int:
        """Queue the H2D of ``works`` into rows from ``row`` of the slot's input buffers; returns the next row."""
        dsts, srcs, sizes, end = self.copies.inputs(works, slot.ctx.input_ptrs, row)
        self.copies.issue(dsts, srcs, sizes, "h2d", slot.stream.handle)
        return end

    def _compute_out(self, slot: StreamSlot, works: list[Work], rows: int) -> None:
        """Queue the engine on the batch's ``rows`` rows, the D2H of every request's rows into its own ring slot,
        and the end event, without waiting for the device."""
        ctx, stream = slot.ctx, slot.stream.handle
        slot.copied_in.record(stream)
        if self.serial_compute and self._last_computed is not None and self.batcher.running > 1:
            slot.stream.wait(self._last_computed)  # the previous batch's compute, as recorded now
        slot.began.record(stream)
        ctx.enqueue(rows)  # (4)
        slot.computed.record(stream)
        self._last_computed = slot.computed
        dsts, srcs, sizes = self.copies.outputs(works, ctx.output_ptrs)
        self.copies.issue(dsts, srcs, sizes, "d2h", stream)  # (5)
        slot.end.record(stream)  # (6)

    def _abandon(self, slot: StreamSlot, works: list[Work], exc: BaseException) -> None:
        """A launch failed part-way: let what was queued finish (no copy may still target a slot that is
        answered and reused), then fail the batch and return the stream slot."""
        try:
            slot.stream.synchronize()
        except cuda.CudaError as sync_exc:
            log.error("model %s: stream slot %d did not drain after a failed launch: %s", self.model.name,
                      slot.index, sync_exc)
        self.fail(works, exc)
        self._finished(slot)

    def _finished(self, slot: StreamSlot, h2d_ms: float | None = None) -> None:
        """A slot's batch is answered (or failed): the plan and the batcher know one batch fewer runs, and the
        slot is free. ``h2d_ms``: its H2D time, if it ran."""
        if self.plan is not None:
            # a filled batch's H2D stage spans its filling: no sample of the lead
            lead = None if h2d_ms is None or slot.filled else slot.issue_s + h2d_ms / 1e3
            hold = self.plan.ended(time.monotonic(), slot.expected_s, lead, slot.rows, self.batcher.running - 1)
            self.batcher.hold(hold.until, hold.per_row_s)
        self.batcher.done()
        self._free.put(slot)

    # -- completion thread ---------------------------------------------------------------------------------
    def _complete_loop(self) -> None:
        proc.name_thread(self._completer.name)
        cuda.set_device(self.device)
        while True:
            slot = self._launched.get()  # (7) in launch order
            if slot is None:
                return
            self._complete(slot, ended=False)

    def _complete(self, slot: StreamSlot, *, ended: bool) -> None:
        """Answer the slot's batch once it has ended on the device (waiting for that unless ``ended``), free
        the slot, record its stages."""
        works, slot.works = slot.works, []
        if not ended:
            try:
                self._wait_end(slot)
            except cuda.CudaError as exc:
                self.fail(works, exc)
                self._finished(slot)
                return
        woke = time.monotonic()
        # answers first, the slot after: freed first, it lets the runner thread issue the next batch's copies
        # before these answers leave, which doubled the answer stage (bench/RESULTS.md#the-host-paths-ceiling)
        complete_ok(self.codec, self.counters, works)
        answered = time.monotonic()
        stages, launched = self._stage_ms(slot), slot.launched  # read before the slot is reused
        self._finished(slot, None if stages is None else stages[0])
        self._record_stages(stages, woke - launched, answered - launched)

    def _wait_end(self, slot: StreamSlot) -> None:
        """Return once the slot's batch has ended on the device. A lone batch expected within
        ``POLL_END_MAX_MS`` is polled, giving the core away between polls, for up to twice its expected time;
        any other (or one that overruns) waits asleep in the driver."""
        expected = self._lone_short_ms(slot.rows)
        if expected is not None and _poll(slot.end, slot.launched + 2 * expected / 1e3 + 1e-3):
            return
        slot.end.synchronize()

    def _expected_s(self, rows: int) -> float | None:
        ms = self.expected_ms(rows)
        return None if ms is None else ms / 1e3

    def expected_ms(self, rows: int) -> float | None:
        """A batch's device time for ``rows`` rows, interpolated between warm-up's one-row and max-batch times."""
        one, most = self.one_row_ms, self.max_batch_ms
        if one is None or most is None:
            return None
        span = max(1, self.model.max_batch - 1)
        return one + (most - one) * (rows - 1) / span

    def _stage_ms(self, slot: StreamSlot) -> tuple[float, float, float, float] | None:
        try:
            return slot.stage_ms()
        except cuda.CudaError as exc:
            log.warning("model %s: stage timing failed: %s", self.model.name, exc)
            return None

    def _record_stages(self, stages: tuple[float, float, float, float] | None, woke_s: float,
                       answered_s: float) -> None:
        """Feed the histograms; from the batch's launch, ``woke_s``: to the completion thread's seeing its end,
        ``answered_s``: to its last DONE sent."""
        if stages is None:
            return
        for name, ms in zip(EVENT_STAGES, stages, strict=True):
            self.stages[name].add(ms * 1e3)
        device_us = sum(stages) * 1e3
        self.stages["wake"].add(max(0.0, woke_s * 1e6 - device_us))
        self.stages["answer"].add(max(0.0, answered_s * 1e6 - device_us))


def _poll(event: cuda.Event, until: float) -> bool:
    """Poll ``event`` until it completes (True) or ``time.monotonic()`` passes ``until`` (False)."""
    query, clock = event.query, time.monotonic
    while not query():
        if clock() > until:
            return False
        os.sched_yield()  # lets go of the GIL and the core for any thread that is ready
    return True


def _lead_per_row_s(slot: StreamSlot, model: ModelView, batched: bool) -> float:
    """Issue plus H2D time per row of ``model.max_batch`` rows of the first input from page-locked memory into
    the slot's buffer (allocated and freed here, at warm-up), scaled to every input's bytes."""
    first = model.inputs[0].item_bytes
    rows = model.max_batch
    host = cuda.host_alloc_pinned(rows * first)
    try:
        stream = slot.stream.handle
        t0 = time.perf_counter()
        slot.start.record(stream)
        issue([slot.ctx.input_ptrs[0] + i * first for i in range(rows)], [host + i * first for i in range(rows)],
              [first] * rows, "h2d", stream, batched)
        slot.end.record(stream)
        issue_s = time.perf_counter() - t0
        slot.end.synchronize()
        per_row = (issue_s + cuda.elapsed_ms(slot.start, slot.end) / 1e3) / rows
    finally:
        cuda.free_host(host)
    return per_row * sum(s.item_bytes for s in model.inputs) / first


def _median_ms(slot: StreamSlot, rows: int) -> float:
    """Median of three event-timed runs of ``rows`` rows on the slot's stream."""
    times = []
    for _ in range(3):
        slot.start.record(slot.stream)
        slot.ctx.enqueue(rows)
        slot.end.record(slot.stream)
        slot.end.synchronize()
        times.append(cuda.elapsed_ms(slot.start, slot.end))
    return sorted(times)[1]
