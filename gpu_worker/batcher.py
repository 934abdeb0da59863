"""The dynamic batcher of one model: a bounded FIFO that hands out batches by its policy's rule (with
``by_session``, a batch takes each session's queued requests together, sessions by their oldest request).

Invariant: a request is in the queue, or in exactly one batch, or answered expired; never two of these.
A batch forms at once when the rule says so (``BatchingRule.at_once``: ``max_batch`` rows, a preferred size,
an idle executor); else when the oldest request has waited ``max_queue_delay_us`` and the runner's ``hold``
(how long the device stays busy without this batch, less the time its rows take to copy in) has passed. It
takes the rows the rule sizes it to, fewer while a batch of the model runs on a device that said what it
prepared (``device_ready``).
Requests past their deadline are never put in a batch. Every batch handed out is reported ``done`` once.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Generic, Protocol, TypeVar

from shmbroker.gpu_worker.batching import BatchPolicy

T = TypeVar("T")


class Entry(Protocol):
    """What the batcher reads of a queued request (the worker's ``runner.Work`` is one: no wrapper per request)."""

    @property
    def rows(self) -> int: ...  # batch rows this request brings

    @property
    def deadline(self) -> float: ...  # time.monotonic() seconds

    @property
    def enqueued(self) -> float: ...

    @property
    def session(self) -> object: ...  # the client session that sent it (``BatchPolicy.by_session`` groups by it)


E = TypeVar("E", bound=Entry)


@dataclass(slots=True)
class Queued(Generic[T]):
    """An entry that carries any item."""

    item: T
    rows: int
    deadline: float
    enqueued: float = field(default_factory=time.monotonic)
    session: object = None


@dataclass(slots=True)
class Take(Generic[E]):
    batch: list[E]
    expired: list[E]


@dataclass(slots=True)
class More(Generic[E]):
    """What ``take_more`` hands a batch that is still filling; ``close``: launch it now."""

    batch: list[E]
    expired: list[E]
    close: bool


class Batcher(Generic[E]):
    """Thread-safe: ``put`` and ``expire`` from the intake thread, ``take`` from the model's runner.

    ``policy`` (``BatchPolicy.from_config``) gives the sizes, the delay, the queue's bound and the rule."""

    def __init__(self, policy: BatchPolicy) -> None:
        self.policy = policy
        self.rule = policy.new_rule()
        self._by_session = policy.by_session
        self._at_once = self.rule.at_once  # bound once: called on every put and take
        self.max_batch = policy.max_batch
        self._running = 0
        # time.monotonic(): a batch of r rows that is not full need not leave before hold_until - r * hold_per_row
        self.hold_until = 0.0
        self.hold_per_row = 0.0
        # the batch sizes the engine runs without padding (empty: every size); while a batch of this batcher runs,
        # one that is not full takes the largest of these that its rows reach, and the rest wait (``device_ready``)
        self._fits: list[int] = []
        self._waiters = 0  # threads asleep in ``take`` or ``take_more``
        self._filling = 0  # while the runner waits in ``take_more``: the rows that wake it
        # a batch filling on the device (``take_more``) opens by the delay alone; the hold says when it closes
        self.early = policy.early
        self._wake_at = float("inf")  # when the one waiter wakes by itself (meaningful while _waiters == 1)
        self.delay = policy.max_queue_delay_us / 1e6
        self.max_queue_size = policy.max_queue_size
        self._q: deque[E] = deque()
        self._items = 0
        self._cond = threading.Condition(threading.Lock())
        self._closed = False

    def device_ready(self, sizes: Sequence[int]) -> None:
        """The device runner, once warm (or started without warm-up), says what bounds a batch formed while
        another of the model runs: ``sizes``, the batch sizes its engine prepared (empty: every size; used with
        ``trim_to_sizes``). Called once, before batches run."""
        with self._cond:
            self._fits = sorted(sizes) if self.policy.trim_to_sizes else []

    def __len__(self) -> int:
        return len(self._q)

    def put(self, entry: E, wake: bool = True) -> bool:
        """Queue a request; False when the queue is full (the caller answers OVERLOADED).

        ``wake=False`` leaves the runner asleep: the caller will run the batch itself or ``kick()``.
        """
        with self._cond:
            if self._closed or len(self._q) >= self.max_queue_size:
                return False
            self._q.append(entry)
            self._items += entry.rows
            if wake:
                self._wake(entry.deadline)
        return True

    def put_many(self, entries: list[E], wake: bool = True) -> int:
        """Queue entries in order under one lock; returns how many fitted (the rest get OVERLOADED)."""
        with self._cond:
            room = 0 if self._closed else max(0, self.max_queue_size - len(self._q))
            taken = entries if room >= len(entries) else entries[:room]
            self._q.extend(taken)
            self._items += sum(e.rows for e in taken)
            if wake and taken:
                self._wake(min(e.deadline for e in taken))
        return len(taken)

    def done(self) -> None:
        """A batch handed out by ``take`` or ``take_now`` has finished: if the rule says so (``freed``: an idle
        executor, say), a queued request that waits for the delay may be due now. Nobody is woken otherwise: a
        due batch needs no wake-up from here, and a cheap model's runner thread stays asleep while the intake
        runs its batches inline."""
        with self._cond:
            self._running -= 1
            # a filling batch left alone (the device is about to idle), or an executor free for a due batch
            alone = self._filling and self._running <= 1
            if alone or (self._q and self.delay > 0 and self.rule.freed(self._running)):
                self._cond.notify()

    @property
    def running(self) -> int:
        """Batches handed out and not yet ``done``."""
        return self._running

    def kick(self) -> None:
        """Wake the runner if a batch is due before it would wake by itself."""
        with self._cond:
            self._wake(float("inf"))

    def hold(self, until: float, per_row_s: float = 0.0) -> None:
        """A batch of r rows that is not full may wait until ``until - r * per_row_s`` (time.monotonic()) to
        grow, even after the delay: the device runs other batches till then, and its rows take ``per_row_s``
        each to copy in. The runner moves it as batches launch and end; ``until`` 0 holds nothing."""
        with self._cond:
            before = self._held_until()
            self.hold_until = until
            self.hold_per_row = per_row_s
            if self._held_until() < before and self._waiters:
                self._cond.notify()

    def _held_until(self) -> float:
        """The hold of a batch of the queued rows."""
        return self.hold_until - self.hold_per_row * min(self._items, self.max_batch)

    def _wake(self, deadline: float) -> None:
        """Notify a waiting runner if the queue (with a new entry's ``deadline``) is due before it plans to wake;
        with several waiters (host instances), always."""
        if not self._waiters or not self._q:
            return
        if self._filling:
            if self._items >= self._filling or deadline < self._wake_at:
                self._cond.notify()
        elif self._waiters > 1 or min(self._due_at(time.monotonic()), deadline) < self._wake_at:
            self._cond.notify()

    def expire(self, now: float) -> list[E]:
        """Remove and return every request whose deadline has passed."""
        with self._cond:
            return self._drop_expired(now)

    def remove(self, match: Callable[[E], bool]) -> list[E]:
        """Remove and return the queued requests that ``match`` (a closing session's, say)."""
        with self._cond:
            gone = [e for e in self._q if match(e)]
            if gone:
                self._q = deque(e for e in self._q if not match(e))
                self._items -= sum(e.rows for e in gone)
        return gone

    def next_deadline(self) -> float | None:
        with self._cond:
            return min((e.deadline for e in self._q), default=None)

    def close(self) -> list[E]:
        """Stop handing out batches; return what was still queued (the caller answers it)."""
        with self._cond:
            self._closed = True
            left = list(self._q)
            self._q.clear()
            self._items = 0
            self._cond.notify_all()
        return left

    def take_now(self) -> Take[E] | None:
        """A batch if one is due right now (or requests expired), else None; never blocks."""
        with self._cond:
            now = time.monotonic()
            expired = self._drop_expired(now)
            if self._q and self._due_in(now) <= 0.0:
                return Take(self._pop_batch(), expired)
            return Take([], expired) if expired else None

    def take(self, timeout: float | None = None) -> Take[E] | None:
        """Block until a batch is due (or requests expired); None after ``timeout`` or once closed."""
        end = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while not self._closed:
                now = time.monotonic()
                expired = self._drop_expired(now)
                wait = self._due_in(now)
                if wait <= 0.0:
                    take = Take(self._pop_batch(), expired)
                    if self._due_in(now) <= 0.0:
                        self._cond.notify()  # another batch is due as well: for another taking thread, if any
                    return take
                if expired:
                    return Take([], expired)
                if end is not None:
                    if now >= end:
                        return None
                    wait = min(wait, end - now)
                self._sleep(now, wait)
        return None

    def take_more(self, room: int, chunk: int, timeout: float) -> More[E]:
        """More rows for a batch handed out and still filling, whose rows are copied as they come: up to
        ``room`` rows, once ``min(chunk, room)`` wait; ``close`` once it should launch (``hold_until`` passed,
        no other batch runs, the next request does not fit ``room``, or closed). Returns at the latest after
        ``timeout`` seconds (``close`` False)."""
        end = time.monotonic() + timeout
        need = max(1, min(chunk, room))
        with self._cond:
            while True:
                now = time.monotonic()
                expired = self._drop_expired(now)
                # the next request does not fit what is left: the batch is as full as it gets
                full = bool(self._q) and self._q[0].rows > room
                close = self._closed or full or self._running <= 1 or now >= self.hold_until
                if close or expired or self._items >= need or now >= end:
                    batch = [] if self._closed else self._pop_rows(room)
                    left = room - sum(e.rows for e in batch)
                    return More(batch, expired, close or (bool(self._q) and self._q[0].rows > left))
                soonest = min((e.deadline for e in self._q), default=end)
                self._filling = need
                try:
                    self._sleep(now, max(0.0, min(self.hold_until, soonest, end) - now))
                finally:
                    self._filling = 0

    def _pop_rows(self, room: int) -> list[E]:
        """Queued requests in order while they fit ``room`` rows (with ``by_session``, in ``_session_order``);
        ``running`` is the caller's to count."""
        if self._by_session and len(self._q) > 1:
            return self._pop_by_session(room)
        out: list[E] = []
        rows = 0
        while self._q and rows + self._q[0].rows <= room:
            e = self._q.popleft()
            rows += e.rows
            out.append(e)
        self._items -= rows
        return out

    def _pop_by_session(self, room: int) -> list[E]:
        """``_pop_rows`` in ``_session_order``; the requests left keep their order."""
        out: list[E] = []
        rows = 0
        for e in self._session_order():
            if rows + e.rows > room:
                break
            rows += e.rows
            out.append(e)
        if len(out) == len(self._q):
            self._q.clear()
        elif out:
            taken = set(map(id, out))
            self._q = deque(e for e in self._q if id(e) not in taken)
        self._items -= rows
        return out

    def _session_order(self) -> list[E]:
        """The queue with each session's requests together, in their order, the sessions by their oldest
        request: the head comes first, as in arrival order."""
        by_session: dict[object, list[E]] = {}
        for e in self._q:
            by_session.setdefault(e.session, []).append(e)
        return [e for entries in by_session.values() for e in entries]

    def _sleep(self, now: float, wait: float) -> None:
        """Wait on the condition for ``wait`` seconds at most (inf: until notified), recording when."""
        self._waiters += 1
        self._wake_at = now + wait
        try:
            self._cond.wait(None if wait == float("inf") else wait)
        finally:
            self._waiters -= 1

    # -- policy ---------------------------------------------------------------------------------------
    def _due_in(self, now: float) -> float:
        """Seconds until a batch is due: 0 now, inf while the queue is empty."""
        if not self._q:
            return float("inf")
        if self._at_once(self._items, self._running):
            return 0.0
        wait_until = self._q[0].enqueued + self.delay
        if not self.early:
            wait_until = max(wait_until, self._held_until())
        if wait_until <= now:  # the common case of a zero delay: no need to look for the soonest deadline
            return 0.0
        soonest_deadline = min(e.deadline for e in self._q)
        return max(0.0, min(wait_until, soonest_deadline) - now)

    def _due_at(self, now: float) -> float:
        """When a batch is due, as ``_due_in`` says, without the queue's deadlines (the waiter knows those)."""
        if not self._q:
            return float("inf")
        if self._at_once(self._items, self._running):
            return now
        opens = self._q[0].enqueued + self.delay
        return opens if self.early else max(opens, self._held_until())

    def _pop_batch(self) -> list[E]:
        target = self.rule.size(self._items)
        if self._fits and self._running and self._items < target:
            target = max((f for f in self._fits if f <= self._items), default=target)
        batch = self._pop_rows(target)
        if not batch and self._q:  # never starve a request that alone exceeds a preferred size
            batch.append(self._q.popleft())
            self._items -= batch[0].rows
        self._running += 1
        return batch

    def _drop_expired(self, now: float) -> list[E]:
        if not self._q or min(e.deadline for e in self._q) > now:
            return []
        expired = [e for e in self._q if e.deadline <= now]
        self._q = deque(e for e in self._q if e.deadline > now)
        self._items -= sum(e.rows for e in expired)
        return expired
