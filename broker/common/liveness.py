"""Client liveness by a lock the kernel releases: works across pid namespaces, unlike a pid check.

Contract (docs/PROTOCOL.md §3.1): a client takes a *shared* ``flock`` on its own descriptor of the
session's segment before it sends ATTACHED, and keeps it until it is done with the session. The kernel
drops the lock when the last descriptor of that open file goes, that is when the client process dies
(SIGKILL included) or closes the segment. The broker tests it with a non-blocking *exclusive* lock on
its own descriptor of the same segment: refused means a client still holds it.

A client that takes no lock (a minimal client) is checked by the pid the kernel reported for its HELLO
(SO_PEERCRED) instead, which works only when it shares the broker's pid namespace; one the kernel reported as
pid 0 (another namespace) must take the lock. The broker decides which, once, at ATTACHED.
"""

from __future__ import annotations

import fcntl

import psutil

from shmbroker.broker.common.ring import Segment


def hold(segment: Segment) -> None:
    """Client side: hold the session's liveness lock for as long as ``segment`` stays open.

    Blocking, because the broker's probe may hold the exclusive lock for a moment; it never holds it longer.
    """
    fcntl.flock(segment.fd, fcntl.LOCK_SH)


def lock_held(segment: Segment) -> bool:
    """Broker side: True while some process holds the shared lock on ``segment`` (its client lives)."""
    try:
        fcntl.flock(segment.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    fcntl.flock(segment.fd, fcntl.LOCK_UN)  # at once: a client still handshaking must get its shared lock
    return False


def client_alive(segment: Segment, pid: int, by_lock: bool) -> bool:
    """The broker's periodic check: the lock for clients that took it at ATTACHED, else the kernel's pid."""
    return lock_held(segment) if by_lock else psutil.pid_exists(pid)
