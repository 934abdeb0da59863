"""Questions to the broker over its control socket (HEALTH, STATS, HELLO): ``ask_broker`` asks a running broker
once (the operations side, the front-ends); ``PatientAsk`` waits for one that is starting or restarting (the
CLI's ``--wait``). One ZeroMQ context per process, made at first use."""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path

import msgspec
import zmq
from zmq.utils import monitor as zmq_monitor

from shmbroker.broker.common import protocol as P
from shmbroker.broker.common import runtime

_ctx: zmq.Context[zmq.Socket[bytes]] | None = None
_ctx_pid = 0
_ctx_lock = threading.Lock()
ANSWER_GRACE_S = 2.0  # after a deadline, for the answer a broker gives at it (a HEALTH wait ends there)
RECONNECT_MS = (20, 250)  # ZeroMQ's reconnect back-off while no broker listens: the first pause, the longest
RESEND_S = 0.02  # a question that found no attached pipe just after the handshake event is sent again this late


def _context() -> zmq.Context[zmq.Socket[bytes]]:
    """The process's context for questions: a context costs an IO thread, so one serves every question; a
    forked child makes its own (a context does not survive fork)."""
    global _ctx, _ctx_pid
    with _ctx_lock:
        if _ctx is None or _ctx.closed or _ctx_pid != os.getpid():
            _ctx, _ctx_pid = zmq.Context(), os.getpid()
        return _ctx


def ask_broker(runtime_dir: Path, msg: msgspec.Struct, timeout: float) -> msgspec.Struct | None:
    """One request to the broker's control socket; None when nothing answers within ``timeout``.

    Thread-safe: each question has its own socket, closed before it returns.
    """
    sock = _context().socket(zmq.DEALER)
    try:
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(runtime.endpoint(runtime_dir, runtime.CONTROL_SOCKET))
        sock.send_multipart(P.encode(msg))
        if not sock.poll(int(timeout * 1000)):
            return None
        return P.decode(sock.recv_multipart())
    finally:
        sock.close(linger=0)


class NoAnswer(Exception):
    """No broker answered a ``PatientAsk`` question by its deadline; the message says what was seen last.
    ``connected``: a broker held the connection at the deadline (it was asked and did not answer)."""

    def __init__(self, reason: str, connected: bool) -> None:
        super().__init__(reason)
        self.connected = connected


class PatientAsk:
    """Questions to the broker that wait for one that is starting or restarting, until a deadline.

    A question goes out on each connection that completes its handshake: a connection that drops took its
    question with it (the broker stopped, or restarts). While no broker listens, ZeroMQ's reconnect back-off
    paces the tries (``RECONNECT_MS``); the thread sleeps in poll on the socket and its monitor. One owner
    thread; ``close`` (or ``with``) releases the socket and the context of its own (``close`` waits for what
    was sent, up to its ``linger_s``, which the shared context's sockets could not).
    """

    def __init__(self, runtime_dir: Path) -> None:
        self.path = runtime_dir / runtime.CONTROL_SOCKET
        self.up = False  # a connection to a broker is up: a question can go out
        self.dropped = 0  # connections that closed under us
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.IMMEDIATE, 1)  # a question goes to a live connection only, never queued for one
        self._sock.setsockopt(zmq.RECONNECT_IVL, RECONNECT_MS[0])
        self._sock.setsockopt(zmq.RECONNECT_IVL_MAX, RECONNECT_MS[1])
        self._monitor = self._sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED)
        try:
            self._sock.connect(runtime.endpoint(runtime_dir, runtime.CONTROL_SOCKET))
        except zmq.ZMQError as exc:  # a path over sun_path's limit, say: no broker could listen there
            self.close()
            raise NoAnswer(f"cannot connect to {self.path}: {exc.strerror}", False) from None

    def __enter__(self) -> PatientAsk:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    def close(self, linger_s: float = 0.0) -> None:
        """Close the connection, after what was sent left (at most ``linger_s``)."""
        if not self._ctx.closed:
            self._sock.disable_monitor()
            self._monitor.close(linger=0)
            self._ctx.destroy(linger=int(linger_s * 1000))

    def send(self, msg: msgspec.Struct) -> bool:
        """Send ``msg`` on the live connection, if one is up (a BYE, say); False when none is."""
        try:
            self._sock.send_multipart(P.encode(msg), zmq.NOBLOCK)
        except zmq.Again:
            return False
        return True

    def ask(self, question: Callable[[float], msgspec.Struct], deadline: float,
            again: Callable[[msgspec.Struct], bool] = lambda _reply: False) -> msgspec.Struct:
        """The first answer to ``question(seconds left until deadline)``, a ``time.monotonic()`` stamp.

        Asked anew on each new connection, and after an answer that ``again`` accepts (the broker's "not
        yet") while time is left. NoAnswer at ``deadline``, or ``ANSWER_GRACE_S`` later while a question is
        out on a live connection (the broker answers a HEALTH wait at its end).
        """
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._monitor, zmq.POLLIN)
        out = False  # a question waits for its answer on the live connection
        send_at = 0.0
        while True:
            now = time.monotonic()
            if self.up and not out and now >= send_at:
                out = self.send(question(max(0.0, deadline - now)))
                send_at = 0.0 if out else now + RESEND_S  # the pipe attaches just after the handshake event
            end = deadline + (ANSWER_GRACE_S if out else 0.0)
            if now >= end:
                raise NoAnswer(self._why(out), self.up)
            wake = min(end, send_at) if send_at else end
            events = dict(poller.poll(max(1, int((wake - now) * 1000) + 1)))
            if self._sock in events:
                reply = P.decode(self._sock.recv_multipart())
                if not (again(reply) and time.monotonic() < deadline):
                    return reply
                out = False
            if self._monitor in events and self._connection_events():
                out = False  # its connection dropped: the question went with it

    def _connection_events(self) -> bool:
        """Consume the monitor's events; True when a connection dropped."""
        dropped = False
        while True:
            try:
                event = zmq_monitor.recv_monitor_message(self._monitor, zmq.NOBLOCK)["event"]
            except zmq.Again:
                return dropped
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self.up = True
            elif event == zmq.EVENT_DISCONNECTED:
                self.up = False
                self.dropped += 1
                dropped = True

    def _why(self, asked: bool) -> str:
        """What was seen last, in words: the question unanswered, or why no connection is up."""
        if asked:
            return f"a broker accepted the connection on {self.path} and did not answer"
        left = " (a broker was connected and went away: stopped or restarting)" if self.dropped else ""
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(str(self.path))
        except FileNotFoundError:
            return f"{self.path} does not exist{left}"
        except ConnectionRefusedError:
            return f"{self.path} refuses connections: the broker that bound it has exited{left}"
        except PermissionError:
            return f"{self.path}: permission denied: this user may not connect (the broker's group: broker.group)"
        except OSError as exc:
            return f"{self.path}: {exc.strerror}{left}"
        finally:
            probe.close()
        return f"{self.path} accepts connections but ZeroMQ's handshake did not complete{left}"
