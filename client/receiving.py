"""The receiving side of a Client: the IO thread's loop, DONE decoding and completion, broker notices.

Invariant: DONEs are received and requests completed only by the holder of the receive role
(client.lead.ReceiveRole): the IO thread, or a caller waiting in ``infer()``. Links change only under
``ReceiveRole.exclusive``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import platform
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import zmq

from shmbroker.broker.common import protocol as P
from shmbroker.broker.common.protocol import SLOT_HEADER, STATE_GEN, SlotState
from shmbroker.broker.common.ring import Segment
from shmbroker.broker.common.spin import SpinPolicy
from shmbroker.client.errors import ShmBrokerError, WorkerDied
from shmbroker.client.lead import ReceiveRole
from shmbroker.client.rejoin import Rejoin
from shmbroker.client.session import Cork, Link, ModelPlan, RowsLayout

log = logging.getLogger(__name__)

DONE_ENVELOPE = P.envelope(P.MsgKind.DONE)
# Reading an answer from the slot header, with no barrier between the state word and the outputs, relies on
# total store order: the worker's output bytes are visible before its state word. x86-64 gives that;
# elsewhere (ARM) answers come only by their DONE message.
SLOT_ANSWERS = platform.machine().lower() in ("x86_64", "amd64")
# The IO thread spins after answers while most answers come within this many of its windows (broker.common.spin's
# reach), not one: it spins only while requests are in flight, and it is on a slow or preempted machine,
# with answers 1-2 ms apart, that sleeping between them costs the most
# (bench/RESULTS.md#spin-policy-and-io-thread-reach).
IO_SPIN_REACH = 4


@dataclass(slots=True)
class Pending:
    """A request in flight, keyed by its slot in ``Client._pending``."""

    request_id: int
    generation: int
    plan: ModelPlan
    worker_id: int
    on_done: Callable[[P.Result | ShmBrokerError], None]  # frees the slot, unless a zero-copy Request holds it
    layout: RowsLayout


class Receiving:
    """Mixed into Client: everything that runs when an answer or a notice arrives."""

    _stop: threading.Event
    _ctx: zmq.Context[zmq.Socket[bytes]]
    segment: Segment
    _ctl: zmq.Socket[bytes]
    _wake_rx: zmq.Socket[bytes]
    _wake_tx: zmq.Socket[bytes]
    _wake_lock: threading.Lock
    _role: ReceiveRole
    _io_spin: SpinPolicy  # when the IO thread polls without sleeping
    _links: dict[int, Link]
    _links_lock: threading.Lock
    _links_changed: bool
    _pending: dict[int, Pending]
    _drained: threading.Event | None
    _ctl_monitor: zmq.Socket[bytes]
    _rejoin: Rejoin
    _broker_link: Callable[[], None]
    _take_session: Callable[[float], None]
    _slot_cond: threading.Condition
    _cork: Cork  # callbacks' submits leave together
    _io: threading.Thread
    _snapshot_links: Callable[[], tuple[Link, ...]]  # methods of Client
    _links_updated: Callable[[], None]
    flush: Callable[[], None]

    def _io_loop(self) -> None:
        """(1) poll, (2) DONEs from workers, unless a caller receives them, (3) broker notices, (4) links up,
        (5) the broker's connection lost or back, and a new session after a restart (client.rejoin), (6) while
        close() waits, tell it once nothing is in flight."""
        pollers: tuple[zmq.Poller, zmq.Poller] | None = None
        links: tuple[Link, ...] = ()
        spin = self._io_spin
        try:
            while not self._stop.is_set():
                if pollers is None or self._links_changed:
                    pollers, links = self._make_pollers()
                if self._role.io_may_receive():
                    try:
                        events = self._poll(pollers[0])  # (1)
                        answered = False
                        for link in links:
                            if link.pull in events:
                                if not answered:
                                    spin.arrived(time.perf_counter_ns())
                                    answered = True
                                self._drain_done(link)  # (2)
                        if answered:
                            spin.waiting(time.perf_counter_ns())
                    finally:
                        self._role.lock.release()
                else:  # parked: a caller holds the reply sockets, or left them for a moment (client.lead)
                    events = self._parked_poll(pollers[1])
                for link in links:
                    if link.monitor in events:  # (4) a reply connection came up, or closed
                        was_up = link.up
                        if link.handshake_done() != was_up:
                            self._links_changed = True
                            if link.lost:
                                self._link_lost(link)
                            with self._slot_cond:
                                self._slot_cond.notify_all()
                if self._ctl in events:
                    self._drain_control()  # (3)
                if self._wake_rx in events:
                    with contextlib.suppress(zmq.Again):
                        while True:
                            self._wake_rx.recv(zmq.NOBLOCK)
                if self._ctl_monitor in events:
                    self._broker_link()  # (5)
                if self._rejoin.lost:
                    self._take_session(time.monotonic())
                if self._drained is not None and not self._pending:
                    self._drained.set()  # (6) close() waits for this
        except zmq.ContextTerminated:
            return
        except zmq.ZMQError:
            if self._stop.is_set():  # a callback closed the client: its sockets are gone under this loop
                return
            raise

    def _poll(self, poller: zmq.Poller) -> dict[Any, int]:
        """The IO thread's poll. Right after it handled answers, while more are in flight and most recent
        answers came within ``IO_SPIN_REACH`` windows of the client's ``spin_us`` (broker.common.spin), it polls
        without sleeping until one comes or the window ends. Why: on small and virtual machines a thread
        woken from sleep costs tens of microseconds more per wake-up, and it is woken once per DONE message
        (bench/RESULTS.md#io-thread-spin)."""
        spin = self._io_spin
        if spin.until and self._pending:
            clock = time.perf_counter_ns
            while clock() < spin.until:
                events = poller.poll(0)
                if events:
                    return dict(events)
                # a ready thread (ZeroMQ's IO thread bringing the answer, another process) runs first
                os.sched_yield()
        return dict(poller.poll(100))

    def _parked_poll(self, poller: zmq.Poller) -> dict[Any, int]:
        """The parked IO thread's poll of everything but the reply sockets. It looks every WATCH_MS while
        requests that no leader waits for are in flight or SUBMITs are queued: it sends those, and takes the
        role back once no caller has led for WATCH_S (client.lead)."""
        role = self._role
        events = dict(poller.poll(role.parked_sleep_ms(self._unwaited())))
        role.woke(time.monotonic(), self._unwaited())
        self.flush()
        return events

    def _unwaited(self) -> bool:
        """Requests in flight beyond the one a leader (if any) waits for, or SUBMITs queued."""
        return len(self._pending) > self._role.lock.locked() or any(
            link.queue for link in self._snapshot_links())

    def _make_pollers(self) -> tuple[tuple[zmq.Poller, zmq.Poller], tuple[Link, ...]]:
        """(everything, everything but the reply sockets), and the links they cover."""
        self._links_changed = False
        links = self._snapshot_links()
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

    def _drain_done(self, link: Link) -> None:
        """Receive and complete the DONEs waiting on ``link`` (its caller's poll said one is there)."""
        with self._cork:  # submits made by callbacks coalesce into one message per worker
            for k in range(64):
                if k and not link.pull_ready.poll(0):
                    break
                try:
                    frames = link.pull.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                self._on_done_message(link, frames)
        self.flush()

    def _on_done_message(self, link: Link, frames: list[bytes]) -> None:
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
            self._complete(link, r)

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
        pending = self._pending
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
            del pending[slot]
            link.outstanding -= 1
            p.on_done(lay.ok)
        return True

    def answered_in_slot(self, slot: int) -> bool:
        """Complete the request in flight in ``slot`` if its header already says DONE with status OK; its DONE
        message, when it comes, is then skipped. Only the receive role's holder calls this (client.lead).

        The worker writes a slot's outputs, then (after freeing its claim) the status and the state word
        last, so DONE in the header means the canonical outputs are in place.
        """
        buf = self.segment.buf
        base = self.segment.layout.slot_bases[slot]
        if STATE_GEN.unpack_from(buf, base)[0] != SlotState.DONE:  # the state word first, alone: the cheap test
            return False
        _state, gen, _rid, status = SLOT_HEADER.unpack_from(buf, base)
        p = self._pending.get(slot)
        link = self._links.get(p.worker_id) if p is not None else None
        if p is None or link is None or p.generation != gen or status:
            return False  # an error's message comes only with the DONE message
        del self._pending[slot]
        link.outstanding -= 1
        p.on_done(p.layout.ok)
        return True

    def _complete(self, link: Link, r: P.Result | ShmBrokerError, slot: int | None = None) -> None:
        slot = r.slot if isinstance(r, P.Result) else slot
        if slot is None:
            return
        p = self._pending.get(slot)
        if p is None or (isinstance(r, P.Result) and (p.request_id != r.request_id or p.generation != r.generation)):
            log.debug("ignored a result for slot %s that is not in flight", slot)
            return
        del self._pending[slot]
        link.outstanding -= 1
        p.on_done(r)

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
                self._worker_up(msg.worker)

    def _worker_down(self, worker_id: int, reason: str) -> None:
        with self._links_lock:
            link = self._links.pop(worker_id, None)
        if link is None:
            return
        self._links_updated()
        self._links_changed = True
        err = f"worker {worker_id} died ({reason})"
        with self._role.exclusive() as held:  # completions and the reply sockets belong to the receive role
            if not held:
                log.error("a completion callback held the receive role for 5 s; closing link %d anyway", worker_id)
            link.close()
            for slot, p in list(self._pending.items()):
                if p.worker_id == worker_id:
                    self._complete(link, WorkerDied(err), slot)
        log.warning("%s", err)

    def _link_lost(self, link: Link) -> None:
        """The worker closed its reply connection: fail its requests now rather than at their deadlines (the
        broker, if it is alive, also sends WORKER_DOWN and later WORKER_UP, which replace the link)."""
        err = f"worker {link.worker_id} closed its connection (it or the broker is gone)"
        with self._role.exclusive():
            for slot, p in list(self._pending.items()):
                if p.worker_id == link.worker_id:
                    self._complete(link, WorkerDied(err), slot)
        log.warning("%s", err)

    def _worker_up(self, info: P.WorkerInfo) -> None:
        self._worker_down(info.worker_id, "replaced")  # a link we still hold is to the dead predecessor
        link = Link(self._ctx, info)
        with self._links_lock:
            self._links[info.worker_id] = link
        self._links_updated()
        self._links_changed = True

    def _wait_links_up(self, timeout: float) -> None:
        end = time.monotonic() + timeout
        for link in self._snapshot_links():
            while not link.handshake_done():
                left = end - time.monotonic()
                if left <= 0 or not link.monitor.poll(int(left * 1000)):
                    break

    def _fail_all(self, err: ShmBrokerError) -> None:
        for link in self._snapshot_links():
            for slot, p in list(self._pending.items()):
                if p.worker_id == link.worker_id:
                    self._complete(link, err, slot)

    def _wake(self) -> None:
        with self._wake_lock, contextlib.suppress(zmq.ZMQError):
            self._wake_tx.send(b"", zmq.NOBLOCK)

    @staticmethod
    def _shutdown(stop: threading.Event, io: threading.Thread, wake: Callable[[], None]) -> None:
        stop.set()
        wake()
        if io is not threading.current_thread():
            io.join(timeout=5)
