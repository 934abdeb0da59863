"""The systemd notify protocol (sd_notify(3)): READY, WATCHDOG, STOPPING and STATUS datagrams.

systemd passes ``NOTIFY_SOCKET`` (a path, or ``@name`` for the abstract namespace) and, with ``WatchdogSec=``,
``WATCHDOG_USEC`` (and ``WATCHDOG_PID``). Outside systemd none is set and every call here does nothing.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import MutableMapping

log = logging.getLogger(__name__)

ENV_KEYS = ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID")


class Notifier:
    """Sends sd_notify datagrams; a send error is logged once and never raised (systemd may be gone).

    ``watchdog_interval`` is half of ``WATCHDOG_USEC`` (systemd's advice), or None when no watchdog is asked
    for this process. ``from_env`` removes the variables from the environment, so the worker processes the
    broker starts do not inherit them and cannot ping for it.
    """

    def __init__(self, address: str = "", watchdog_usec: int = 0) -> None:
        self.address = address
        self.watchdog_interval = watchdog_usec / 2e6 if watchdog_usec > 0 else None
        self._sock: socket.socket | None = None
        self._next_ping = 0.0
        self._warned = False
        if address:
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)

    @classmethod
    def from_env(cls, env: MutableMapping[str, str] | None = None, unset: bool = True) -> Notifier:
        environ = os.environ if env is None else env
        address = environ.get("NOTIFY_SOCKET", "")
        watchdog = _watchdog_usec(environ)
        if unset:
            for key in ENV_KEYS:
                environ.pop(key, None)
        return cls(address, watchdog)

    @property
    def enabled(self) -> bool:
        return self._sock is not None

    def send(self, *fields: str) -> None:
        """One datagram of ``KEY=VALUE`` lines."""
        if self._sock is None:
            return
        target = "\0" + self.address[1:] if self.address.startswith("@") else self.address
        try:
            self._sock.sendto("\n".join(fields).encode(), target)
        except OSError as exc:
            if not self._warned:
                log.warning("cannot notify systemd on %s: %s", self.address, exc)
                self._warned = True

    def ready(self, status: str) -> None:
        self.send("READY=1", f"STATUS={status}")

    def status(self, status: str) -> None:
        self.send(f"STATUS={status}")

    def extend(self, seconds: float) -> None:
        """Ask for ``seconds`` more of the start (EXTEND_TIMEOUT_USEC): a start that makes progress may outlast
        the unit's TimeoutStartSec."""
        self.send(f"EXTEND_TIMEOUT_USEC={int(seconds * 1e6)}")

    def stopping(self, status: str = "stopping") -> None:
        self.send("STOPPING=1", f"STATUS={status}")

    def ping(self, now: float | None = None) -> None:
        """WATCHDOG=1 when half the watchdog period has passed since the last one; cheap to call every turn."""
        if self.watchdog_interval is None:
            return
        t = time.monotonic() if now is None else now
        if t >= self._next_ping:
            self._next_ping = t + self.watchdog_interval
            self.send("WATCHDOG=1")

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None


def _watchdog_usec(env: MutableMapping[str, str]) -> int:
    """WATCHDOG_USEC when it is meant for this process (WATCHDOG_PID unset or ours), else 0."""
    raw, pid = env.get("WATCHDOG_USEC", ""), env.get("WATCHDOG_PID", "")
    if not raw:
        return 0
    try:
        usec = int(raw)
        if pid and int(pid) != os.getpid():
            return 0
    except ValueError:
        log.warning("ignoring malformed WATCHDOG_USEC=%r / WATCHDOG_PID=%r", raw, pid)
        return 0
    return max(usec, 0)
