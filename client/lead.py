"""Who receives DONEs: the client's IO thread, or a caller thread that waits for its own answer (leader/follower).

A caller blocked in ``infer()`` would otherwise sleep until the IO thread wakes it: two wake-ups per
request, each of which makes the code after it run two to three times slower on small and virtual
machines. Instead the caller takes the receive role, polls the reply sockets itself (spinning briefly
when recent answers came quickly) and completes every DONE that arrives meanwhile, its own included.

The role's states (``ReceiveRole``: ``lock`` held by whoever polls the reply sockets; ``parked``; ``wanted``):

    state                lock holder             parked  receives             leaves it when
    IO thread receiving  IO thread, per poll     False   the IO thread        a caller leads (parks it)
    leader               a caller in infer(),    True    that caller, for     its answer came, its deadline
                         Request.run() or a              every request        passed, or a change is wanted
                         Future's result()
    watched              nobody                  True    nobody; the IO       a caller leads again, or none
                                                         thread looks every   did within WATCH_S (the IO
                                                         WATCH_MS             thread takes the role back)
    parked, idle         nobody                  True    nobody (none in      a request is sent (unpark) or
                                                         flight)              a caller leads
    link change wanted   the changer, once the   either  nobody, briefly      the new pollers are made
                         holder let go                                        (``exclusive``)

A leader in ``infer()`` whose answer came hands the role back to the IO thread (unparks and wakes it) only
while other requests are in flight; with none, the role stays parked, so the next ``infer()`` leads without a
wake-up. A leader in a Future's ``result()`` leaves the role watched instead: a thread that waits on Futures
comes back for the next one within microseconds, and its ``submit()`` calls meanwhile queue their SUBMITs
(client.client), which its next wait sends together, as callbacks' do. The IO thread, parked, sleeps
WATCH_MS while requests that no leader waits for are in flight (``dozing`` otherwise); it sends queued
SUBMITs at each look, and takes the role back once no caller has led for WATCH_S.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from typing import Any

import zmq

from shmbroker.broker.common.spin import SpinPolicy
from shmbroker.client.links import Link

POLL_SLICE_MS = 10  # a leader checks this often whether the IO thread needs the sockets back
# A watched role: the parked IO thread looks every WATCH_MS while requests that no leader waits for are in
# flight, and takes the role back once no caller has led for WATCH_S. A Futures loop comes back within
# microseconds; a Future waited on with concurrent.futures.wait (a done-callback unparks the IO thread at once,
# client.future) is answered at most about WATCH_MS + WATCH_S later. Looks
# are rare because each one takes the GIL from the running Futures loop (bench/RESULTS.md#client-apis).
WATCH_MS = 10
WATCH_S = 0.002
DOZE_MS = 100  # a parked IO thread with nothing to watch: only broker notices and wake-ups end its sleep


class ReceiveRole:
    """Invariant: a link's PULL socket is used only by the thread that holds ``lock``.

    The IO thread takes the lock for each poll unless ``parked``; a caller that leads sets ``parked`` so
    the IO thread leaves the reply sockets alone until someone needs it again (``unpark``). Link changes
    (``exclusive``) make a leader let go within one poll slice.
    """

    def __init__(self, wake: Callable[[], None], spin_us: int, io_reach: int) -> None:
        self.lock = threading.Lock()
        self.parked = False
        self.wanted = False
        # the parked IO thread sleeps DOZE_MS: whoever leaves requests for it to receive must wake it
        self.dozing = False
        self.watch_until = 0.0  # monotonic: the IO thread leaves a watched role parked until then
        self._last_leader = 0  # threading.get_ident() of the thread that led last
        self._wake = wake
        # a led wait spins only while most answers came back within the window (broker.common.spin); a
        # Future's waiter takes over the IO thread's stream of answers, so it spins by the IO thread's reach
        self._spin = SpinPolicy(spin_us * 1000)
        self._stream_spin = SpinPolicy(spin_us * 1000, reach=io_reach)
        self._local = threading.local()
        self._poller: tuple[tuple[Link, ...], zmq.Poller, dict[Any, Link]] | None = None

    def leading(self) -> bool:
        """True on a thread that holds the role as a leader (a completion callback running inside infer)."""
        return bool(getattr(self._local, "on", False))

    def io_may_receive(self) -> bool:
        """For the IO thread: take the lock for one poll of the reply sockets, unless a caller holds the role."""
        return not self.parked and self.lock.acquire(blocking=False)

    def led_last(self) -> bool:
        """True on the thread that led last while the role is still parked for it (watched or led)."""
        return self.parked and self._last_leader == threading.get_ident()

    def parked_sleep_ms(self, unwaited: bool) -> int:
        """For the parked IO thread, before it sleeps: WATCH_MS while ``unwaited`` (requests in flight that no
        leader waits for, or SUBMITs queued), else DOZE_MS with ``dozing`` set (reset by ``woke``)."""
        self.dozing = True  # first: a leader or sender that reads False after this knows the IO thread will look
        if unwaited:
            self.dozing = False
            return WATCH_MS
        return DOZE_MS

    def woke(self, now: float, unwaited: bool) -> None:
        """For the parked IO thread, after its sleep: take the role back if requests need receiving and no
        caller leads or has led within WATCH_S."""
        self.dozing = False
        if unwaited and now >= self.watch_until and not self.lock.locked():
            self.parked = False

    def unpark(self) -> None:
        """Hand receiving back to the IO thread (futures and callbacks wait on it)."""
        if self.parked:
            self.parked = False
            self._wake()

    @contextlib.contextmanager
    def exclusive(self, timeout: float = 5.0) -> Iterator[bool]:
        """Hold the sockets to change links; yields False if a leader did not let go within ``timeout``."""
        self.wanted = True
        got = self.lock.acquire(timeout=timeout)
        try:
            yield got
        finally:
            self.wanted = False
            if got:
                self.lock.release()

    def lead(self, fut: Future[Any], until: float, links: Callable[[], tuple[Link, ...]],
             drain: Callable[[Link], None], others_pending: Callable[[], bool],
             peek: Callable[[], bool] | None = None, linger: bool = False) -> None:
        """Receive on this thread until ``fut`` is done, ``until`` (monotonic) passes, or links change.

        While spinning, ``peek()`` also looks for the answer in the slot header and completes it from there
        (True), ahead of its DONE message. Returns without a result in the last two cases; the caller then
        waits on ``fut`` as usual, and the IO thread, unparked, receives what is left. ``linger`` (a
        Future's waiter): once ``fut`` is done the role is left watched, not handed back.
        """
        self.parked = True
        self._last_leader = threading.get_ident()
        if not self.lock.acquire(blocking=False):
            self._wake()  # the IO thread is polling: it lets go after this turn
            if not self.lock.acquire(timeout=max(0.0, until - time.monotonic())):
                self.unpark()
                return
        self._local.on = True
        spin = self._stream_spin if linger else self._spin
        spin.waiting(time.perf_counter_ns())
        try:
            self._receive(fut, until, links, drain, spin.until, peek)
        finally:
            self._local.on = False
            self.lock.release()
            if fut.done():
                spin.arrived(time.perf_counter_ns())
            self._leave(fut.done(), others_pending, linger)

    def _leave(self, answered: bool, others_pending: Callable[[], bool], linger: bool) -> None:
        if answered and linger:
            self.watch_until = time.monotonic() + WATCH_S
            if self.dozing and others_pending():
                self._wake()  # it looks from now on (parked_sleep_ms), and takes the role back after WATCH_S
        elif not answered or others_pending():
            self.parked = False
            self._wake()

    def _receive(self, fut: Future[Any], until: float, links: Callable[[], tuple[Link, ...]],
                 drain: Callable[[Link], None], spin_end: int, peek: Callable[[], bool] | None) -> None:
        clock = time.perf_counter_ns
        while not fut.done() and not self.wanted:
            left = until - time.monotonic()
            if left <= 0:
                return
            spinning = clock() < spin_end
            if spinning and peek is not None and peek():
                continue
            poller, by_socket = self._poller_for(links())
            timeout = 0 if spinning else min(POLL_SLICE_MS, int(left * 1000) + 1)
            ready = poller.poll(timeout)
            for sock, _ev in ready:
                drain(by_socket[sock])
            if spinning and not ready:
                os.sched_yield()  # a ready thread (ZeroMQ's IO thread, say) need not wait for this one's slice

    def _poller_for(self, links: tuple[Link, ...]) -> tuple[zmq.Poller, dict[Any, Link]]:
        cached = self._poller
        if cached is not None and cached[0] is links:
            return cached[1], cached[2]
        poller = zmq.Poller()
        for link in links:
            poller.register(link.pull, zmq.POLLIN)
        by_socket: dict[Any, Link] = {link.pull: link for link in links}
        self._poller = (links, poller, by_socket)
        return poller, by_socket
