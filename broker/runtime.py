"""The runtime directory (sockets, lock, instance id) and the names of what lives in it."""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)

ENV_VAR = "SHMBROKER_RUNTIME_DIR"
SYSTEM_DIR = Path("/run/shmbroker")
CONTROL_SOCKET = "broker.sock"
WORKERS_SOCKET = "workers.sock"
LOCK_FILE = "broker.lock"
INSTANCE_FILE = "broker.instance"


def resolve(configured: str = "", server: bool = False) -> Path:
    """SHMBROKER_RUNTIME_DIR if set; else the configured dir; else /run/shmbroker if usable; else per user.

    The client and the broker call this alike, so both find the same sockets without being told. The
    broker needs to write in /run/shmbroker; a client (of the broker's group, say) only to enter it.
    """
    env = os.environ.get(ENV_VAR, "")
    if env:
        return Path(env)
    if configured:
        return Path(configured)
    if SYSTEM_DIR.is_dir() and os.access(SYSTEM_DIR, (os.W_OK | os.X_OK) if server else os.X_OK):
        return SYSTEM_DIR
    xdg = os.environ.get("XDG_RUNTIME_DIR", "")
    if xdg and os.path.isdir(xdg) and os.access(xdg, os.W_OK):
        return Path(xdg) / "shmbroker"
    return Path(tempfile.gettempdir()) / f"shmbroker-{os.getuid()}"


def endpoint(runtime_dir: Path, name: str) -> str:
    return f"ipc://{runtime_dir / name}"


def worker_endpoint(runtime_dir: Path, worker_id: int) -> str:
    return endpoint(runtime_dir, f"worker-{worker_id}.sock")


def reply_socket_name(worker_id: int, session_id: int, nonce: str) -> str:
    return f"w{worker_id}-s{session_id}-{nonce}.sock"


def prepare(runtime_dir: Path, mode: int, gid: int | None) -> None:
    """Create the directory (0700, or 0750 + group) if it is missing."""
    dir_mode = 0o750 if gid is not None else 0o700
    runtime_dir.mkdir(parents=True, exist_ok=True, mode=dir_mode)
    st = runtime_dir.stat()
    if st.st_uid != os.getuid() or st.st_mode & 0o022:
        # someone else made it (a shared /tmp): their sockets could impersonate the broker
        raise RuntimeError(f"runtime directory {runtime_dir} is not owned by this user or is writable by others")
    if gid is not None:
        os.chown(runtime_dir, -1, gid)
        os.chmod(runtime_dir, dir_mode)


def secure_socket_file(address: str, mode: int, gid: int | None) -> None:
    """Set the mode (and group) of the file behind an ipc:// address that this process bound."""
    path = address.removeprefix("ipc://")
    os.chmod(path, mode)
    if gid is not None:
        os.chown(path, -1, gid)


def remove_socket_file(address: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(address.removeprefix("ipc://"))


class InstanceLock:
    """An flock on the runtime dir's lock file: held by the live broker, released by the kernel at its death."""

    def __init__(self, runtime_dir: Path) -> None:
        self.path = runtime_dir / LOCK_FILE
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._fd)
            raise RuntimeError(f"another broker already serves the runtime directory {runtime_dir}") from None

    def release(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self._fd)


def previous_instance(runtime_dir: Path) -> str:
    try:
        return (runtime_dir / INSTANCE_FILE).read_text().strip()
    except FileNotFoundError:
        return ""


def clean_stale_sockets(runtime_dir: Path) -> int:
    """Remove socket files left by a dead broker (called only while holding the InstanceLock)."""
    n = 0
    for entry in runtime_dir.glob("*.sock"):
        with contextlib.suppress(FileNotFoundError):
            entry.unlink()
            n += 1
    return n
