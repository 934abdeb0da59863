"""The send side of a Client: its links to the workers, the choice among them, and SUBMITs sent together.

Flat combining: a submitter appends its record to the link's queue and, if it gets the link's send lock without
waiting, sends everything queued as one SUBMIT; one that finds the lock taken leaves its record to the holder
(docs/ARCHITECTURE.md, "Latency mechanisms"; bench/RESULTS.md#first-full-runs).
"""

from __future__ import annotations

import collections
import threading
import time

import zmq

from shmbroker.broker.common import protocol as P
from shmbroker.broker.common.protocol import SUBMIT_ENVELOPE
from shmbroker.client.session import ModelPlan


class Cork(threading.local):
    """Per thread, a context manager that nests: inside it (``on``), that thread's SUBMITs are queued, not sent."""

    on = False
    depth = 0

    def __enter__(self) -> None:
        self.depth += 1
        self.on = True

    def __exit__(self, *exc: object) -> None:
        self.depth -= 1
        self.on = self.depth > 0


class Link:
    """The client's two sockets to one worker: SUBMITs out (PUSH), DONEs in (PULL).

    Invariant: ``push`` is used only under ``send_lock``; ``pull`` only by the receive role's holder (client.lead).
    """

    def __init__(self, ctx: zmq.Context[zmq.Socket[bytes]], info: P.WorkerInfo) -> None:
        self.info = info
        self.worker_id = info.worker_id
        self.models = set(info.models)
        # requests sent on this link and not yet answered: a routing hint for the least-outstanding choice,
        # approximate by design (sending threads add and the receiving thread subtracts without a lock; a
        # lost update only skews one choice, never a request)
        self.outstanding = 0
        self.up = False
        self.send_lock = threading.Lock()
        self.queue: collections.deque[P.SubmitRecord] = collections.deque()
        self.pull = ctx.socket(zmq.PULL)
        self.pull.setsockopt(zmq.LINGER, 0)
        self.pull.setsockopt(zmq.RCVHWM, 0)
        self.lost = False  # the reply connection closed after it was up: the worker no longer serves us
        self.monitor = self.pull.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED)
        self.pull.connect(info.reply_endpoint)
        # "is a DONE waiting?" asked once per message: a Poller built once is the cheapest way (Socket.poll
        # builds one per call, and get(EVENTS) costs about twice as much)
        self.pull_ready = zmq.Poller()
        self.pull_ready.register(self.pull, zmq.POLLIN)
        self.push = ctx.socket(zmq.PUSH)
        self.push.setsockopt(zmq.LINGER, 0)
        self.push.setsockopt(zmq.SNDHWM, 0)  # the ring's slots bound what is in flight
        self.push.connect(info.endpoint)

    def handshake_done(self) -> bool:
        """Consume monitor events; True while the reply connection is up (DONEs can reach us).

        A disconnect after the connection was up sets ``lost``: a worker closes a session's reply socket only
        once it has stopped serving it (it shut down, or its process ended, as it does when the broker dies),
        so no DONE and no write into the ring can follow.
        """
        while True:
            try:
                frames = self.monitor.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return self.up
            event = P.ZMQ_MONITOR_EVENT.unpack_from(frames[0])[0] if frames and len(frames[0]) >= 2 else 0
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED and not self.lost:
                self.up = True
            elif event == zmq.EVENT_DISCONNECTED and self.up:
                self.up = False
                self.lost = True

    def close(self) -> None:
        with self.send_lock:
            self.up = False
            self.push.close(0)
        self.pull.disable_monitor()
        self.monitor.close(0)
        self.pull.close(0)


class Links:
    """The session's links by worker id, and where its SUBMITs go.

    Invariant: ``current`` is replaced whole, under ``lock``, whenever a link comes or goes, so a reader takes
    it without the lock; ``changed`` tells the IO thread to rebuild its pollers. The session id and token go
    into every SUBMIT and change only with the session (``replace``).
    """

    def __init__(self, ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
        self._ctx = ctx
        self.session_id = 0
        self.token = 0
        self.lock = threading.Lock()
        self._by_id: dict[int, Link] = {}
        self.current: tuple[Link, ...] = ()
        self.changed = True
        self.cork = Cork()  # this thread's SUBMITs are queued while it is inside
        self._turn = 0  # where choose() starts its scan

    def get(self, worker_id: int) -> Link | None:
        return self._by_id.get(worker_id)

    def add(self, info: P.WorkerInfo) -> Link:
        link = Link(self._ctx, info)
        with self.lock:
            self._by_id[info.worker_id] = link
            self._updated()
        return link

    def pop(self, worker_id: int) -> Link | None:
        with self.lock:
            link = self._by_id.pop(worker_id, None)
            self._updated()
        return link

    def replace(self, workers: list[P.WorkerInfo], session_id: int, token: int) -> list[Link]:
        """A new session's links (none after the broker's loss); returns the old ones, for the caller to close."""
        with self.lock:
            old = list(self._by_id.values())
            self._by_id = {info.worker_id: Link(self._ctx, info) for info in workers}
            self.session_id, self.token = session_id, token
            self._updated()
        return old

    def _updated(self) -> None:
        self.current = tuple(self._by_id.values())
        self.changed = True

    def wait_up(self, timeout: float) -> None:
        """Wait up to ``timeout`` s for every link's reply connection (a request before it would be refused)."""
        end = time.monotonic() + timeout
        for link in self.current:
            while not link.handshake_done():
                left = end - time.monotonic()
                if left <= 0 or not link.monitor.poll(int(left * 1000)):
                    break

    def choose(self, plan: ModelPlan) -> Link | None:
        """The least-outstanding live worker that serves the model; ties go round robin."""
        links = self.current
        n = len(links)
        if n == 1:  # one worker: nothing to choose
            link = links[0]
            return link if link.up and plan.info.name in link.models else None
        # Always starting the scan at the first link would hand every tie to worker 0, and ties are the
        # common case at low load: the load would lean on it.
        self._turn = start = (self._turn + 1) % n if n else 0
        best = None
        for k in range(n):
            link = links[(start + k) % n]
            if link.up and plan.info.name in link.models and (best is None or link.outstanding < best.outstanding):
                best = link
        return best

    def send(self, link: Link, record: P.SubmitRecord, defer: bool) -> None:
        """Queue ``record`` on ``link`` and, unless ``defer`` or this thread is corked, send what is queued."""
        link.queue.append(record)
        if not (defer or self.cork.on):
            self.flush(link)

    def flush(self, link: Link) -> None:
        """Send everything queued on ``link`` as one SUBMIT, unless another thread is sending (it takes ours)."""
        while link.queue:
            if not link.send_lock.acquire(blocking=False):
                return
            try:
                body = P.drain_submit(self.session_id, self.token, link.queue)
                if body is not None and link.up:
                    link.push.send_multipart([SUBMIT_ENVELOPE, body])
            finally:
                link.send_lock.release()

    def flush_all(self) -> None:
        for link in self.current:
            self.flush(link)

    def queued(self) -> bool:
        return any(link.queue for link in self.current)

    def close_all(self) -> None:
        for link in self.current:
            link.close()
