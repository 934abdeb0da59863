"""The synchronous client: ``Client().infer(model, inputs)``, ``submit`` returning a Future, ``call`` with a callback.

Threads: callers write their slot and send the SUBMIT themselves (coalesced per worker: client.links); one IO
thread receives broker notices, and DONEs unless a caller waiting for its answer receives them (client.lead,
client.receiving). Slots are the flow control (client.slots). Argument checks that need no session:
client.checks; a new session after a broker restart: client.rejoin.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future, InvalidStateError
from typing import Self, TypeVar, cast

import numpy as np
import zmq
from zmq.utils import monitor as zmq_monitor

from shmbroker.broker.common import protocol as P
from shmbroker.broker.common.ring import RingError
from shmbroker.client.checks import (
    FORKS,
    MAX_ITEMS_SETTING,
    check_rows,
    check_timeout,
    checked_arrays,
    image_rows,
)
from shmbroker.client.errors import (
    BadInput,
    ClientClosed,
    RequestError,
    RequestTimeout,
    ShmBrokerError,
    UnknownModel,
    WorkerDied,
    from_status,
)
from shmbroker.client.future import ClientFuture
from shmbroker.client.hintwait import HintWait
from shmbroker.client.links import Links
from shmbroker.client.parts import Answered, Parts
from shmbroker.client.receiving import Receiver
from shmbroker.client.rejoin import RETRY_S, Rejoin
from shmbroker.client.request import Callback, HeldSlot, Outputs, Request
from shmbroker.client.session import (
    GRACE_S,
    Column,
    ImageRow,
    ModelPlan,
    SlotViews,
    control_socket,
    find_broker,
    handshake,
    rejoin_mismatch,
)
from shmbroker.client.slots import Pending, Slots

log = logging.getLogger(__name__)

# arrays; for a model of encoded images (ModelInfo input kind "image"), the bytes of one image or a sequence of them
ImageBytes = bytes | bytearray | memoryview
# tensors: an array, or arrays by input name; images: one file's bytes, or a list of them (or that by name)
Inputs = np.ndarray | Mapping[str, np.ndarray] | ImageBytes | Sequence[ImageBytes] | Mapping[str, Sequence[ImageBytes]]
__all__ = ["CLOSE_WAIT_S", "Callback", "Client", "Inputs", "Outputs"]  # what other modules import from here
T = TypeVar("T")
LEAD_HORIZON_S = 3600.0  # a Future's result() without a timeout leads this long at a time, then waits as usual
CLOSE_WAIT_S = 5.0  # how long close() (and leaving the with block) lets requests in flight finish


class Client:
    """One session with the broker: a ring of slots, links to the workers, an IO thread.

    ``slots``: requests in flight at once (0: the broker's ``[sessions] default_slots``). ``max_items``: rows a
    slot holds (0: the broker's ``[sessions] default_max_items``, by default as many as keep the ring within
    ``default_ring_mib``); above every ``max_batch`` it is lowered to the largest, with a warning. ``infer``,
    ``submit`` and ``call`` take up to the model's ``max_batch`` rows whatever it is, sending a request of more
    rows than a slot holds as parts (client.parts); a zero-copy ``request`` has one slot's rows at most.
    ``spin_us``: how long a thread that waits for answers (a caller in ``infer()``, the IO thread while requests
    are in flight) polls without sleeping, and only while most recent answers came back that fast (within four
    windows for the IO thread; broker.common.spin, client.receiving.IO_SPIN_REACH); 0: never.
    """

    def __init__(
        self, runtime_dir: str | os.PathLike[str] | None = None, *, slots: int = 0, max_items: int = 0,
        connect_timeout: float = 10.0, name: str = "", spin_us: int = 1000,
    ) -> None:
        self.runtime_dir = find_broker(runtime_dir, "Client(runtime_dir=...)")
        self._pid = os.getpid()
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self._ctl = control_socket(self._ctx, self.runtime_dir)  # the IO thread's, after the handshake
        try:
            hs = handshake(self._ctl, self.runtime_dir, slots, max_items, name, connect_timeout)
        except BaseException:
            self._ctx.destroy(linger=0)
            raise
        self.session_id = hs.setup.session_id
        self.max_items = hs.setup.max_items  # rows a slot holds: what the broker granted
        if max_items > self.max_items:
            log.warning("Client(max_items=%d) is above every served model's max_batch: the session takes %d rows "
                        "a request", max_items, self.max_items)
        # how this client's user raises max_items, named by the BAD_SHAPE error (a front-end names its own option)
        self.max_items_setting = MAX_ITEMS_SETTING
        self.segment = hs.segment
        self.models = {m.name: ModelPlan.of(m) for m in hs.setup.models}
        self._by_id = {p.info.model_id: p for p in self.models.values()}
        self._slots = Slots(hs.setup.n_slots)
        # per model id and slot: the views of the row count used last (bounded by models x slots)
        self._views: dict[int, list[SlotViews | None]] = {m: [None] * hs.setup.n_slots for m in self._by_id}
        self._ids = itertools.count(1)
        self._spin_ns = spin_us * 1000
        self._hint_wait = HintWait(self.segment, self._spin_ns)
        self._links = Links(self._ctx)
        self._links.replace(hs.ready.workers, hs.setup.session_id, hs.ready.token)
        self._links.wait_up(connect_timeout)
        # what a new session after a broker restart is asked for: the same slots and rows (client.rejoin)
        self._rejoin = Rejoin(hs.setup.n_slots, self.max_items, name, connect_timeout)
        # the broker's connection dropping (it stopped) and coming back (it restarted): see _broker_events
        self._ctl_monitor = self._ctl.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        self._receiver = Receiver(
            self._ctx, self._ctl, self._ctl_monitor, self._links, self._slots, spin_us, lambda: self.segment,
            self._broker_events, self._take_session, f"shmb-client-{self.session_id}")
        self._role = self._receiver.role
        self._receiver.thread.start()
        r = self._receiver
        self._finalizer = weakref.finalize(self, Receiver.shutdown, r.stop_event, r.thread, r.wake)

    # -- public API -------------------------------------------------------------------------------------------
    def infer(self, model: str, inputs: Inputs, timeout: float | None = None) -> Outputs:
        """Run one request and return its output (one array, or a dict when the model has several).

        The calling thread receives the answer itself (see client.lead), so no thread hand-off is paid.
        """
        self._check_may_wait()
        plan, arrays = self._checked(model, inputs, timeout)
        fut: Future[Outputs] = Future()
        spans = self._spans(plan, arrays)
        if spans is not None:
            deadline = self._send_parts(plan, arrays, spans, timeout, functools.partial(_settle, fut))
            return self.wait_for(fut, deadline - time.monotonic() + GRACE_S)
        slot, views = self._fill(plan, arrays, timeout)
        self._send(slot, plan, views, timeout, functools.partial(self._resolve, fut, plan, slot, views), True,
                   hint_wait=True)
        try:
            return self.wait_for(fut, (timeout if timeout is not None else plan.info.timeout_ms / 1e3) + GRACE_S,
                                 slot)
        finally:
            self._hint_wait.done()

    def wait_for(self, fut: Future[T], wait: float, slot: int | None = None) -> T:
        """Block for ``fut`` (a request of this client), receiving answers on this thread meanwhile; with its
        ``slot``, a spinning wait also reads the answer from the slot header (client.receiving)."""
        self._check_may_wait()
        until = time.monotonic() + wait
        self._receiver.lead(fut, until, slot, linger=False)
        try:
            return fut.result(max(0.0, until - time.monotonic()))
        except TimeoutError:
            if fut.done():
                raise
            raise RequestTimeout(f"no answer from the worker within {wait:.1f} s") from None

    def submit(self, model: str, inputs: Inputs, timeout: float | None = None) -> Future[Outputs]:
        """Queue one request; the Future holds the output or a ShmBrokerError.

        Its ``result()`` receives answers on the waiting thread (client.future). On a thread that waits on its
        Futures, the SUBMIT is queued and leaves with that thread's next wait, together with the others queued
        meanwhile, or at the IO thread's next look (client.lead, WATCH_MS), whichever comes first.
        """
        plan, arrays = self._checked(model, inputs, timeout)
        spans = self._spans(plan, arrays)
        if spans is not None:
            fut: ClientFuture[Outputs] = ClientFuture(self._await_future, self._receiver_needed)
            self._send_parts(plan, arrays, spans, timeout, functools.partial(_settle, fut))
            return fut
        slot, views = self._fill(plan, arrays, timeout)
        return self._submit_slot(plan, slot, views, timeout)

    def call(self, model: str, inputs: Inputs, callback: Callback, timeout: float | None = None) -> None:
        """Queue one request; ``callback(outputs, error)`` runs when it is answered, on the client's IO thread
        or on a thread of this client that is blocked waiting for an answer (client.lead); it must not block.

        Exactly one of the two is None. The lightest way to keep many requests in flight: no Future, and
        requests submitted from a callback go out together in one message.
        """
        plan, arrays = self._checked(model, inputs, timeout)
        spans = self._spans(plan, arrays)
        if spans is not None:
            self._send_parts(plan, arrays, spans, timeout, functools.partial(_run_callback, callback))
            return
        slot, views = self._fill(plan, arrays, timeout)
        self._call_slot(plan, slot, views, timeout, callback)

    @contextlib.contextmanager
    def request(self, model: str, rows: int = 1, timeout: float | None = None) -> Iterator[Request]:
        """Zero-copy: fill ``req.inputs[name]`` in place, then ``req.run()`` and read the outputs in place, or
        ``req.submit()`` for a Future of them (copied out) without waiting.

        The views are valid inside the ``with`` block only; the slot is freed when it ends, or, once submitted,
        when the request is answered. ``rows`` is at most a slot's (``max_items``): BadInput names the setting.
        """
        plan = self._plan(model)
        if plan.image_max_bytes:
            raise BadInput(f"model {model!r} takes encoded images, which have no fixed place in a slot: send them "
                           "with infer(), submit() or call()")
        check_timeout(timeout)
        check_rows(plan, rows, "rows", self.max_items, self.max_items_setting)
        slot = self._slots.acquire(timeout, self._receiver.on_io_thread)
        req = Request(plan, slot, self.segment, HeldSlot(
            functools.partial(self._run_held, plan, slot, rows, timeout),
            functools.partial(self._submit_held, plan, slot, rows, timeout),
            functools.partial(self._call_held, plan, slot, rows, timeout),
            functools.partial(self._slots.release, slot)), self._views_for(plan, slot, rows).ins)
        try:
            yield req
        finally:
            req.end()

    def parts(self, model: str, inputs: Inputs) -> list[Inputs] | None:
        """None when ``inputs`` fit one slot, else their cuts that do (``_spans``), in order, each a request (what
        ``AsyncClient`` awaits part by part). BadInput as ``infer`` checks them; inputs that
        would fail the checks may also give None, and then fail when sent."""
        limit = (self.max_items,)
        if type(inputs) is np.ndarray:
            if inputs.shape[:1] <= limit:
                return None
        elif isinstance(inputs, Mapping) and all(type(v) is np.ndarray and v.shape[:1] <= limit
                                                 for v in inputs.values()):
            return None  # arrays that fit; anything else (a list of photos under the input's name) is split below
        plan = self._plan(model)
        arrays = self._arrays(plan, inputs)
        spans = self._spans(plan, arrays)
        if spans is None:
            return None
        specs = plan.info.inputs
        if len(specs) == 1:
            return [arrays[0][first:end] for first, end in spans]
        tensors = cast("Sequence[np.ndarray]", arrays)  # several inputs: a tensor model's (images have one)
        return [{s.name: a[first:end] for s, a in zip(specs, tensors, strict=True)} for first, end in spans]

    def corked(self) -> contextlib.AbstractContextManager[None]:
        """``with client.corked():`` SUBMITs made by this thread inside the block are queued, not sent:
        ``flush()`` (or this thread's next wait for an answer) sends them together, one message per worker."""
        return self._links.cork

    def flush(self) -> None:
        """Send every queued SUBMIT now."""
        self._links.flush_all()

    @property
    def slots(self) -> int:
        """Requests this client may have in flight at once (its ring's slots)."""
        return self._slots.n

    @property
    def slots_setting(self) -> str:
        """How this client's user raises its slots, named when none is free (a front-end names its own option)."""
        return self._slots.setting

    @slots_setting.setter
    def slots_setting(self, setting: str) -> None:
        self._slots.setting = setting

    @property
    def connected(self) -> bool:
        """Whether the client has a session: False from the broker's loss until a new session is taken."""
        return not self._rejoin.lost

    def wait_ready(self, model: str, timeout: float = 10.0) -> None:
        """Block until a worker that serves ``model`` is linked (after a restart, say)."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if any(link.up and model in link.models for link in self._links.current):
                return
            with self._slots.cond:
                self._slots.cond.wait(0.05)
        raise WorkerDied(f"no live worker serves model {model!r} after {timeout} s")

    def close(self, timeout: float = CLOSE_WAIT_S) -> None:
        """Refuse new requests (ClientClosed), wait up to ``timeout`` s for those in flight to be answered, fail
        the rest with ClientClosed; then say BYE, stop the IO thread, unmap the ring. Called from a callback
        (the client's own IO thread, which answers requests), it does not wait."""
        r = self._receiver
        if r.stop_event.is_set():
            return
        self._slots.open = False
        if self._slots.pending and timeout > 0 and not r.on_io_thread():
            r.drained = threading.Event()
            r.wake()  # the IO thread looks at once whether anything is still in flight
            r.drained.wait(timeout)
        self._finalizer()
        self._slots.wake_all()  # callers waiting for a slot see the client closed
        with contextlib.suppress(zmq.ZMQError):
            self._ctl.send_multipart(P.encode(P.Bye(self.session_id)))
        with self._role.exclusive():
            r.fail_all(ClientClosed(f"the client was closed before the answer came (close waited up to "
                                    f"{timeout} s)"))
            self._links.close_all()
        self._ctx.destroy(linger=200)
        self._views.clear()  # the cached views export the mapping, which close() then unmaps at once
        self.segment.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- submission -------------------------------------------------------------------------------------------
    def _check_may_wait(self) -> None:
        """Refuse to block on a thread that runs completion callbacks (checked before anything is sent)."""
        if self._receiver.on_io_thread() or self._role.leading():
            raise ShmBrokerError("a completion callback cannot wait for an answer; use submit() or call()",
                                 "DEADLOCK")

    def _plan(self, model: str) -> ModelPlan:
        if FORKS[0] and os.getpid() != self._pid:
            raise ShmBrokerError("a Client cannot be used across fork(); create one in the child", "FORKED")
        plan = self.models.get(model)
        if plan is None:
            raise UnknownModel(f"model {model!r} is not served; models are {sorted(self.models)}")
        return plan

    def _checked(self, model: str, inputs: Inputs, timeout: float | None) -> tuple[ModelPlan, Sequence[Column]]:
        """The model's plan and the inputs as checked arrays in model order; BadInput names the field."""
        plan = self._plan(model)
        if timeout is not None:
            check_timeout(timeout)
        return plan, self._arrays(plan, inputs)

    def _fill(self, plan: ModelPlan, arrays: Sequence[Column], timeout: float | None) -> tuple[int, SlotViews]:
        """Take a slot and copy the checked inputs (of at most a slot's rows) into it: (slot, the slot's views)."""
        slot = self._slots.acquire(timeout, self._receiver.on_io_thread)
        views = self._views_for(plan, slot, len(arrays[0]))
        if plan.image_max_bytes:
            return slot, plan.image_views(self.segment, slot, arrays[0], views.outs)
        for view, arr in zip(views.ins, arrays, strict=True):
            view[...] = arr  # one copy into the slot; the shape and dtype were checked in _arrays
        return slot, views

    def _views_for(self, plan: ModelPlan, slot: int, rows: int) -> SlotViews:
        by_slot = self._views[plan.info.model_id]
        views = by_slot[slot]
        if views is None or views.rows != rows:
            views = by_slot[slot] = plan.slot_views(self.segment, slot, rows)
        return views

    def _arrays(self, plan: ModelPlan, inputs: Inputs) -> Sequence[Column]:
        specs = plan.info.inputs
        if type(inputs) is dict and len(inputs) == 1 and len(specs) == 1:
            inputs = inputs.get(specs[0].name, inputs)  # {name: array} for a one-input model: the array
        if (type(inputs) is np.ndarray and len(specs) == 1 and inputs.dtype == plan.in_dtypes[0]
                and inputs.shape[1:] == plan.in_item_shapes[0] and 1 <= inputs.shape[0] <= plan.info.max_batch):
            return [inputs]  # the common case, checked in one go; anything else gets the checks that explain
        if plan.image_max_bytes:
            return [image_rows(plan, inputs)]
        # up to max_batch rows: a request of more rows than a slot holds is sent as parts
        return checked_arrays(plan, inputs, plan.info.max_batch)

    def _send(self, slot: int, plan: ModelPlan, views: SlotViews, timeout: float | None,
              on_done: Callable[[P.Result | ShmBrokerError], None], release: bool, hint_wait: bool = False,
              defer: bool = False) -> None:
        """Publish the request in its slot and send its SUBMIT (coalesced); ``hint_wait`` (a caller about to
        block for the answer): no SUBMIT if a spinning worker takes the request from its hint (client.hintwait);
        ``defer``: queue the SUBMIT, as ``corked()`` does."""
        link = self._links.choose(plan)
        if link is None or views.segment is not self.segment:
            if release:
                self._slots.release(slot)
            if self._rejoin.lost:
                raise WorkerDied("the broker is gone (stopped or restarting); this client takes a new session "
                                 "when it is back")
            if link is None:
                raise WorkerDied(f"no live worker serves model {plan.info.name!r} (the broker restarts dead ones)")
            raise WorkerDied("the broker restarted while this request was written; send it again")
        rid = next(self._ids)
        gens = self._slots.gens
        gen = gens[slot] = (gens[slot] + 1) & 0xFFFF_FFFF
        timeout_us = 0 if timeout is None else max(1, int(timeout * 1e6))
        lay = views.layout
        n_t = len(lay.in_offsets)
        # with the hint, a worker spinning on this slot takes the request ahead of the SUBMIT (PROTOCOL 4.2)
        hinted = self.segment.post_request(slot, link.worker_id, rid, gen, plan.info.model_id, n_t, timeout_us,
                                           lay.in_desc_bytes)
        self._slots.pending[slot] = Pending(rid, gen, plan, link.worker_id, on_done, lay)
        link.outstanding += 1
        if hint_wait and hinted and self._hint_wait.taken(slot):
            return  # the worker admitted it from the slot header and expects no SUBMIT (PROTOCOL 4.2)
        self._links.send(link, (rid, slot, gen, plan.info.model_id, n_t, timeout_us, lay.in_desc_bytes), defer)

    def _submit_slot(self, plan: ModelPlan, slot: int, views: SlotViews, timeout: float | None) -> Future[Outputs]:
        """Send a filled slot; the Future completes once the request is answered and its slot is free."""
        fut: ClientFuture[Outputs] = ClientFuture(self._await_future, self._receiver_needed)
        role = self._role
        self._send(slot, plan, views, timeout, functools.partial(self._resolve, fut, plan, slot, views), True,
                   defer=role.led_last())
        # after the send: an IO thread that starts to doze from now on sees this request (client.lead)
        if role.dozing:
            self._receiver_needed()
        return fut

    def _call_slot(self, plan: ModelPlan, slot: int, views: SlotViews, timeout: float | None,
                   callback: Callback) -> None:
        """Send a filled slot; ``callback`` runs once the request is answered and its slot is free."""
        if self._role.parked:
            self._role.unpark()
        # a partial, not a lambda: completing the request then runs one Python frame fewer
        self._send(slot, plan, views, timeout, functools.partial(self._deliver, callback, plan, slot, views), True)

    def _call_held(self, plan: ModelPlan, slot: int, rows: int, timeout: float | None, callback: Callback) -> None:
        """A zero-copy Request's call(): send the held slot as it is; the slot is freed once answered."""
        self._call_slot(plan, slot, self._views_for(plan, slot, rows), timeout, callback)

    def _submit_held(self, plan: ModelPlan, slot: int, rows: int, timeout: float | None) -> Future[Outputs]:
        """A zero-copy Request's submit(): send the held slot as it is; the slot is freed once answered."""
        return self._submit_slot(plan, slot, self._views_for(plan, slot, rows), timeout)

    def _run_held(self, plan: ModelPlan, slot: int, rows: int, timeout: float | None,
                  answered: Callable[[], None]) -> P.Result | ShmBrokerError:
        """A zero-copy Request's run(): send the held slot as it is and wait for its answer (the slot stays held);
        raises if none comes in time. ``answered`` is called when the answer comes, even after that."""
        self._check_may_wait()
        done: Future[P.Result | ShmBrokerError] = Future()
        views = self._views_for(plan, slot, rows)

        def on_done(r: P.Result | ShmBrokerError) -> None:
            answered()
            done.set_result(r)

        try:
            self._send(slot, plan, views, timeout, on_done, release=False, hint_wait=True)
        except BaseException:
            answered()  # never sent: nothing can write the slot
            raise
        try:
            return self.wait_for(done, (timeout if timeout is not None else plan.info.timeout_ms / 1e3) + GRACE_S,
                                 slot)
        finally:
            self._hint_wait.done()

    def _spans(self, plan: ModelPlan, arrays: Sequence[Column]) -> list[tuple[int, int]] | None:
        """None when the checked inputs fit one slot, else the (first, end) rows of the parts that do: at most
        ``max_items`` rows of tensors; images as their bytes fit the slot (``ModelPlan.image_parts``)."""
        rows = len(arrays[0])
        if rows == 1:
            return None  # a slot holds one row of any model
        if plan.image_max_bytes:
            return plan.image_parts(cast("list[ImageRow]", arrays[0]), self.segment.layout)
        if rows <= self.max_items:
            return None
        return [(k, min(k + self.max_items, rows)) for k in range(0, rows, self.max_items)]

    def _send_parts(self, plan: ModelPlan, arrays: Sequence[Column], spans: list[tuple[int, int]],
                    timeout: float | None, finish: Callable[[Outputs | None, ShmBrokerError | None], None]) -> float:
        """Send a request that does not fit one slot as parts of these rows (client.parts); return its deadline.
        Raises as a request does when it gets no slot or its first part cannot be sent, else ``finish`` gets its outcome
        once its last slot is free. The deadline (``timeout``, else the model's ``timeout_ms``) is the whole
        request's: each part is sent with the time left."""
        budget = timeout if timeout is not None else plan.info.timeout_ms / 1e3
        deadline = time.monotonic() + budget
        rows = len(arrays[0])
        first = self._slots.acquire(timeout, self._receiver.on_io_thread)
        slots = [first, *self._slots.take_free(len(spans) - 1)]
        outs = [np.empty((rows, *shape), dt) for dt, shape in zip(plan.out_dtypes, plan.out_item_shapes, strict=True)]
        specs = plan.info.outputs

        def done(value: list[np.ndarray] | None, error: ShmBrokerError | None) -> None:
            if value is None:
                finish(None, error)
            else:
                finish(value[0] if len(specs) == 1 else {s.name: v for s, v in zip(specs, value, strict=True)}, None)

        parts = Parts(spans, outs, deadline, budget, functools.partial(self._send_part, plan, arrays),
                      self._slots.release, done)
        if self._role.parked:  # the parts' answers send the next parts: someone must receive them
            self._role.unpark()
        parts.start(slots)
        return deadline

    def _send_part(self, plan: ModelPlan, arrays: Sequence[Column], slot: int, first: int, end: int, timeout: float,
                   answered: Answered) -> None:
        """Copy rows ``first:end`` of the inputs into ``slot`` (held) and send them; ``answered`` gets the output
        views in the slot, or the error. The slot stays held: the request's parts reuse it (client.parts)."""
        if not self._slots.open:
            raise ClientClosed("the client was closed before every part of the request was sent")
        views = self._views_for(plan, slot, end - first)
        if plan.image_max_bytes:
            views = plan.image_views(self.segment, slot, arrays[0][first:end], views.outs)
        else:
            for view, arr in zip(views.ins, arrays, strict=True):
                view[...] = arr[first:end]
        self._send(slot, plan, views, timeout, functools.partial(self._part_answered, plan, slot, views, answered),
                   False)

    def _part_answered(self, plan: ModelPlan, slot: int, views: SlotViews, answered: Answered,
                       r: P.Result | ShmBrokerError) -> None:
        answered(views.outs if r is views.layout.ok else self._answer_views(plan, slot, r))

    # -- completion (the receive role's holder) -----------------------------------------------------------------
    def _await_future(self, fut: Future[T], timeout: float | None) -> float | None:
        """A ClientFuture's wait: send the queued SUBMITs, then receive on this thread until ``fut`` is done or
        ``timeout`` passes (client.lead); returns the timeout left."""
        self._links.flush_all()
        if fut.done():
            return timeout
        self._check_may_wait()
        until = time.monotonic() + (LEAD_HORIZON_S if timeout is None else max(0.0, timeout))
        self._receiver.lead(fut, until, None, linger=True)
        return None if timeout is None else max(0.0, until - time.monotonic())

    def _receiver_needed(self) -> None:
        """A Future nobody may wait on through result() (it got a done-callback): the IO thread receives now."""
        role = self._role
        if role.parked and not role.leading():
            self._links.flush_all()
            role.unpark()

    def _outcome(self, plan: ModelPlan, slot: int, views: SlotViews,
                 r: P.Result | ShmBrokerError) -> tuple[Outputs | None, ShmBrokerError | None]:
        """(outputs copied out of the slot, None) or (None, the error); the slot is free afterwards."""
        try:
            # OK with the canonical layout of the rows sent (checked byte for byte in _fast_done, or the slot
            # header's answer): the slot's own views
            outs = views.outs if r is views.layout.ok else self._answer_views(plan, slot, r)
            if isinstance(outs, ShmBrokerError):
                return None, outs
            specs = plan.info.outputs
            if len(specs) == 1:
                return outs[0].copy(), None
            return {s.name: o.copy() for s, o in zip(specs, outs, strict=True)}, None
        finally:
            self._slots.release(slot)

    def _answer_views(self, plan: ModelPlan, slot: int,
                      r: P.Result | ShmBrokerError) -> list[np.ndarray] | ShmBrokerError:
        """An answer other than the canonical OK: its outputs as views of the slot, in model order, or its error."""
        if isinstance(r, ShmBrokerError):
            return r
        if r.status != P.Status.OK:
            return from_status(r.status, r.message)
        try:
            by_index = {t.index: self.segment.output_view(slot, t.offset, plan.out_dtypes[t.index], t.shape)
                        for t in r.tensors}
            return [by_index[k] for k in range(len(plan.out_dtypes))]
        except (RingError, IndexError, KeyError) as exc:  # a worker whose output descriptors do not fit
            return RequestError(f"the worker's output descriptors do not fit the slot: {exc!r}")

    def _resolve(self, fut: Future[Outputs], plan: ModelPlan, slot: int, views: SlotViews,
                 r: P.Result | ShmBrokerError) -> None:
        """Complete the Future once the slot is free (so the Future's callbacks find a free slot)."""
        _settle(fut, *self._outcome(plan, slot, views, r))

    def _deliver(self, callback: Callback, plan: ModelPlan, slot: int, views: SlotViews,
                 r: P.Result | ShmBrokerError) -> None:
        value, error = self._outcome(plan, slot, views, r)
        try:
            callback(value, error)
        except Exception:  # a user's callback must not stop the IO thread that serves every request
            log.exception("a submit callback raised; the client goes on")

    # -- the broker's restarts (IO thread; client.rejoin) ----------------------------------------------------------
    def _broker_events(self) -> None:
        """(5) The broker's control connection dropped (it stopped) or came back (it restarted)."""
        while True:
            try:
                event = zmq_monitor.recv_monitor_message(self._ctl_monitor, zmq.NOBLOCK)["event"]
            except zmq.Again:
                return
            if event == zmq.EVENT_DISCONNECTED:
                self._rejoin.connected = False
                if not self._rejoin.lost:
                    self._broker_lost()
            elif event == zmq.EVENT_CONNECTED:
                self._rejoin.connected = True
                self._rejoin.retry_at = 0.0

    def _broker_lost(self) -> None:
        """Fail every request in flight, drop the links: their workers went with the broker."""
        self._rejoin.lost = True
        err = WorkerDied("the broker is gone (stopped or restarting); this client takes a new session when it "
                         "is back")
        with self._role.exclusive():
            self._receiver.fail_all(err)
            for link in self._links.replace([], self.session_id, 0):
                link.close()
        log.warning("session %d: the broker is gone; waiting for it to come back", self.session_id)

    def _take_session(self) -> None:
        """While lost and the broker listens: a new session, swapped in whole, or another try after RETRY_S."""
        r = self._rejoin
        if not (r.lost and r.connected):
            return
        now = time.monotonic()
        if now < r.retry_at:
            return
        r.retry_at = now + RETRY_S
        try:
            hs = handshake(self._ctl, self.runtime_dir, r.n_slots, r.max_items, r.name, r.timeout)
        except (ShmBrokerError, OSError) as exc:
            r.refused = str(exc)
            log.warning("session lost: the broker's handshake failed (%s); trying again", exc)
            return
        why = rejoin_mismatch(hs.setup, r.n_slots, r.max_items, [p.info for p in self._by_id.values()])
        if why:
            r.refused = f"the restarted broker cannot take this client's place: {why}; make a new Client"
            log.error("%s", r.refused)
            with contextlib.suppress(zmq.ZMQError):
                self._ctl.send_multipart(P.encode(P.Bye(hs.setup.session_id)))
            hs.segment.close()
            r.retry_at = float("inf")
            return
        old, old_id = self.segment, self.session_id
        self.segment, self.session_id = hs.segment, hs.setup.session_id
        for by_slot in self._views.values():  # views of the old ring: a request still writing one is refused
            by_slot[:] = [None] * len(by_slot)
        self._hint_wait = HintWait(self.segment, self._spin_ns)
        self._links.replace(hs.ready.workers, hs.setup.session_id, hs.ready.token)
        self._links.wait_up(r.timeout)
        r.lost, r.refused = False, ""
        old.close()
        self._slots.wake_all()  # wait_ready() looks again
        log.info("session %d: the broker is back; new session %d", old_id, self.session_id)


def _settle(fut: Future[Outputs], value: Outputs | None, error: ShmBrokerError | None) -> None:
    """Complete a request's Future (its slots already free)."""
    try:
        if error is not None:
            fut.set_exception(error)
        else:
            fut.set_result(value)  # type: ignore[arg-type]
    except InvalidStateError:  # the caller cancelled it (asyncio.wait_for, say): tell concurrent.futures.wait
        fut.set_running_or_notify_cancel()


def _run_callback(callback: Callback, value: Outputs | None, error: ShmBrokerError | None) -> None:
    try:
        callback(value, error)
    except Exception:  # a user's callback must not stop the IO thread that serves every request
        log.exception("a submit callback raised; the client goes on")
