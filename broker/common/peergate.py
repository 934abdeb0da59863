"""Who may connect to a ZeroMQ ipc socket, decided by the kernel's word on the peer's uid.

A ``PeerGate`` is the ZAP handler of one ``zmq.Context`` (ZeroMQ asks it at every new connection to a socket
that has a ZAP domain, before any message passes). It admits a connection to the socket of domain ``d`` only
from the uids ``allow(d, ...)`` named; libzmq gives the peer's uid from SO_PEERCRED, so it cannot be claimed
falsely. Sockets without a domain are not asked about. Costs nothing per message.
"""

from __future__ import annotations

import logging
import threading
import weakref

import zmq

from shmbroker.broker.common.handout import peer_of_address

log = logging.getLogger(__name__)

ZAP_ENDPOINT = "inproc://zeromq.zap.01"  # fixed by the ZAP specification (RFC 27)
_STOP_ENDPOINT = "inproc://shmb-peergate-stop-{}"


class PeerGate:
    """The context's ZAP handler, on a thread of its own that owns the ZAP socket. ``close()`` stops it."""

    def __init__(self, ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
        self._allowed: dict[bytes, frozenset[int]] = {}  # ZAP domain -> uids; replaced whole, read by the thread
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

    def allow(self, domain: str, uids: frozenset[int]) -> None:
        """Admit connections to sockets of ``domain`` from ``uids`` only (set the socket's ZAP_DOMAIN to it)."""
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
        zap = self._ctx.socket(zmq.REP)  # owned by this thread
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
            while stop not in dict(poller.poll()):
                zap.send_multipart(self._answer(zap.recv_multipart()))
        except zmq.ContextTerminated:
            log.debug("peer gate: context terminated")
        finally:
            ready.set()
            zap.close(0)
            stop.close(0)

    def _answer(self, request: list[bytes]) -> list[bytes]:
        """A ZAP reply: 200 for an allowed uid, 400 otherwise (RFC 27's frames)."""
        if len(request) < 6:
            return [b"1.0", b"", b"500", b"malformed ZAP request", b"", b""]
        version, request_id, domain, address = request[:4]
        uids = self._allowed.get(domain)
        peer = peer_of_address(address.decode(errors="replace"))
        if uids is None or peer is None or peer.uid not in uids:
            log.warning("refused a connection from %s to a socket of %s", peer or "an unknown peer",
                        domain.decode(errors="replace"))
            return [version, request_id, b"400", b"not this socket's user", b"", b""]
        return [version, request_id, b"200", b"OK", str(peer.uid).encode(), b""]
