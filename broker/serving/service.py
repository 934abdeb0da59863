"""The broker's serving loop: the client control socket, the workers socket, supervision and timers.

Steps of each turn: (1) poll both sockets, (2) handle client messages, (3) handle worker messages,
(4) supervise workers, (5) expire handshakes, dead clients and health waiters. Nothing here touches
request payloads: the data path runs client <-> worker directly.
"""

from __future__ import annotations

import logging
import os
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import msgspec
import zmq

from shmbroker.broker.common import liveness, ring, runtime
from shmbroker.broker.common import protocol as P
from shmbroker.broker.common.config import Config
from shmbroker.broker.common.handout import Peer, RingHandout, peer_of_frame
from shmbroker.broker.ops.notify import Notifier
from shmbroker.broker.ops.operations import Operations
from shmbroker.broker.serving.health import health_reply
from shmbroker.broker.serving.sessions import BrokerSession, Phase, SessionError, SessionTable
from shmbroker.broker.serving.supervisor import Supervisor, WorkerPhase, WorkerSlot

log = logging.getLogger(__name__)

POLL_MS = 50
STATS_TIMEOUT_S = 2.0
EXTEND_MARGIN_S = 10.0  # a start step past its deadline is the broker's to end (it names the step), not systemd's


@dataclass
class Waiter:
    identity: bytes
    deadline: float


@dataclass
class StatsQuery:
    identity: bytes
    deadline: float
    waiting: set[int]
    replies: list[P.WorkerStats]


class Broker:
    """Invariant: a session is forgotten only after every worker that mapped its ring detached or died."""

    def __init__(self, cfg: Config, runtime_dir: Path | None = None, notifier: Notifier | None = None) -> None:
        self.cfg = cfg
        self._notifier = notifier
        self.runtime_dir = runtime_dir or runtime.resolve(cfg.broker.runtime_dir, server=True)
        runtime.prepare(self.runtime_dir, cfg.file_mode, cfg.group_id())
        self._lock = runtime.InstanceLock(self.runtime_dir)
        self.instance = secrets.token_hex(4)
        self._janitor()
        self.sessions = SessionTable(cfg, self.instance)
        self.supervisor = Supervisor(cfg, self.runtime_dir)
        self.models: list[P.ModelInfo] = []
        self._health_waiters: list[Waiter] = []
        self._pending_hellos: list[tuple[bytes, P.Hello, Peer, float]] = []
        self._stats: dict[int, StatsQuery] = {}
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        # any client may send here: ZeroMQ closes the connection of one that sends a frame over the largest legal
        # control message, before it is read into memory
        self.control = self._bind(runtime.CONTROL_SOCKET, P.CONTROL_MAXMSGSIZE)
        # the workers' channel carries every session's token: the broker's own user only, whatever the group
        self.workers_sock = self._bind(runtime.WORKERS_SOCKET, mode=0o600, gid=None)
        self.handout = RingHandout(self.runtime_dir / runtime.RINGS_SOCKET, cfg.file_mode, cfg.group_id(),
                                   self.sessions.grantable, cfg.broker.handshake_timeout_ms / 1e3)
        self._closed = False

    def _janitor(self) -> None:
        """Remove the socket files a dead broker left in this runtime dir (we hold the lock: it is dead). Its
        rings went with its processes: they have no names."""
        n = runtime.clean_stale_sockets(self.runtime_dir)
        if n:
            log.warning("removed %d socket files left by a previous broker", n)
        fd = os.open(self.runtime_dir / runtime.INSTANCE_FILE, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(self.instance + "\n")

    def _bind(self, name: str, max_frame: int = -1, mode: int | None = None, gid: int | None = -1) -> zmq.Socket[bytes]:
        """A ROUTER bound to ``name`` in the runtime dir with the configured file mode and group (or ``mode`` and
        ``gid``); ``max_frame`` (ZMQ_MAXMSGSIZE, -1: none) bounds what a peer may send in one frame."""
        s = self._ctx.socket(zmq.ROUTER)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.ROUTER_MANDATORY, 1)  # an unknown peer is an error, not a silent drop
        s.setsockopt(zmq.MAXMSGSIZE, max_frame)
        addr = runtime.endpoint(self.runtime_dir, name)
        s.bind(addr)
        runtime.secure_socket_file(addr, self.cfg.file_mode if mode is None else mode,
                                   self.cfg.group_id() if gid == -1 else gid)
        return s

    # -- the loop -------------------------------------------------------------------------------------------
    def serve(self, stop: threading.Event, on_ready: threading.Event | None = None) -> None:
        """Run until ``stop`` is set; then shut down cleanly (workers stopped, segments and sockets removed).

        ``broker.ops.operations`` rides on each turn: systemd READY/WATCHDOG/STATUS, probes, the HTTP server."""
        try:
            ops = Operations(self.cfg, self.runtime_dir, self._notifier)
        except OSError as exc:  # the health port is taken: nothing was started yet
            self.close()
            raise RuntimeError(str(exc)) from None
        self.supervisor.start_all()
        poller = zmq.Poller()
        poller.register(self.control, zmq.POLLIN)
        poller.register(self.workers_sock, zmq.POLLIN)
        handout_fds: set[int] = set()
        last_liveness = time.monotonic()
        try:
            while not stop.is_set():
                handout_fds = self._poll_handout(poller, handout_fds)
                events = dict(poller.poll(POLL_MS))  # (1)
                now = time.monotonic()
                if self.control in events:
                    self._drain(self.control, self._on_client)  # (2)
                if self.workers_sock in events:
                    self._drain(self.workers_sock, self._on_worker)  # (3)
                for fd in handout_fds & events.keys():
                    self.handout.on_readable(fd, now)  # (2b) rings to clients and workers
                self.handout.expire(now)
                for w in self.supervisor.check(now):  # (4)
                    self._worker_died(w)
                self._timers(now)  # (5)
                if now - last_liveness >= self.cfg.broker.session_check_ms / 1e3:
                    last_liveness = now
                    self._reap_dead_clients()
                ops.tick(now, lambda: health_reply(self.cfg, self.supervisor))
                if on_ready is not None and self.all_ready():
                    on_ready.set()
        finally:
            ops.stopping()
            self.close()

    def _poll_handout(self, poller: zmq.Poller, registered: set[int]) -> set[int]:
        """Keep the poller's set of handout descriptors equal to the handout's; returns the new set."""
        wanted = set(self.handout.fds())
        for fd in registered - wanted:
            poller.unregister(fd)
        for fd in wanted - registered:
            poller.register(fd, zmq.POLLIN)
        return wanted

    def _drain(self, sock: zmq.Socket[bytes], handler: Callable[[bytes, msgspec.Struct, Peer | None], None]) -> None:
        for _ in range(1000):
            try:
                parts = sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            identity, frames = parts[0].bytes, [f.bytes for f in parts[1:]]
            try:
                msg = P.decode(frames)
            except P.ProtocolError as exc:
                log.warning("malformed control message: %s", exc)
                code = "BAD_VERSION" if isinstance(exc, P.VersionError) else "BAD_MESSAGE"
                self._send(sock, identity, P.ErrorReply(code, str(exc)))
                continue
            # the kernel's word on who sent it (SO_PEERCRED via libzmq), never the message's
            handler(identity, msg, peer_of_frame(parts[0]))

    def _send(self, sock: zmq.Socket[bytes], identity: bytes, msg: msgspec.Struct) -> bool:
        try:
            sock.send_multipart([identity, *P.encode(msg)], zmq.NOBLOCK)
            return True
        except zmq.ZMQError as exc:  # EHOSTUNREACH (peer gone) or EAGAIN (peer not reading)
            log.info("cannot reach a peer (%s)", exc.strerror)
            return False

    def all_ready(self) -> bool:
        return health_reply(self.cfg, self.supervisor).ready

    # -- clients --------------------------------------------------------------------------------------------
    def _on_client(self, identity: bytes, msg: msgspec.Struct, peer: Peer | None) -> None:
        if isinstance(msg, P.Hello):
            if msg.protocol != P.PROTOCOL_VERSION:
                self._send(self.control, identity, P.ErrorReply(
                    "BAD_VERSION", f"HELLO.protocol {msg.protocol}: this broker speaks {P.PROTOCOL_VERSION}"))
                return
            if peer is None:  # only over ipc does the kernel name the peer; the control socket is ipc only
                self._send(self.control, identity, P.ErrorReply("BAD_HELLO", "the broker cannot tell which user "
                                                                              "sent this HELLO"))
                return
            deadline = time.monotonic() + self.cfg.broker.handshake_timeout_ms / 1e3
            self._pending_hellos.append((identity, msg, peer, deadline))
            self._serve_hellos()
        elif isinstance(msg, P.Attached):
            self._client_attached(identity, msg)
        elif isinstance(msg, P.Bye):
            s = self.sessions.by_id.get(msg.session_id)
            if s is not None and s.identity == identity:
                self._close_session(s, "client said BYE")
        elif isinstance(msg, P.Health):
            self._health(identity, msg)
        elif isinstance(msg, P.StatsRequest):
            self._stats_query(identity)
        else:
            self._send(self.control, identity, P.ErrorReply("BAD_MESSAGE", f"{type(msg).__name__} is not for the "
                                                                         "broker's control socket"))

    def _serve_hellos(self) -> None:
        if not self.models:
            return  # no worker has reported the models yet; the HELLOs wait (see _timers)
        hellos, self._pending_hellos = self._pending_hellos, []
        for identity, hello, peer, _deadline in hellos:
            try:
                s = self.sessions.create(hello, identity, peer, self.models)
            except SessionError as exc:
                self._send(self.control, identity, P.ErrorReply(exc.code, str(exc)))
                continue
            except OSError as exc:  # strerror only: the text goes to a client and names no segment or path
                self._send(self.control, identity, P.ErrorReply(
                    "NO_SHM", f"cannot create the session's ring: {exc.strerror}"))
                continue
            except ring.RingError as exc:
                self._send(self.control, identity, P.ErrorReply("NO_SHM", str(exc)))
                continue
            s.deadline = time.monotonic() + self.cfg.broker.handshake_timeout_ms / 1e3
            self._send(self.control, identity, s.setup(self.models, self.cfg.broker.handshake_timeout_ms))

    def _client_attached(self, identity: bytes, msg: P.Attached) -> None:
        s = self.sessions.by_id.get(msg.session_id)
        if s is None or s.identity != identity or s.phase is not Phase.SETUP_SENT:
            self._send(self.control, identity, P.ErrorReply("BAD_SESSION", f"ATTACHED.session_id {msg.session_id} "
                                                                         "is not a session in set-up"))
            return
        s.phase = Phase.ATTACHING
        # a client that locks took the lock before ATTACHED; one the kernel could not give a pid for must lock
        s.by_lock = liveness.lock_held(s.segment) or s.peer.pid == 0
        s.deadline = time.monotonic() + self.cfg.broker.handshake_timeout_ms / 1e3
        for w in self.supervisor.ready_workers():
            self._attach(s, w)
        self._maybe_ready(s)

    def _attach(self, s: BrokerSession, w: WorkerSlot) -> None:
        s.pending_attach.add(w.worker_id)
        self._send(self.workers_sock, w.identity, s.attach_msg())

    def _maybe_ready(self, s: BrokerSession) -> None:
        if s.phase is Phase.ATTACHING and not s.pending_attach:
            s.phase = Phase.READY
            s.deadline = 0.0
            self._send(self.control, s.identity, P.Ready(s.session_id, s.token, self._worker_infos(s)))

    def _worker_infos(self, s: BrokerSession) -> list[P.WorkerInfo]:
        out = []
        for wid in sorted(s.attached):
            w = self.supervisor.workers[wid]
            if w.phase is WorkerPhase.READY:
                out.append(self._worker_info(s, w))
        return out

    def _worker_info(self, s: BrokerSession, w: WorkerSlot) -> P.WorkerInfo:
        return P.WorkerInfo(w.worker_id, w.device, w.endpoint, s.reply_endpoints[w.worker_id],
                            [m.name for m in w.models])

    def _close_session(self, s: BrokerSession, why: str) -> None:
        if s.phase is Phase.CLOSING:
            return
        log.info("closing session %d: %s", s.session_id, why)
        s.phase = Phase.CLOSING
        self.sessions.uncount(s)
        s.deadline = time.monotonic() + self.cfg.broker.handshake_timeout_ms / 1e3
        for wid in s.attached | s.pending_attach:
            w = self.supervisor.workers[wid]
            if w.identity:
                s.pending_detach.add(wid)
                self._send(self.workers_sock, w.identity, P.Detach(s.session_id))
        self._maybe_destroy(s)

    def _maybe_destroy(self, s: BrokerSession) -> None:
        if s.phase is Phase.CLOSING and not s.pending_detach:
            self.sessions.destroy(s)

    def _reap_dead_clients(self) -> None:
        for s in list(self.sessions.by_id.values()):
            if s.phase is not Phase.CLOSING and not liveness.client_alive(s.segment, s.peer.pid, s.by_lock):
                self._close_session(s, "its client's lock was released" if s.by_lock else
                                    f"client pid {s.peer.pid} is gone")

    def _health(self, identity: bytes, msg: P.Health) -> None:
        reply = health_reply(self.cfg, self.supervisor)
        if reply.ready or msg.wait_ms == 0:
            self._send(self.control, identity, reply)
        else:
            self._health_waiters.append(Waiter(identity, time.monotonic() + msg.wait_ms / 1e3))

    def _stats_query(self, identity: bytes) -> None:
        qid = secrets.randbits(31)
        ready = self.supervisor.ready_workers()
        self._stats[qid] = StatsQuery(identity, time.monotonic() + STATS_TIMEOUT_S, {w.worker_id for w in ready}, [])
        for w in ready:
            self._send(self.workers_sock, w.identity, P.WorkerStatsRequest(qid))
        self._finish_stats(qid)

    def _finish_stats(self, qid: int, force: bool = False) -> None:
        q = self._stats.get(qid)
        if q is not None and (force or not q.waiting):
            del self._stats[qid]
            self._send(self.control, q.identity, P.StatsReply(sorted(q.replies, key=lambda r: r.worker_id)))

    # -- workers --------------------------------------------------------------------------------------------
    def _on_worker(self, identity: bytes, msg: msgspec.Struct, peer: Peer | None) -> None:
        if isinstance(msg, P.WorkerHello):
            if msg.protocol != P.PROTOCOL_VERSION or not 0 <= msg.worker_id < len(self.supervisor.workers):
                log.error("refused a worker HELLO: %s", msg)
                return
            launch = self.supervisor.workers[msg.worker_id].launch
            if peer is None or launch is None or peer.pid != launch.pid:
                log.error("refused a worker HELLO for worker %d from %s: not the process the broker started (pid %s)",
                          msg.worker_id, peer, launch.pid if launch else None)
                return
            self.supervisor.workers[msg.worker_id].identity = identity
            return
        w = self.supervisor.by_identity(identity)
        if w is None:
            log.warning("message %s from an unknown worker", type(msg).__name__)
            return
        if isinstance(msg, P.WorkerReady):
            self._worker_ready(w, msg)
        elif isinstance(msg, P.WorkerProgress):
            self.supervisor.progress(w, msg.step, time.monotonic())
            log.info("worker %d: %s", w.worker_id, w.step)
            if self._notifier is not None and not w.ever_ready:  # systemd's start timeout: as the step's, and then some
                self._notifier.extend(self.cfg.broker.worker_start_timeout_ms / 1e3 + EXTEND_MARGIN_S)
        elif isinstance(msg, P.WorkerFailed):
            w.reason = f"model load failed: {msg.reason}"
            log.error("worker %d: %s", w.worker_id, w.reason)
        elif isinstance(msg, P.AttachOk):
            self._attach_ok(w, msg)
        elif isinstance(msg, P.AttachFailed):
            self._attach_failed(w, msg)
        elif isinstance(msg, P.DetachOk):
            s = self.sessions.by_id.get(msg.session_id)
            if s is not None:
                s.pending_detach.discard(w.worker_id)
                s.attached.discard(w.worker_id)
                self._maybe_destroy(s)
        elif isinstance(msg, P.WorkerStatsReply):
            q = self._stats.get(msg.request_id)
            if q is not None:
                q.replies.append(msg.stats)
                q.waiting.discard(w.worker_id)
                self._finish_stats(msg.request_id)
        elif isinstance(msg, P.ErrorReply):
            log.error("worker %d: %s %s", w.worker_id, msg.code, msg.message)

    def _worker_ready(self, w: WorkerSlot, msg: P.WorkerReady) -> None:
        self.supervisor.ready(w)
        w.endpoint = msg.endpoint
        w.models = msg.models
        if not self.models:
            self.models = list(msg.models)
        elif [m.name for m in msg.models] != [m.name for m in self.models]:
            log.error("worker %d serves %s, others serve %s", w.worker_id, msg.models, self.models)
        log.info("worker %d ready at %s", w.worker_id, msg.endpoint)
        self._serve_hellos()
        for s in self.sessions.by_id.values():
            if s.phase in (Phase.ATTACHING, Phase.READY):
                self._attach(s, w)

    def _attach_ok(self, w: WorkerSlot, msg: P.AttachOk) -> None:
        s = self.sessions.by_id.get(msg.session_id)
        if s is None:
            return
        s.pending_attach.discard(w.worker_id)
        s.attached.add(w.worker_id)
        s.reply_endpoints[w.worker_id] = msg.reply_endpoint
        if s.phase is Phase.READY:  # a restarted worker joined a live session
            self._send(self.control, s.identity, P.WorkerUp(self._worker_info(s, w)))
        elif s.phase is Phase.CLOSING:
            s.pending_detach.add(w.worker_id)
            self._send(self.workers_sock, w.identity, P.Detach(s.session_id))
        self._maybe_ready(s)

    def _attach_failed(self, w: WorkerSlot, msg: P.AttachFailed) -> None:
        """A worker that cannot map a session leaves it: the session goes on with the other workers."""
        log.error("worker %d cannot serve session %d: %s", w.worker_id, msg.session_id, msg.reason)
        s = self.sessions.by_id.get(msg.session_id)
        if s is not None:
            s.pending_attach.discard(w.worker_id)
            self._maybe_ready(s)

    def _worker_died(self, w: WorkerSlot) -> None:
        """``w`` was reaped: its sessions lose it (WORKER_DOWN to their clients), and its reply sockets' files go."""
        for s in list(self.sessions.by_id.values()):
            had = w.worker_id in s.attached or w.worker_id in s.pending_attach
            s.attached.discard(w.worker_id)
            s.pending_attach.discard(w.worker_id)
            s.pending_detach.discard(w.worker_id)
            reply = s.reply_endpoints.pop(w.worker_id, None)
            if reply is not None:
                self._remove_reply_socket(w.worker_id, s.session_id, reply)
            if had and s.phase is Phase.READY:
                self._send(self.control, s.identity, P.WorkerDown(w.worker_id, w.reason))
            self._maybe_ready(s)
            self._maybe_destroy(s)
        for qid, q in list(self._stats.items()):
            q.waiting.discard(w.worker_id)
            self._finish_stats(qid)

    def _remove_reply_socket(self, worker_id: int, session_id: int, address: str) -> None:
        """Remove a dead worker's reply socket file: nobody else would before the next broker starts, since its
        replacement binds names with new nonces. Only a file of this runtime dir named as that worker's socket
        for that session is removed: the address came from a peer of workers.sock (ATTACH_OK)."""
        path = Path(address.removeprefix("ipc://"))
        stem = runtime.reply_socket_name(worker_id, session_id, "").removesuffix(".sock")  # "w<N>-s<S>-"
        if path.parent == self.runtime_dir and path.name.startswith(stem) and path.suffix == ".sock":
            runtime.remove_socket_file(address)
        else:
            log.warning("worker %d's reply endpoint for session %d is not one of its socket files in %s; "
                        "left in place", worker_id, session_id, self.runtime_dir)

    # -- timers ---------------------------------------------------------------------------------------------
    def _timers(self, now: float) -> None:
        for s in self.sessions.expired(now):
            if s.phase is Phase.CLOSING:
                log.warning("session %d: workers %s did not detach in time; unlinking anyway",
                            s.session_id, sorted(s.pending_detach))
                s.pending_detach.clear()
                self._maybe_destroy(s)
            else:
                log.warning("session %d: handshake not finished in time (broker.handshake_timeout_ms)", s.session_id)
                self._send(self.control, s.identity, P.ErrorReply(
                    "HANDSHAKE_TIMEOUT", "the session's handshake did not finish within broker.handshake_timeout_ms"))
                self._close_session(s, "handshake timeout")
        if self._pending_hellos:
            keep = []
            for identity, hello, peer, deadline in self._pending_hellos:
                if now > deadline:
                    self._send(self.control, identity, P.ErrorReply(
                        "NOT_READY", "no worker has loaded the models yet; raise broker.handshake_timeout_ms, or "
                        "wait with `shmbroker health --wait`"))
                else:
                    keep.append((identity, hello, peer, deadline))
            self._pending_hellos = keep
        if self._health_waiters:
            reply = health_reply(self.cfg, self.supervisor)
            keep_w = []
            for waiter in self._health_waiters:
                if reply.ready or now > waiter.deadline:
                    self._send(self.control, waiter.identity, reply)
                else:
                    keep_w.append(waiter)
            self._health_waiters = keep_w
        for qid, q in list(self._stats.items()):
            if now > q.deadline:
                self._finish_stats(qid, force=True)

    # -- shutdown -------------------------------------------------------------------------------------------
    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for s in self.sessions.by_id.values():
            if s.phase is Phase.READY:
                for wid in s.attached:
                    self._send(self.control, s.identity, P.WorkerDown(wid, "the broker is shutting down"))
        for w in self.supervisor.workers:
            if w.identity:
                self._send(self.workers_sock, w.identity, P.Shutdown())
        self.supervisor.stop_all()
        self.sessions.destroy_all()
        self.handout.close()
        self._ctx.destroy(linger=0)
        runtime.clean_stale_sockets(self.runtime_dir)
        for name in (runtime.INSTANCE_FILE, runtime.LOCK_FILE):
            (self.runtime_dir / name).unlink(missing_ok=True)
        self._lock.release()
        log.info("broker stopped; sockets removed, rings released")
