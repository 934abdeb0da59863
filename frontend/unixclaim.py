"""A claim on a Unix socket's path, as Wayland claims its display socket: an flock on a lock file beside the
socket, taken before the bind and held until after the socket file is removed.

Two servers starting at once cannot both take the path, and the kernel drops a dead server's lock, so its
stale socket file never blocks the next one. The lock file is never removed: a new file of the same name
would let a second server lock it while the first still held the old one.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Callable
from pathlib import Path


class UnixClaim:
    """The hold on ``path`` through ``lock``; ``refused(holder_pid)`` is raised when a live server holds it.

    Raises:
        OSError: the lock file cannot be opened (FileNotFoundError: its directory is missing).
    """

    def __init__(self, path: Path, lock: Path, refused: Callable[[str], BaseException], mode: int = 0o600) -> None:
        self.path = path
        self._bound: tuple[int, int] | None = None  # (st_dev, st_ino) of the file our bind created
        self._fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, mode)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(self._fd, 32, 0).decode(errors="replace").strip() or "?"
            os.close(self._fd)
            raise refused(holder) from None
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, f"{os.getpid()}\n".encode(), 0)  # for the message of a server refused later

    def bound(self) -> None:
        """Record the socket file that our bind just created."""
        st = self.path.stat()
        self._bound = (st.st_dev, st.st_ino)

    def release(self) -> None:
        """Remove our socket file if it is still ours (never another's put there since), then drop the lock."""
        with contextlib.suppress(FileNotFoundError):
            st = self.path.stat()
            if (st.st_dev, st.st_ino) == self._bound:
                self.path.unlink()
        os.close(self._fd)
