"""The receiving side of a Client: the IO thread's loop, DONE decoding and completion, broker notices.

Invariant: DONEs are received and requests completed only by the holder of the receive role
(client.lead.ReceiveRole): the IO thread, or a caller waiting in ``infer()``, ``Request.run()`` or a Future's
``result()``. Links change only under ``ReceiveRole.exclusive``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import platform
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import zmq

from shmbroker.broker.common import proc
from shmbroker.broker.common import protocol as P
from shmbroker.broker.common.protocol import DONE_ENVELOPE, SLOT_HEADER, STATE_GEN, SlotState
from shmbroker.broker.common.ring import Segment
from shmbroker.broker.common.spin import SpinPolicy
from shmbroker.client.errors import ShmBrokerError, WorkerDied
from shmbroker.client.lead import ReceiveRole
from shmbroker.client.links import Link, Links
from shmbroker.client.slots import Pending, Slots

log = logging.getLogger(__name__)

# Reading an answer from the slot header, with no barrier between the state word and the outputs, relies on
# total store order: the worker's output bytes are visible before its state word. x86-64 gives that;
# elsewhere (ARM) answers come only by their DONE message.
SLOT_ANSWERS = platform.machine().lower() in ("x86_64", "amd64")
# The IO thread spins after answers while most answers come within this many of its windows (broker.common.spin's
# reach), not one: it spins only while requests are in flight, and it is on a slow or preempted machine,
# with answers 1-2 ms apart, that sleeping between them costs the most
# (bench/RESULTS.md#spin-policy-and-io-thread-reach).
IO_SPIN_REACH = 4
# ... but only while at most this many requests are in flight. With more, the worker already holds this
# process's next requests, so a late wake-up does not idle the device, and a spin that cannot reach the next
# answer only takes a core from the worker (bench/RESULTS.md#the-client-spin-with-many-requests-in-flight).
IO_SPIN_FAR_MAX = 16
# The IO thread's spin reads the slot headers of the requests in flight while there are at most this many: a
# few requests each waited on closely (a callback that sends the next); more would make each look cost more
# than the ZeroMQ hop it saves (bench/RESULTS.md#callbacks-read-answers-from-slot-headers).
PEEK_MAX = 4
# the IO thread's name as the kernel shows it (top -H, py-spy, /proc/PID/task/TID/comm): the CPU a client spends
# receiving, apart from the caller's threads and ZeroMQ's
IO_THREAD_NAME = "shmb-client-io"


class Receiver:
    """Owns the client's IO thread, its wake-up socket pair and the receive role; completes requests.

    ``segment`` returns the session's ring (it changes when the client takes a new session); ``broker_events``
    reads ``ctl_monitor`` (the control connection's) when it has events, and ``tick`` runs once per loop: the
    client's rejoin after a broker restart (client.rejoin).
    """

    def __init__(self, ctx: zmq.Context[zmq.Socket[bytes]], ctl: zmq.Socket[bytes], ctl_monitor: zmq.Socket[bytes],
                 links: Links, slots: Slots, spin_us: int, segment: Callable[[], Segment],
                 broker_events: Callable[[], None], tick: Callable[[], None], name: str) -> None:
        self._ctl = ctl
        self._ctl_monitor = ctl_monitor  # polled here; read by ``broker_events``
        self._links = links
        self._slots = slots
        self._segment = segment
        self._broker_events = broker_events
        self._tick = tick
        addr = f"inproc://wake-{id(self)}"
        self._wake_rx = ctx.socket(zmq.PAIR)  # read by the IO thread only
        self._wake_rx.bind(addr)
        self._wake_tx = ctx.socket(zmq.PAIR)  # any thread, under _wake_lock
        self._wake_tx.connect(addr)
        self._wake_lock = threading.Lock()
        self.role = ReceiveRole(self.wake, spin_us, IO_SPIN_REACH)
        # made once: a leader (every infer() and awaited Future) is handed these
        self._link_snapshot: Callable[[], tuple[Link, ...]] = lambda: links.current
        self._any_pending: Callable[[], bool] = lambda: bool(slots.pending)
        self._spin = SpinPolicy(spin_us * 1000, reach=IO_SPIN_REACH)  # when the IO thread polls without sleeping
        self.stop_event = threading.Event()
        self.drained: threading.Event | None = None  # set once nothing is in flight, while close() waits
        self.thread = threading.Thread(target=self._io_loop, name=name, daemon=True)

    # -- for the client ------------------------------------------------------------------------------------------
    def lead(self, fut: Future[Any], until: float, slot: int | None, linger: bool) -> None:
        """Receive on this thread until ``fut`` is done or ``until`` (client.lead); with ``slot``, a spinning
        wait also reads that slot's answer from its header."""
        peek = (lambda: self.answered_in_slot(slot)) if slot is not None and SLOT_ANSWERS else None
        self.role.lead(fut, until, self._link_snapshot, self.drain, self._any_pending, peek, linger)

    def on_io_thread(self) -> bool:
        return threading.current_thread() is self.thread

    def wake(self) -> None:
        with self._wake_lock, contextlib.suppress(zmq.ZMQError):
            self._wake_tx.send(b"", zmq.NOBLOCK)

    @staticmethod
    def shutdown(stop: threading.Event, io: threading.Thread, wake: Callable[[], None]) -> None:
        """Stop the IO thread and wait for it (at most 5 s); safe from a finalizer and from the thread itself."""
        stop.set()
        wake()
        if io is not threading.current_thread():
            io.join(timeout=5)

    def fail_all(self, err: ShmBrokerError) -> None:
        """Complete every request in flight with ``err`` (the caller holds the role exclusively)."""
        for slot, p in list(self._slots.pending.items()):
            self._finish(slot, p, self._links.get(p.worker_id), err)

    # -- the IO thread -------------------------------------------------------------------------------------------
    def _io_loop(self) -> None:
        """(1) poll, (2) DONEs from workers, unless a caller receives them, (3) broker notices, (4) links up,
        (5) the broker's connection lost or back, and a new session after a restart (client.rejoin), (6) while
        close() waits, tell it once nothing is in flight."""
        proc.name_thread(IO_THREAD_NAME)
        pollers: tuple[zmq.Poller, zmq.Poller] | None = None
        links: tuple[Link, ...] = ()
        spin = self._spin
        try:
            while not self.stop_event.is_set():
                if pollers is None or self._links.changed:
                    pollers, links = self._make_pollers()
                if self.role.io_may_receive():
                    try:
                        events, answered = self._poll(pollers[0])  # (1), and answers read from slot headers
                        for link in links:
                            if link.pull in events:
                                if not answered:
                                    far = len(self._slots.pending) <= IO_SPIN_FAR_MAX
                                    spin.arrived(time.perf_counter_ns(), far=far)
                                    answered = True
                                self.drain(link)  # (2)
                        if answered:
                            spin.waiting(time.perf_counter_ns())
                    finally:
                        self.role.lock.release()
                else:  # parked: a caller holds the reply sockets, or left them for a moment (client.lead)
                    events = self._parked_poll(pollers[1])
                for link in links:
                    if link.monitor in events:  # (4) a reply connection came up, or closed
                        self._link_event(link)
                if self._ctl in events:
                    self._drain_control()  # (3)
                if self._wake_rx in events:
                    with contextlib.suppress(zmq.Again):
                        while True:
                            self._wake_rx.recv(zmq.NOBLOCK)
                if self._ctl_monitor in events:
                    self._broker_events()  # (5)
                self._tick()
                if self.drained is not None and not self._slots.pending:
                    self.drained.set()  # (6) close() waits for this
        except zmq.ContextTerminated:
            return
        except zmq.ZMQError:
            if self.stop_event.is_set():  # a callback closed the client: its sockets are gone under this loop
                return
            raise

    def _poll(self, poller: zmq.Poller) -> tuple[dict[Any, int], bool]:
        """The IO thread's poll: its events, and whether it completed answers from slot headers meanwhile.

        Right after it handled answers, while more are in flight and most recent answers came within
        ``IO_SPIN_REACH`` windows of the client's ``spin_us`` (one window while more than ``IO_SPIN_FAR_MAX``
        are in flight; broker.common.spin), it polls without sleeping
        until one comes or the window ends. Why: on small and virtual machines a thread woken from sleep
        costs tens of microseconds more per wake-up, and it is woken once per DONE message
        (bench/RESULTS.md#io-thread-spin). While at most ``PEEK_MAX`` requests are in flight, the spin also
        reads their slot headers, as a caller in ``infer()`` does: an answer is complete there before its
        DONE message has crossed both ZeroMQ IO threads."""
        spin = self._spin
        pending = self._slots.pending
        if spin.until and pending:
            clock = time.perf_counter_ns
            peek = SLOT_ANSWERS and len(pending) <= PEEK_MAX
            while clock() < spin.until:
                events = poller.poll(0)
                if events:
                    return dict(events), False
                if peek and self._answered_in_slots():
                    spin.arrived(clock())
                    return {}, True
                # a ready thread (ZeroMQ's IO thread bringing the answer, another process) runs first
                os.sched_yield()
        return dict(poller.poll(100)), False

    def _answered_in_slots(self) -> bool:
        """Complete every request in flight whose slot header says DONE (``answered_in_slot``); True if any
        did. Submits made by their callbacks go out together after them, as in ``drain``."""
        answered = False
        with self._links.cork:
            for slot in list(self._slots.pending):
                answered = self.answered_in_slot(slot) or answered
        if answered:
            self._links.flush_all()
        return answered

    def _parked_poll(self, poller: zmq.Poller) -> dict[Any, int]:
        """The parked IO thread's poll of everything but the reply sockets. It looks every WATCH_MS while
        requests that no leader waits for are in flight or SUBMITs are queued: it sends those, and takes the
        role back once no caller has led for WATCH_S (client.lead)."""
        role = self.role
        events = dict(poller.poll(role.parked_sleep_ms(self._unwaited())))
        role.woke(time.monotonic(), self._unwaited())
        self._links.flush_all()
        return events

    def _unwaited(self) -> bool:
        """Requests in flight beyond the one a leader (if any) waits for, or SUBMITs queued."""
        return len(self._slots.pending) > self.role.lock.locked() or self._links.queued()

    def _make_pollers(self) -> tuple[tuple[zmq.Poller, zmq.Poller], tuple[Link, ...]]:
        """(everything, everything but the reply sockets), and the links they cover."""
        self._links.changed = False
        links = self._links.current
        full, control = zmq.Poller(), zmq.Poller()
        for poller in (full, control):
            poller.register(self._ctl, zmq.POLLIN)
            poller.register(self._ctl_monitor, zmq.POLLIN)
            poller.register(self._wake_rx, zmq.POLLIN)
            for link in links:
                if not link.lost:
                    poller.register(link.monitor, zmq.POLLIN)
        for link in links:
            full.register(link.pull, zmq.POLLIN)
        return (full, control), links

    # -- completion (the receive role's holder) ------------------------------------------------------------------
    def drain(self, link: Link) -> None:
        """Receive and complete the DONEs waiting on ``link`` (its caller's poll said one is there)."""
        with self._links.cork:  # submits made by callbacks coalesce into one message per worker
            for k in range(64):
                if k and not link.pull_ready.poll(0):
                    break
                try:
                    frames = link.pull.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                self.on_done_message(link, frames)
        self._links.flush_all()

    def on_done_message(self, link: Link, frames: list[bytes]) -> None:
        """Complete the requests of one message from ``link``'s reply socket: the fast path, else the full
        decode; a malformed message is logged and dropped."""
        if self._fast_done(link, frames):
            return
        try:
            if P.read_envelope(frames) != P.MsgKind.DONE:
                raise P.ProtocolError("a reply socket carries only DONE")
            results = P.decode_done(frames[1]).results
        except P.ProtocolError as exc:
            log.error("malformed DONE from worker %d: %s", link.worker_id, exc)
            return
        for r in results:
            p = self._slots.pending.get(r.slot)
            if p is None or p.request_id != r.request_id or p.generation != r.generation:
                log.debug("ignored a result for slot %s that is not in flight", r.slot)
                continue
            self._finish(r.slot, p, link, r)

    def _fast_done(self, link: Link, frames: list[bytes]) -> bool:
        """Complete the requests of a DONE whose every result is OK with the canonical output layout (True).
        Otherwise (False) the caller decodes the message in full; the results before the first that needs it
        may be completed already, and the full decode then skips them, as it skips any result whose request
        is no longer in flight."""
        if len(frames) != 2 or frames[0] != DONE_ENVELOPE or len(frames[1]) < P.DONE_HEADER.size:
            return False
        body = frames[1]
        _sid, n_res, n_t, text_len = P.DONE_HEADER.unpack_from(body)
        t_base = P.DONE_HEADER.size + P.RESULT.size * n_res
        t_size = P.TENSOR.size
        if len(body) != t_base + t_size * n_t + text_len:
            return False
        pending = self._slots.pending
        for rid, slot, gen, status, first, count, _mo, _ml, _r in P.RESULT.iter_unpack(body[P.DONE_HEADER.size:t_base]):
            # A callback run for an earlier result may have reused that result's slot: a repeat of it then
            # finds another request there, and is skipped like any result not in flight.
            p = pending.get(slot)
            if p is None or p.request_id != rid or p.generation != gen:
                continue  # already answered from the slot header (answered_in_slot), or not in flight
            lay = p.layout
            if (status or first > n_t or count != len(lay.out_descs) or count > n_t - first
                    or not body.startswith(lay.out_desc_bytes, t_base + t_size * first)):
                return False
            self._finish(slot, p, link, lay.ok)
        return True

    def answered_in_slot(self, slot: int) -> bool:
        """Complete the request in flight in ``slot`` if its header already says DONE with status OK; its DONE
        message, when it comes, is then skipped. Only the receive role's holder calls this (client.lead).

        The worker writes a slot's outputs, then (after freeing its claim) the status and the state word
        last, so DONE in the header means the canonical outputs are in place.
        """
        segment = self._segment()
        buf = segment.buf
        base = segment.layout.slot_bases[slot]
        if STATE_GEN.unpack_from(buf, base)[0] != SlotState.DONE:  # the state word first, alone: the cheap test
            return False
        _state, gen, _rid, status = SLOT_HEADER.unpack_from(buf, base)
        p = self._slots.pending.get(slot)
        link = self._links.get(p.worker_id) if p is not None else None
        if p is None or link is None or p.generation != gen or status:
            return False  # an error's message comes only with the DONE message
        self._finish(slot, p, link, p.layout.ok)
        return True

    def _finish(self, slot: int, p: Pending, link: Link | None, r: P.Result | ShmBrokerError) -> None:
        del self._slots.pending[slot]
        if link is not None:
            link.outstanding -= 1
        p.on_done(r)

    def _fail_worker(self, worker_id: int, err: ShmBrokerError) -> None:
        link = self._links.get(worker_id)
        for slot, p in list(self._slots.pending.items()):
            if p.worker_id == worker_id:
                self._finish(slot, p, link, err)

    # -- broker notices and links (IO thread) --------------------------------------------------------------------
    def _link_event(self, link: Link) -> None:
        """(4) A reply connection came up, or closed: waiting callers look again."""
        was_up = link.up
        if link.handshake_done() != was_up:
            self._links.changed = True
            if link.lost:
                self._link_lost(link)
            self._slots.wake_all()

    def _drain_control(self) -> None:
        while True:
            try:
                frames = self._ctl.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                msg = P.decode(frames)
            except P.ProtocolError as exc:
                log.error("malformed message from the broker: %s", exc)
                continue
            if isinstance(msg, P.WorkerDown):
                self._worker_down(msg.worker_id, msg.reason)
            elif isinstance(msg, P.WorkerUp):
                self._worker_down(msg.worker.worker_id, "replaced")  # a link we still hold is its predecessor's
                self._links.add(msg.worker)

    def _worker_down(self, worker_id: int, reason: str) -> None:
        link = self._links.get(worker_id)
        if link is None:
            return
        err = f"worker {worker_id} died ({reason})"
        with self.role.exclusive() as held:  # completions and the reply sockets belong to the receive role
            if not held:
                log.error("a completion callback held the receive role for 5 s; closing link %d anyway", worker_id)
            self._fail_worker(worker_id, WorkerDied(err))
            self._links.pop(worker_id)
            link.close()
        log.warning("%s", err)

    def _link_lost(self, link: Link) -> None:
        """The worker closed its reply connection: fail its requests now rather than at their deadlines (the
        broker, if it is alive, also sends WORKER_DOWN and later WORKER_UP, which replace the link)."""
        err = f"worker {link.worker_id} closed its connection (it or the broker is gone)"
        with self.role.exclusive():
            self._fail_worker(link.worker_id, WorkerDied(err))
        log.warning("%s", err)
