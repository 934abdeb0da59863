"""The runtime directory (sockets, lock, instance id) and the names of what lives in it."""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import socket
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)

ENV_VAR = "SHMBROKER_RUNTIME_DIR"
SYSTEM_DIR = Path("/run/shmbroker")
CONTROL_SOCKET = "broker.sock"
WORKERS_SOCKET = "workers.sock"
RINGS_SOCKET = "rings.sock"  # the ring handout (broker.common.handout)
LOCK_FILE = "broker.lock"
INSTANCE_FILE = "broker.instance"


def resolve(configured: str = "", server: bool = False) -> Path:
    """SHMBROKER_RUNTIME_DIR if set; else the configured dir; else /run/shmbroker if usable; else per user.

    The client and the broker call this alike, so both find the same sockets without being told. The
    broker needs to write in /run/shmbroker; a client (of the broker's group, say) only to enter it.
    """
    return resolve_why(configured, server)[0]


def resolve_why(configured: str = "", server: bool = False) -> tuple[Path, str]:
    """``resolve``'s directory, and how it was chosen, in words for an error message."""
    env = os.environ.get(ENV_VAR, "")
    if env:
        return Path(env), f"from ${ENV_VAR}"
    if configured:
        return Path(configured), "as configured"
    if SYSTEM_DIR.is_dir() and os.access(SYSTEM_DIR, (os.W_OK | os.X_OK) if server else os.X_OK):
        return SYSTEM_DIR, f"{SYSTEM_DIR} exists, and ${ENV_VAR} is not set"
    xdg = os.environ.get("XDG_RUNTIME_DIR", "")
    if xdg and os.path.isdir(xdg) and os.access(xdg, os.W_OK):
        return Path(xdg) / "shmbroker", f"under $XDG_RUNTIME_DIR, as neither ${ENV_VAR} nor {SYSTEM_DIR} is there"
    return (fallback_dir(),
            f"this user's fallback, as neither ${ENV_VAR}, {SYSTEM_DIR} nor $XDG_RUNTIME_DIR is there")


def fallback_dir() -> Path:
    """The per-user directory in the shared temporary directory, where another user could have made it first."""
    return Path(tempfile.gettempdir()) / f"shmbroker-{os.getuid()}"


def squatted(runtime_dir: Path) -> str:
    """Why a client must not use ``runtime_dir`` ("" when it may): the per-user fallback when someone else owns it
    or others may write in it, so that a broker listening there could be anyone's."""
    if runtime_dir != fallback_dir():
        return ""  # a configured, system or XDG directory belongs to whoever runs the broker there
    try:
        st = runtime_dir.stat()
    except FileNotFoundError:
        return ""
    if st.st_uid != os.getuid() or st.st_mode & 0o022:
        return (f"the runtime directory {runtime_dir} is owned by uid {st.st_uid} with mode {st.st_mode & 0o777:o}, "
                f"not by this user (uid {os.getuid()}) and private: a broker there could be anyone's. Remove it, or "
                f"set ${ENV_VAR} to the broker's directory")
    return ""


def broker_absent(runtime_dir: Path) -> bool:
    """True when no process listens on the broker's control socket (no file, or one left by a broker that
    died); False when one listens, or when this user may not tell (the handshake then says why)."""
    return not has_listener(runtime_dir / CONTROL_SOCKET)


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


def has_listener(path: Path) -> bool:
    """True when a process listens on the unix socket file ``path``, or when that cannot be told; False when
    the file is missing or refuses connections (whoever bound it is gone)."""
    if len(os.fsencode(path)) >= 108:  # sun_path's limit: nobody could have bound it, but do not guess
        return True
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.setblocking(False)  # a listener with a full backlog answers EAGAIN at once instead of blocking us: live
    try:
        probe.connect(str(path))
    except (FileNotFoundError, ConnectionRefusedError, NotADirectoryError):
        return False
    except OSError:  # EAGAIN, EACCES, not a stream socket: not ours to remove
        return True
    finally:
        probe.close()
    return True


def clean_stale_sockets(runtime_dir: Path) -> int:
    """Remove the directory's socket files that nothing listens on (left by a dead broker, worker or gateway);
    returns how many. A live listener's file, a running ``shmbroker inline``'s, say, is kept: the broker's
    start and stop must not cut off a process that outlives it."""
    n = 0
    for entry in runtime_dir.glob("*.sock"):
        with contextlib.suppress(FileNotFoundError):
            probed = entry.stat()
            if has_listener(entry):
                continue
            # unlink only the file that refused: one a starting gateway bound meanwhile has another inode
            again = entry.stat()
            if (again.st_dev, again.st_ino) == (probed.st_dev, probed.st_ino):
                entry.unlink()
                n += 1
    return n
