"""One question to a running broker over its control socket (HEALTH, STATS): for the CLI, the operations side
(metrics, status, the systemd loop) and the front-ends. One ZeroMQ context per process, made at first use."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import msgspec
import zmq

from shmbroker.broker.common import protocol as P
from shmbroker.broker.common import runtime

_ctx: zmq.Context[zmq.Socket[bytes]] | None = None
_ctx_pid = 0
_ctx_lock = threading.Lock()


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
