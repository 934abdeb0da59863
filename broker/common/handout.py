"""The ring handout: a session's client and workers get its segment's descriptor over a Unix socket.

One SOCK_SEQPACKET exchange on ``rings.sock`` (docs/PROTOCOL.md §3.2): the peer sends RING_REQUEST (session
id and token); the broker answers RING_GRANT, with the descriptor in SCM_RIGHTS when the status is OK. The
kernel says who connected (SO_PEERCRED): only the uid of the session's client and the broker's own uid (its
workers) get the ring, so another user who learned a token still cannot map it. Segments have no name
anywhere, so there is no other way in.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import zmq

from shmbroker.broker.common import protocol as P
from shmbroker.broker.common import runtime
from shmbroker.broker.common.ring import Segment

log = logging.getLogger(__name__)

# Connections accepted whose request has not come yet. A peer sends its request right after connecting, so a
# silent one is closed after FIRST_BYTES_S; a uid keeps at most MAX_PENDING_PER_UID (its oldest goes first), so
# one user's silent connections never displace another's, and MAX_PENDING bounds the broker's descriptors.
FIRST_BYTES_S = 1.0
MAX_PENDING_PER_UID = 16
MAX_PENDING = 1024
ACCEPT_BATCH = 1024  # connections taken from the backlog per readiness report, so a flood cannot fill it


class HandoutError(ConnectionError):
    """The broker did not hand over the ring; the text names the reason and what to check."""


@dataclass(frozen=True)
class Peer:
    """A connected process as the kernel saw it at connect time (pid 0: in a pid namespace we cannot see)."""

    pid: int
    uid: int
    gid: int


def peer_of(sock: socket.socket) -> Peer:
    """SO_PEERCRED of a connected Unix socket."""
    pid, uid, gid = P.UCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, P.UCRED.size))
    return Peer(pid, uid, gid)


def peer_of_frame(frame: zmq.Frame) -> Peer | None:
    """The sender of a ZeroMQ message received over ipc, from its ``Peer-Address`` property
    (``host:uid:gid:pid``, which libzmq fills in from SO_PEERCRED); None when it is missing."""
    try:
        return peer_of_address(str(frame.get("Peer-Address")))
    except zmq.ZMQError:
        return None


def peer_of_address(address: str) -> Peer | None:
    """A peer from libzmq's ipc address form ``host:uid:gid:pid``; None when it is not in that form."""
    parts = address.rsplit(":", 3)
    if len(parts) != 4 or not all(p.isdigit() for p in parts[1:]):
        return None
    return Peer(pid=int(parts[3]), uid=int(parts[1]), gid=int(parts[2]))


@dataclass(frozen=True)
class Grantable:
    """What the handout needs of a live session: its ring and the uid of its client."""

    segment: Segment
    client_uid: int


class RingHandout:
    """The broker's end, served from the broker's loop without blocking it: poll ``fds()``, call
    ``on_readable`` for a ready one and ``expire`` each turn. ``lookup(session_id, token)`` finds a live
    session, or None."""

    def __init__(self, path: Path, mode: int, gid: int | None, lookup: Callable[[int, int], Grantable | None],
                 timeout_s: float) -> None:
        self._lookup = lookup
        self._timeout_s = timeout_s
        self._pending: dict[int, tuple[socket.socket, float, int]] = {}  # fd -> (connection, deadline, uid)
        self._of_uid: dict[int, dict[int, None]] = {}  # uid -> its pending fds, oldest first
        with contextlib.suppress(FileNotFoundError):
            path.unlink()  # a dead broker's; the instance lock says no live one uses it
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        self._listener.bind(str(path))
        os.chmod(path, mode)
        if gid is not None:
            os.chown(path, -1, gid)
        self._listener.listen(socket.SOMAXCONN)  # the kernel caps it at net.core.somaxconn
        self._listener.setblocking(False)
        self.path = path

    def fds(self) -> list[int]:
        """The listening socket and every connection still waiting for its request."""
        return [self._listener.fileno(), *self._pending]

    def on_readable(self, fd: int, now: float) -> None:
        if fd == self._listener.fileno():
            self._accept(now)
            return
        entry = self._pending.get(fd)
        if entry is not None:
            self._serve_if_sent(entry[0])

    def expire(self, now: float) -> None:
        """Close connections that sent no request within FIRST_BYTES_S (or the handshake timeout, if shorter)."""
        while self._pending:
            fd, (_conn, deadline, _uid) = next(iter(self._pending.items()))
            if now <= deadline:  # in accept order, so in deadline order: the rest are younger
                return
            self._drop(fd)

    def close(self) -> None:
        for conn, _deadline, _uid in self._pending.values():
            conn.close()
        self._pending.clear()
        self._of_uid.clear()
        self._listener.close()
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()

    def _accept(self, now: float) -> None:
        deadline = now + min(FIRST_BYTES_S, self._timeout_s)
        for _ in range(ACCEPT_BATCH):
            try:
                conn, _addr = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # EMFILE: the connection stays in the backlog until fds free up
                log.warning("ring handout: cannot accept (%s)", exc.strerror)
                return
            conn.setblocking(False)
            uid = peer_of(conn).uid
            fd = conn.fileno()
            self._pending[fd] = (conn, deadline, uid)
            self._of_uid.setdefault(uid, {})[fd] = None
            if self._serve_if_sent(conn):
                continue
            if len(self._of_uid[uid]) > MAX_PENDING_PER_UID:
                self._drop(next(iter(self._of_uid[uid])))
            if len(self._pending) > MAX_PENDING:  # the uid with the most waiting loses its oldest
                busiest = max(self._of_uid, key=lambda u: len(self._of_uid[u]))
                self._drop(next(iter(self._of_uid[busiest])))

    def _drop(self, fd: int) -> None:
        """Close a pending connection unanswered (its peer sees the end of the stream and may ask again)."""
        self._take(fd).close()

    def _take(self, fd: int) -> socket.socket:
        """Remove a connection from the pending ones; returns it."""
        conn, _deadline, uid = self._pending.pop(fd)
        mine = self._of_uid[uid]
        del mine[fd]
        if not mine:
            del self._of_uid[uid]
        return conn

    def _serve_if_sent(self, conn: socket.socket) -> bool:
        """Answer the connection's request if it has come (it then leaves ``_pending``; True); else it waits
        there for the poller. A readiness report may be stale (the descriptor number reused within a turn):
        the non-blocking read tells."""
        try:
            data = conn.recv(P.RING_REQUEST.size + 1)
        except BlockingIOError:
            return False
        except OSError:
            data = b""
        self._answer(self._take(conn.fileno()), data)
        return True

    def _answer(self, conn: socket.socket, data: bytes) -> None:
        """RING_GRANT, with the descriptor when granted; then the connection closes."""
        with conn:
            try:
                status, segment = self._decide(data, peer_of(conn))
                reply = P.RING_GRANT.pack(P.MsgKind.RING_GRANT, status, segment.nbytes if segment else 0)
                if segment is None:
                    conn.send(reply)
                    return
                fd = segment.duplicate()
                try:
                    socket.send_fds(conn, [reply], [fd])
                finally:
                    os.close(fd)
            except OSError as exc:  # the peer went away meanwhile: nobody to answer
                log.info("ring handout: %s", exc.strerror or exc)

    def _decide(self, data: bytes, peer: Peer) -> tuple[P.GrantStatus, Segment | None]:
        if len(data) != P.RING_REQUEST.size:
            return P.GrantStatus.BAD_REQUEST, None
        kind, version, session_id, token = P.RING_REQUEST.unpack(data)
        if kind != P.MsgKind.RING_REQUEST or version != P.PROTOCOL_VERSION:
            return P.GrantStatus.BAD_REQUEST, None
        found = self._lookup(session_id, token)
        if found is None:
            return P.GrantStatus.NO_SESSION, None
        if peer.uid not in (found.client_uid, os.getuid()):
            log.warning("ring handout: uid %d (pid %d) asked for session %d of uid %d: refused", peer.uid, peer.pid,
                        session_id, found.client_uid)
            return P.GrantStatus.WRONG_USER, None
        return P.GrantStatus.OK, found.segment


_WHY = {
    P.GrantStatus.BAD_REQUEST: "it did not understand the request (a client of another protocol version?)",
    P.GrantStatus.NO_SESSION: "the session is gone or the token is wrong (it timed out: raise "
                              "broker.handshake_timeout_ms)",
    P.GrantStatus.WRONG_USER: "this process's user is not the session's",
}


def fetch_ring(runtime_dir: Path, session_id: int, token: int, timeout_s: float) -> int:
    """Ask the broker for a session's segment; returns the descriptor (the caller owns it).

    While the handout's backlog is full the connect waits in the kernel for room, and a connection the broker
    closed unanswered (it sheds silent ones under a flood) is asked again, all within ``timeout_s``. Raises
    HandoutError when the broker refuses, is not there, or does not answer in time."""
    path = runtime_dir / runtime.RINGS_SOCKET
    deadline = time.monotonic() + timeout_s
    while True:
        data, fds = _ask(path, session_id, token, deadline)
        if data:
            break
        if time.monotonic() >= deadline:  # closed unanswered each time: asked again while time was left
            raise _late(session_id, path, timeout_s)
    if len(data) != P.RING_GRANT.size or P.RING_GRANT.unpack(data)[0] != P.MsgKind.RING_GRANT:
        for fd in fds:
            os.close(fd)
        raise HandoutError(f"the broker's answer for session {session_id}'s ring is not a RING_GRANT")
    _kind, status, _nbytes = P.RING_GRANT.unpack(data)
    if status != P.GrantStatus.OK or len(fds) != 1:
        for fd in fds:
            os.close(fd)
        why = _WHY.get(P.GrantStatus(status), "") if status in iter(P.GrantStatus) else ""
        raise HandoutError(f"the broker refused session {session_id}'s ring: {why or f'status {status}'}")
    return fds[0]


def _ask(path: Path, session_id: int, token: int, deadline: float) -> tuple[bytes, list[int]]:
    """One exchange on a blocking socket whose send and receive timeouts are the time left (a full backlog
    makes connect wait for room up to the send timeout); returns the answer and its descriptors, or empty
    data when the broker closed the connection unanswered."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC) as s:
        try:
            _time_left(s, socket.SO_SNDTIMEO, deadline)
            s.connect(str(path))
            s.send(P.RING_REQUEST.pack(P.MsgKind.RING_REQUEST, P.PROTOCOL_VERSION, session_id, token))
            _time_left(s, socket.SO_RCVTIMEO, deadline)
            data, fds, _flags, _addr = socket.recv_fds(s, P.RING_GRANT.size, 1)
        except (BlockingIOError, TimeoutError, ConnectionResetError, BrokenPipeError):
            return b"", []  # the time left ran out (a full backlog, or no answer), or closed unanswered
        except OSError as exc:
            raise HandoutError(f"cannot ask the broker for session {session_id}'s ring at {path}: "
                               f"{exc.strerror or exc}") from None
    if not data:  # closed unanswered
        for fd in fds:
            os.close(fd)
        return b"", []
    return data, fds


def _late(session_id: int, path: Path, timeout_s: float) -> HandoutError:
    """The timeout's error, naming the setting to change."""
    return HandoutError(f"the broker did not hand over session {session_id}'s ring within {timeout_s:g} s (its "
                        f"handout at {path} is busy or stuck; raise broker.handshake_timeout_ms)")


def _time_left(s: socket.socket, option: int, deadline: float) -> None:
    """Set a send or receive timeout of the time left until ``deadline`` (at least 1 ms: 0 means none)."""
    left = max(deadline - time.monotonic(), 1e-3)
    s.setsockopt(socket.SOL_SOCKET, option, P.TIMEVAL.pack(int(left), int(left % 1 * 1e6)))
