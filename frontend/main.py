"""``shmbroker http``: start N front-end processes (frontend/server.py) on one port and keep them running.

This process only supervises. It owns the port: it binds and listens on one socket, without SO_REUSEPORT,
before any child starts (``--port 0`` picks a free one), and every child serves connections from that same
socket, inherited at spawn; the kernel hands each new connection to whichever child accepts it first. So a
second ``shmbroker http`` (or any other server) on the same host:port fails to bind and exits 2, and the
port stays taken across child restarts. A child that exits is restarted after a pause; SIGTERM or SIGINT
stops them all.

``--unix PATH`` listens on a Unix socket instead, mode 0660: its owner and group may connect, nobody else.
It is claimed through an flock on ``PATH.lock`` (frontend.unixclaim): a second front-end on the path is
refused while the first lives, and the socket file a killed one left is replaced. A socket there that no
front-end bound is replaced only if nothing listens on it; any other file there is refused.
"""

from __future__ import annotations

import argparse
import errno
import logging
import math
import multiprocessing as mp
import os
import resource
import socket
import stat
import sys
import threading
from collections.abc import Callable
from dataclasses import replace
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from pathlib import Path

from shmbroker.broker.common import proc
from shmbroker.frontend.settings import OWN_FDS, RATE_WINDOW_S, Settings
from shmbroker.frontend.unixclaim import UnixClaim

log = logging.getLogger(__name__)
READY_TIMEOUT_S = 120.0  # a child's session handshake is retried until the broker answers
RESTART_PAUSE_S = 1.0
BACKLOG = 128  # connections the kernel queues before a child accepts them
MIN_API_KEY_CHARS = 16
UNIX_PATH_MAX = 107  # sun_path's 108 bytes, one for the terminating NUL


class PortTaken(RuntimeError):
    """Another process listens on the host:port that ``--port`` names."""


def claim_port(host: str, port: int) -> socket.socket:
    """A socket listening on ``host:port`` (port 0: a free one), for the children to share; PortTaken when
    another process listens there."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    # One listening socket inherited by every child, no SO_REUSEPORT: the kernel itself refuses any later
    # binder of this port (EADDRINUSE), with no window between a check and the bind and no lock file to leave
    # behind; SO_REUSEPORT would let any process of this user join the group and take half the connections.
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # only lets us rebind over TIME_WAIT connections
    try:
        sock.bind((host, port))
        sock.listen(BACKLOG)  # listening is the claim: two bound, non-listening SO_REUSEADDR sockets may coexist
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise PortTaken(f"--port: {host}:{port} is already in use (another `shmbroker http` or another server "
                            f"listens there); stop it, or choose another --port") from None
        raise
    return sock


class UnixListener:
    """``--unix PATH``: a socket listening at ``PATH``, mode 0660, claimed through ``PATH.lock``."""

    def __init__(self, path: str) -> None:
        if len(os.fsencode(path)) > UNIX_PATH_MAX:
            raise ValueError(f"--unix {path}: a Unix socket's path may have at most {UNIX_PATH_MAX} bytes; "
                             "choose a shorter one")
        parent = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(parent):
            raise ValueError(f"--unix {path}: the directory {parent} does not exist; create it, or choose another path")
        try:
            self.claim = UnixClaim(Path(path), Path(f"{path}.lock"), lambda holder: PortTaken(
                f"--unix: {path} is served by another `shmbroker http` (pid {holder}, holding {path}.lock); stop "
                "it, or choose another --unix"))
        except OSError as exc:
            raise ValueError(f"--unix {path}: cannot open its lock file {path}.lock ({exc.strerror})") from None
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            _remove_stale(path)
            old = os.umask(0o117)  # the socket file is made 0660 by bind; connecting needs its write permission
            try:
                self.sock.bind(path)
            finally:
                os.umask(old)
            self.claim.bound()
            self.sock.listen(BACKLOG)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Close the socket, remove its file, then let the claim go."""
        self.sock.close()
        self.claim.release()


def _remove_stale(path: str) -> None:
    """Remove a socket at ``path`` that nobody listens on (a killed front-end's); refuse anything else there."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        raise ValueError(f"--unix {path}: exists and is not a socket; remove it, or choose another path")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(path)
    except ConnectionRefusedError:
        os.unlink(path)
        return
    except PermissionError:
        raise ValueError(f"--unix {path}: a socket there that this user may not use (owner uid {st.st_uid}); "
                         "choose another path") from None
    finally:
        probe.close()
    raise PortTaken(f"--unix: another process listens on {path}; stop it, or choose another --unix")


class Frontends:
    """N front-end processes on one port, or on one Unix socket."""

    def __init__(self, settings: Settings, workers: int, log_level: str = "INFO") -> None:
        if workers < 1:
            raise ValueError(f"--workers: expected at least 1, got {workers}")
        self._unix = UnixListener(settings.unix) if settings.unix else None
        self._sock = self._unix.sock if self._unix else claim_port(settings.host, settings.port)
        self.settings = settings if self._unix else replace(settings, port=self._sock.getsockname()[1])
        self.workers = workers
        self.log_level = log_level
        self._ctx = mp.get_context("spawn")
        self._procs: list[tuple[BaseProcess, Connection]] = []

    @property
    def port(self) -> int:
        return self.settings.port

    @property
    def address(self) -> str:
        """Where it listens: ``http://HOST:PORT``, or ``unix:PATH``."""
        return f"unix:{self.settings.unix}" if self.settings.unix else f"http://{self.settings.host}:{self.port}"

    def _start(self) -> tuple[BaseProcess, Connection]:
        from shmbroker.frontend import server  # aiohttp and the client load in the children, not in `shmbroker ...`

        rx, tx = self._ctx.Pipe(duplex=False)
        p = self._ctx.Process(target=server.run, args=(self.settings, tx, self.log_level, self._sock),
                             name="shmb-http")  # the socket travels to the child as a duplicate descriptor
        p.start()
        tx.close()
        return p, rx

    def _await_ready(self, stop: threading.Event) -> bool:
        pending = {rx: p for p, rx in self._procs}
        deadline = READY_TIMEOUT_S
        while pending and not stop.is_set() and deadline > 0:
            for obj in wait([*pending, *(p.sentinel for p in pending.values())], timeout=0.5):
                if isinstance(obj, Connection) and obj in pending:
                    try:
                        obj.recv()
                    except EOFError:
                        log.error("a front-end process exited before it was ready; see its log above")
                        return False
                    pending.pop(obj)
            deadline -= 0.5
        return not pending

    def run(self, stop: threading.Event, on_ready: Callable[[Frontends], None]) -> int:
        """Start the children, call ``on_ready`` once every one answers, supervise until ``stop``."""
        self._procs = [self._start() for _ in range(self.workers)]
        try:
            if not self._await_ready(stop):
                return 0 if stop.is_set() else 1
            on_ready(self)
            while not stop.is_set():
                # the sentinels wake us when a child exits; the timeout only bounds how late stop is seen
                wait([p.sentinel for p, _ in self._procs], timeout=0.5)
                for i, (p, rx) in enumerate(self._procs):
                    if p.exitcode is not None and not stop.is_set():
                        log.error("front-end process %d exited with %s; restarting it", p.pid, p.exitcode)
                        rx.close()
                        stop.wait(RESTART_PAUSE_S)
                        self._procs[i] = self._start()
            return 0
        finally:
            self._stop_all()

    def _stop_all(self) -> None:
        for p, _ in self._procs:
            if p.exitcode is None:
                p.terminate()  # SIGTERM: the child closes its session (BYE) and its listening socket
        for p, rx in self._procs:
            p.join(15)
            if p.exitcode is None:
                log.warning("front-end process %d ignored SIGTERM; killing it", p.pid)
                p.kill()
                p.join(5)
            rx.close()
        if self._unix is not None:
            self._unix.close()
        else:
            self._sock.close()


NAME = "http"  # the subcommand (frontend/commands.py)
HELP = "the KServe v2 / Triton HTTP front-end: N processes on one port"


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--workers", type=int, default=2,
                    help="front-end processes sharing the port's one listening socket (default 2)")
    ap.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    ap.add_argument("--port", type=int, default=8000, help="TCP port (default 8000; 0: a free one, printed); "
                    "refused with exit 2 when another process listens on it")
    ap.add_argument("--unix", default="", metavar="PATH",
                    help="listen on this Unix socket instead of --host/--port, mode 0660 (its owner and group may "
                         "connect); refused with exit 2 while another `shmbroker http` serves it")
    ap.add_argument("--slots", type=int, default=0,
                    help="ring slots per process, i.e. its requests in flight (default: the broker's default_slots)")
    ap.add_argument("--max-items", type=int, default=0,
                    help="rows a ring slot holds (default: the broker's default_max_items, else as many as "
                         "default_ring_mib allows); a request of more rows, up to max_batch, is sent as parts")
    ap.add_argument("--max-body-mib", type=int, default=64, help="largest request body (default 64 MiB)")
    ap.add_argument("--header-timeout", type=float, default=10.0, metavar="S",
                    help="seconds a connection has to send a request's headers, from its opening or from its first "
                         "byte after the previous response; past it it is answered 408 and closed (default 10)")
    ap.add_argument("--body-timeout", type=float, default=60.0, metavar="S",
                    help="seconds a request's whole body has to arrive, from its headers; past it the request is "
                         "answered 408 and the connection closed (default 60)")
    ap.add_argument("--max-connections", type=int, default=512, metavar="N",
                    help="client connections per process, those it is answering 408 or 503 and closing included; "
                         "one more first closes the oldest of those, else displaces the oldest idle one or the "
                         "oldest still sending headers (answered 503), else it is answered 503 (default 512; the "
                         f"open-files limit is raised to N + {OWN_FDS} when it can be, else the command exits 2)")
    ap.add_argument("--body-memory-mib", type=int, default=512, metavar="MIB",
                    help="request bodies one process holds at once, in MiB, charged as their bytes arrive; a "
                         "request whose next bytes do not fit is answered 503, the rest unread (default 512; at "
                         "least --max-body-mib)")
    ap.add_argument("--peer-body-memory-mib", type=int, default=0, metavar="MIB",
                    help="of --body-memory-mib, what the bodies of one peer (an IP address, an IPv6 /64, on --unix "
                         "a uid) may hold; past it: 503 (default: a quarter of --body-memory-mib, at least "
                         "--max-body-mib)")
    ap.add_argument("--min-body-rate", type=int, default=64, metavar="KIB",
                    help="KiB/s a request body must keep up once its headers are in; one that falls "
                         f"{RATE_WINDOW_S:g} s behind it (a body that stalls: {RATE_WINDOW_S:g} s after its last "
                         "bytes) is answered 408 and its connection closed (default 64; 0: only --body-timeout)")
    ap.add_argument("--api-key-file", default="", metavar="FILE",
                    help="ask every request but the health probes for 'Authorization: Bearer KEY', KEY being this "
                         "file's content (at least 16 characters); others than the file's owner and group may not "
                         "read or write it (chmod 640)")
    ap.add_argument("--log-level", default="INFO", choices=("DEBUG", "INFO", "WARNING", "ERROR"),
                    help="logging level (default INFO)")


def api_key(path: str) -> str:
    """The key in ``path``; ValueError naming --api-key-file when others than its owner and group may read or
    write it, or it holds no usable key (printable ASCII, no spaces, at least MIN_API_KEY_CHARS characters)."""
    try:
        st = os.stat(path)
        with open(path, "rb") as fh:
            raw = fh.read(4096)
    except OSError as exc:
        raise ValueError(f"--api-key-file {path}: cannot read it ({exc.strerror})") from None
    mode = stat.S_IMODE(st.st_mode)
    if mode & 0o007:
        raise ValueError(f"--api-key-file {path}: mode {mode:04o} lets users outside the file's group use the key: "
                         f"run `chmod 640 {path}` (and make a new key if others may have read it)")
    key = raw.strip()
    if len(key) < MIN_API_KEY_CHARS or not all(0x21 <= b <= 0x7E for b in key):
        raise ValueError(f"--api-key-file {path}: expected one key of at least {MIN_API_KEY_CHARS} printable ASCII "
                         f"characters without spaces (`openssl rand -hex 32` makes one), got {len(key)} bytes")
    return key.decode()


def _positive(value: float, option: str, what: str) -> None:
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{option}: expected {what} above 0, got {value:g}")


def settings_of(args: argparse.Namespace, runtime_dir: Path) -> Settings:
    """The front-end's settings; ValueError naming the option that is wrong."""
    _positive(args.max_body_mib, "--max-body-mib", "MiB")
    _positive(args.header_timeout, "--header-timeout", "seconds")
    _positive(args.body_timeout, "--body-timeout", "seconds")
    _positive(args.max_connections, "--max-connections", "a number of connections")
    if args.body_memory_mib < args.max_body_mib:
        raise ValueError(f"--body-memory-mib: expected at least --max-body-mib ({args.max_body_mib}), so that a body "
                         f"of the largest size fits, got {args.body_memory_mib}")
    peer = args.peer_body_memory_mib or max(args.max_body_mib, args.body_memory_mib // 4)
    if not args.max_body_mib <= peer <= args.body_memory_mib:
        raise ValueError(f"--peer-body-memory-mib: expected --max-body-mib ({args.max_body_mib}) to --body-memory-mib "
                         f"({args.body_memory_mib}), so that a body of the largest size fits, got {peer}")
    if args.min_body_rate < 0:
        raise ValueError(f"--min-body-rate: expected KiB/s, 0 or above, got {args.min_body_rate}")
    key = api_key(args.api_key_file) if args.api_key_file else ""
    return Settings(args.host, args.port, runtime_dir, args.unix, args.slots, args.max_items, args.max_body_mib,
                    header_timeout_s=args.header_timeout, body_timeout_s=args.body_timeout,
                    max_connections=args.max_connections, body_memory_mib=args.body_memory_mib,
                    peer_body_memory_mib=peer, min_body_rate_kib=args.min_body_rate, api_key=key)


def allow_open_files(max_connections: int) -> None:
    """Raise this process's open-files limit (the children inherit it) to what ``max_connections`` needs;
    ValueError naming --max-connections when the hard limit is below it."""
    need = max_connections + OWN_FDS
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < need:
        if hard != resource.RLIM_INFINITY and hard < need:
            raise ValueError(f"--max-connections {max_connections}: a front-end process needs {need} open files "
                             f"(N + {OWN_FDS}) and may open only {hard} (ulimit -Hn; LimitNOFILE= in a unit): "
                             f"lower --max-connections, or raise the limit")
        resource.setrlimit(resource.RLIMIT_NOFILE, (need, hard))


def command(args: argparse.Namespace) -> int:
    """``shmbroker http``: prints one line with the address once every process is ready, then serves."""
    from shmbroker.broker.common import runtime

    proc.name_process("shmb-http-main")
    proc.setup_logging(args.log_level)
    stop = threading.Event()
    proc.stop_on_signals(stop)
    rd = Path(args.runtime_dir) if args.runtime_dir else runtime.resolve()
    try:
        settings = settings_of(args, rd)
        allow_open_files(settings.max_connections)
        fe = Frontends(settings, args.workers, args.log_level)
    except (OSError, ValueError, PortTaken) as exc:
        sys.stderr.write(f"shmbroker: http: {exc}\n")
        return 2

    def ready(f: Frontends) -> None:
        sys.stdout.write(f"shmbroker http: {f.workers} front-end processes ready on {f.address}\n")
        sys.stdout.flush()

    return fe.run(stop, ready)
