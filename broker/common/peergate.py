"""Who may connect to a ZeroMQ ipc socket, decided by the kernel's word on the peer's uid, and how often.

A ``PeerGate`` is the ZAP handler of one ``zmq.Context`` (ZeroMQ asks it at every new connection to a socket
that has a ZAP domain, before any message passes). It admits a connection to the socket of domain ``d`` only
from the uids ``allow(d, ...)`` named (or from any uid that can open the socket file); libzmq gives the peer's
uid from SO_PEERCRED, so it cannot be claimed falsely. Sockets without a domain are not asked about. Costs
nothing per message.

Each uid's connections are paced: a uid may open ``burst`` at once and ``per_s`` a second after that; the
gate answers a connection past its uid's pace only when the uid's next turn comes, and meanwhile the
connection waits in its handshake, costing no thread any work. A peer that makes ZeroMQ drop and re-accept
its connection in a loop (frames over ZMQ_MAXMSGSIZE, say) or opens connections in a loop thus costs the
socket's IO thread one accept and handshake per turn of its uid, whatever its rate.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
import weakref
from dataclasses import dataclass, field

import zmq

from shmbroker.broker.common.handout import peer_of_address
from shmbroker.broker.common.ratelog import RateLimitedLog

log = logging.getLogger(__name__)

ZAP_ENDPOINT = "inproc://zeromq.zap.01"  # fixed by the ZAP specification (RFC 27)
_STOP_ENDPOINT = "inproc://shmb-peergate-stop-{}"
CONNECTS_PER_S = 100.0  # a uid's connections a second past its burst: far above any client's session churn
WAIT_MAX = 64  # connections of one uid that wait for their turn; past these, one is never answered
WAIT_S = 30.0  # libzmq's handshake timeout (ZMQ_HANDSHAKE_IVL): it has closed a connection that waited longer


@dataclass
class _Pace:
    """One uid's token bucket and the ZAP requests waiting for a token, oldest first."""

    tokens: float
    at: float
    waiting: collections.deque[tuple[float, list[bytes]]] = field(default_factory=collections.deque)

    def refill(self, now: float, burst: int, per_s: float) -> None:
        self.tokens = min(float(burst), self.tokens + (now - self.at) * per_s)
        self.at = now


class PeerGate:
    """The context's ZAP handler, on a thread of its own that owns the ZAP socket. ``close()`` stops it.

    ``burst`` and ``per_s``: each uid's connections admitted at once, and a second after that."""

    def __init__(self, ctx: zmq.Context[zmq.Socket[bytes]], burst: int = 64, per_s: float = CONNECTS_PER_S) -> None:
        # ZAP domain -> uids (None: any uid); replaced whole, read by the thread
        self._allowed: dict[bytes, frozenset[int] | None] = {}
        self._burst, self._per_s = burst, per_s
        self._paces: dict[int, _Pace] = {}  # uid -> its pace; the gate thread's own
        self._refused = RateLimitedLog(log)
        self._paced = RateLimitedLog(log)
        self._ctx = ctx
        stop_at = _STOP_ENDPOINT.format(id(self))
        self._stop = ctx.socket(zmq.PAIR)  # owned by the thread that calls close()
        self._stop.setsockopt(zmq.LINGER, 0)
        self._stop.bind(stop_at)
        ready = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(stop_at, ready), name="shmb-peergate", daemon=True)
        self._thread.start()
        ready.wait()  # the ZAP socket is bound before any socket of this context asks it
        self._finalizer = weakref.finalize(self, self._stop.close, 0)

    def allow(self, domain: str, uids: frozenset[int] | None) -> None:
        """Admit connections to sockets of ``domain`` from ``uids`` only, or from any uid for None (set the
        socket's ZAP_DOMAIN to it)."""
        self._allowed = {**self._allowed, domain.encode(): uids}

    def forget(self, domain: str) -> None:
        allowed = dict(self._allowed)
        allowed.pop(domain.encode(), None)
        self._allowed = allowed

    def close(self) -> None:
        if self._thread.is_alive():
            self._stop.send(b"")
            self._thread.join()
        self._finalizer()

    def _run(self, stop_at: str, ready: threading.Event) -> None:
        # a ROUTER, not a REP: a request past its uid's pace is answered later, after requests that came since
        zap = self._ctx.socket(zmq.ROUTER)  # owned by this thread
        stop = self._ctx.socket(zmq.PAIR)
        try:
            zap.setsockopt(zmq.LINGER, 0)
            stop.setsockopt(zmq.LINGER, 0)
            zap.bind(ZAP_ENDPOINT)
            stop.connect(stop_at)
            ready.set()
            poller = zmq.Poller()
            poller.register(zap, zmq.POLLIN)
            poller.register(stop, zmq.POLLIN)
            while True:
                events = dict(poller.poll(self._next_turn_ms()))
                if stop in events:
                    return
                now = time.monotonic()
                if zap in events:
                    self._take(zap, zap.recv_multipart(), now)
                self._answer_due(zap, now)
        except zmq.ContextTerminated:
            log.debug("peer gate: context terminated")
        finally:
            ready.set()
            zap.close(0)
            stop.close(0)

    def _take(self, zap: zmq.Socket[bytes], request: list[bytes], now: float) -> None:
        """Answer a ZAP request now if its uid is within its pace, else queue it for the uid's next turn."""
        peer = peer_of_address(request[5].decode(errors="replace")) if len(request) >= 8 else None
        if peer is None:
            zap.send_multipart(self._reply(request))
            return
        pace = self._paces.get(peer.uid)
        if pace is None:
            pace = self._paces[peer.uid] = _Pace(float(self._burst), now)
        pace.refill(now, self._burst, self._per_s)
        if not pace.waiting and pace.tokens >= 1:
            pace.tokens -= 1
            zap.send_multipart(self._reply(request))
            return
        self._paced.warning("peer gate: uid %d (pid %d) opens connections faster than %g/s: they wait their turn",
                            peer.uid, peer.pid, self._per_s)
        if len(pace.waiting) < WAIT_MAX:
            pace.waiting.append((now, request))
        # else: never answered; libzmq closes the connection at its handshake timeout, and no thread works on it

    def _answer_due(self, zap: zmq.Socket[bytes], now: float) -> None:
        """Answer waiting requests whose uid's turn has come; forget those libzmq has closed meanwhile."""
        for uid, pace in list(self._paces.items()):
            pace.refill(now, self._burst, self._per_s)
            while pace.waiting and pace.tokens >= 1:
                came, request = pace.waiting.popleft()
                if now - came < WAIT_S:
                    pace.tokens -= 1
                    zap.send_multipart(self._reply(request))
            if not pace.waiting and pace.tokens >= self._burst:
                del self._paces[uid]  # back to a full burst: nothing to remember

    def _next_turn_ms(self) -> int | None:
        """Milliseconds until the earliest waiting uid gets a token; None when nobody waits."""
        waits = [(1 - p.tokens) / self._per_s for p in self._paces.values() if p.waiting]
        return None if not waits else max(1, int(min(waits) * 1000) + 1)

    def _reply(self, request: list[bytes]) -> list[bytes]:
        """A ZAP reply for a ROUTER request (routing id, empty delimiter, then RFC 27's frames): 200 for an
        allowed uid, 400 otherwise."""
        if len(request) < 8:
            return [*request[:2], b"1.0", b"", b"500", b"malformed ZAP request", b"", b""]
        route, version, request_id, domain, address = request[:2], request[2], request[3], request[4], request[5]
        peer = peer_of_address(address.decode(errors="replace"))
        known = domain in self._allowed
        uids = self._allowed.get(domain)
        if not known or peer is None or (uids is not None and peer.uid not in uids):
            self._refused.warning("refused a connection from %s to a socket of %s", peer or "an unknown peer",
                                  domain.decode(errors="replace"))
            return [*route, version, request_id, b"400", b"not this socket's user", b"", b""]
        return [*route, version, request_id, b"200", b"OK", str(peer.uid).encode(), b""]
