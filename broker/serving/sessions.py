"""The broker's session table: sizing and creating rings, and each session's handshake state.

A session moves SETUP_SENT -> ATTACHING -> READY -> CLOSING -> gone. Its segment is a sealed memfd that the
broker hands to the session's client and workers only (broker.common.handout); the table counts sessions and ring
bytes per uid and in all against the [sessions] caps.
"""

from __future__ import annotations

import enum
import logging
import math
import resource
import secrets
from collections import Counter
from dataclasses import dataclass, field

import numpy as np
import psutil

from shmbroker.broker.common import protocol as P
from shmbroker.broker.common.config import Config, SessionsSection
from shmbroker.broker.common.handout import Grantable, Peer
from shmbroker.broker.common.protocol import pack_offsets
from shmbroker.broker.common.ring import RingLayout, Segment, segment_name

log = logging.getLogger(__name__)

# The most descriptors one session costs the broker or a worker: the ring, the client's control and data
# connections, the worker's reply socket (listening and connected) and spare. systemd/shmbroker.service's
# LimitNOFILE is sized from it; tests/test_resources.py measures it.
FDS_PER_SESSION = 8
FD_RESERVE = 64  # descriptors of a broker or worker with no session: sockets, the ZeroMQ context, logs, models


class SessionError(Exception):
    """A HELLO that cannot be granted; ``code`` goes into the ERROR reply and the text names the field."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


class Phase(enum.Enum):
    SETUP_SENT = 1
    ATTACHING = 2
    READY = 3
    CLOSING = 4


@dataclass
class BrokerSession:
    session_id: int
    identity: bytes  # the client's routing id on the control socket
    peer: Peer  # the client process as the kernel saw it connect (not what HELLO says)
    token: int
    segment: Segment
    max_items: int
    phase: Phase = Phase.SETUP_SENT
    deadline: float = 0.0  # of the current handshake step
    attached: set[int] = field(default_factory=set)  # workers that map the segment
    pending_attach: set[int] = field(default_factory=set)
    pending_detach: set[int] = field(default_factory=set)
    reply_endpoints: dict[int, str] = field(default_factory=dict)
    by_lock: bool = False  # liveness by the client's segment lock (broker.common.liveness), else by its pid
    counted: bool = True  # against the caps: until it starts closing

    def ring(self) -> P.SessionRing:
        """The session and its ring's geometry, as SETUP and ATTACH both carry them."""
        lay = self.segment.layout
        return P.SessionRing(self.session_id, self.token, lay.total_bytes, lay.n_slots, lay.slot_stride,
                             lay.in_capacity, lay.out_capacity, self.max_items)

    def setup(self, models: list[P.ModelInfo], timeout_ms: int) -> P.Setup:
        return P.Setup.of(self.ring(), models=models, handshake_timeout_ms=timeout_ms)

    def attach_msg(self) -> P.Attach:
        return P.Attach.of(self.ring(), client_uid=self.peer.uid)


def item_bytes(spec: P.TensorSpec) -> int:
    """The most bytes one row of this input or output takes in a slot (an image row: its table entry and image)."""
    if spec.kind == P.InputKind.IMAGE:
        return P.image_row_bytes(spec.max_bytes)
    return math.prod(spec.shape[1:]) * np.dtype(spec.dtype).itemsize


def session_rows(asked: int, default: int, models: list[P.ModelInfo], slots: int, ring_bytes: int) -> int:
    """Rows a slot of a session holds: what the client asked, else ``default`` ([sessions] default_max_items),
    else as many as keep a ring of ``slots`` slots within ``ring_bytes`` (default_ring_mib; at least one row),
    else (``ring_bytes`` 0) the largest ``max_batch``; never above the largest ``max_batch``."""
    largest = max(m.max_batch for m in models)
    if asked or default or not ring_bytes:
        return min(asked or default or largest, largest)
    lo, hi = 1, largest  # the ring grows with the rows: the most rows whose ring fits, by bisection
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if RingLayout(0, slots, *capacities(models, mid)).total_bytes <= ring_bytes:
            lo = mid
        else:
            hi = mid - 1
    return lo


def capacities(models: list[P.ModelInfo], max_items: int) -> tuple[int, int]:
    """Bytes of the input and output regions a slot needs to hold a request of up to ``max_items`` rows. A model
    of images takes as many rows as their bytes fit the input region (up to its ``max_batch``), not
    ``max_items`` of its largest images: its outputs get room for those rows, at most as many bytes as the input
    region has, so several photos of usual sizes go as one request (PROTOCOL 3.1)."""
    in_cap = out_cap = 0
    for m in models:
        rows = min(max_items, m.max_batch)
        in_cap = max(in_cap, pack_offsets([rows * item_bytes(s) for s in m.inputs])[1])
    for m in models:
        rows = min(max_items, m.max_batch)
        sizes = [item_bytes(s) for s in m.outputs]
        if m.inputs and m.inputs[0].kind == P.InputKind.IMAGE:
            rows = max(rows, P.rows_within(sizes, in_cap, m.max_batch))
        out_cap = max(out_cap, pack_offsets([rows * n for n in sizes])[1])
    return in_cap, out_cap


UID_SHARE = 2  # one uid may hold at most 1/UID_SHARE of a cap in all, so another uid always finds room


@dataclass(frozen=True)
class Caps:
    """The [sessions] caps in effect, in sessions and bytes. The per-uid caps are the configured ones, scaled
    down as the session cap is when the open-files limit bounds it, and never above 1/UID_SHARE of the cap in
    all (at least 1): one uid never takes every session. ``*_why``: what set a cap, and the setting to change."""

    sessions: int
    sessions_per_uid: int
    ring_bytes: int
    ring_bytes_per_uid: int
    sessions_why: str = "sessions.max_sessions"
    sessions_per_uid_why: str = "sessions.max_sessions_per_uid"
    ring_bytes_per_uid_why: str = "sessions.max_ring_mib_per_uid"

    @classmethod
    def of(cls, cfg: Config) -> Caps:
        """The caps in effect for ``cfg`` under this process's open-files limit; logged."""
        sessions, sessions_why, per_uid, per_uid_why = _session_caps(cfg.sessions)
        ring, ring_per_uid, ring_why = _ring_caps(cfg.sessions)
        log.info("session caps: %d sessions (%s), %d per uid (%s); ring memory %d MiB, %d MiB per uid (%s)",
                 sessions, sessions_why, per_uid, per_uid_why, ring >> 20, ring_per_uid >> 20, ring_why)
        return cls(sessions, per_uid, ring, ring_per_uid, sessions_why, per_uid_why, ring_why)


def _session_caps(sc: SessionsSection) -> tuple[int, str, int, str]:
    """Sessions in all and per uid, each with what set it: the open-files limit may lower the first, and then
    scales the second alike; the second is at most 1/UID_SHARE of the first, and at least 1."""
    sessions = min(sc.max_sessions, sessions_within_fd_limit())
    why, per_uid, per_uid_why = "sessions.max_sessions", sc.max_sessions_per_uid, "sessions.max_sessions_per_uid"
    to_raise = "sessions.max_sessions"  # what lets a uid hold more, once half of the total bounds it
    if sessions < sc.max_sessions:
        log.warning("the open-files limit allows %d sessions, below sessions.max_sessions (%d): raise "
                    "LimitNOFILE (ulimit -n) to %d", sessions, sc.max_sessions,
                    FD_RESERVE + FDS_PER_SESSION * sc.max_sessions)
        why, to_raise = "the open-files limit: raise LimitNOFILE", "LimitNOFILE"
        per_uid = sc.max_sessions_per_uid * sessions // sc.max_sessions
        per_uid_why = (f"sessions.max_sessions_per_uid {sc.max_sessions_per_uid}, scaled to the {sessions} sessions "
                       f"the open-files limit allows: raise LimitNOFILE")
    if per_uid > sessions // UID_SHARE and sessions >= UID_SHARE:  # a single session cannot be shared
        per_uid = sessions // UID_SHARE
        per_uid_why = (f"1/{UID_SHARE} of the {sessions} sessions in all, so that other uids find room: raise "
                       f"{to_raise}")
    return sessions, why, max(1, per_uid), per_uid_why


def _ring_caps(sc: SessionsSection) -> tuple[int, int, str]:
    """Ring bytes in all and per uid, and what set the second: at most 1/UID_SHARE of the first."""
    total = (sc.max_ring_mib << 20) or psutil.virtual_memory().total // 2
    per_uid, why = (sc.max_ring_mib_per_uid << 20) or total // 2, "sessions.max_ring_mib_per_uid"
    if per_uid > total // UID_SHARE:
        per_uid, why = total // UID_SHARE, f"1/{UID_SHARE} of sessions.max_ring_mib, so that other uids find room"
    return total, max(1, per_uid), why


def sessions_within_fd_limit() -> int:
    """How many sessions this process's RLIMIT_NOFILE leaves room for, after FD_RESERVE for everything else:
    past it a new connection could not even be accepted."""
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if soft == resource.RLIM_INFINITY:
        return 1 << 30
    return max(1, (soft - FD_RESERVE) // FDS_PER_SESSION)


class SessionTable:
    """Creates and finds sessions; owns their segments and counts them against the caps."""

    def __init__(self, cfg: Config, instance: str) -> None:
        self.cfg = cfg
        self.instance = instance
        self.caps = Caps.of(cfg)
        self.by_id: dict[int, BrokerSession] = {}
        self._next_id = 1
        self._sessions_of: Counter[int] = Counter()  # uid -> sessions
        self._bytes_of: Counter[int] = Counter()  # uid -> ring bytes
        self._bytes = 0

    def grantable(self, session_id: int, token: int) -> Grantable | None:
        """The handout's view of a live session with this token (broker.common.handout)."""
        s = self.by_id.get(session_id)
        if s is None or s.token != token or s.phase is Phase.CLOSING:
            return None
        return Grantable(s.segment, s.peer.uid)

    def create(self, hello: P.Hello, identity: bytes, peer: Peer, models: list[P.ModelInfo]) -> BrokerSession:
        sc = self.cfg.sessions
        if hello.protocol != P.PROTOCOL_VERSION:
            raise SessionError("BAD_VERSION", f"HELLO.protocol {hello.protocol}: this broker speaks "
                                              f"{P.PROTOCOL_VERSION}")
        slots = hello.slots or sc.default_slots
        if not 1 <= slots <= sc.max_slots:
            raise SessionError("BAD_HELLO", f"HELLO.slots: expected 1..{sc.max_slots} (sessions.max_slots), "
                                            f"got {slots}")
        if hello.max_items < 0:
            raise SessionError("BAD_HELLO", f"HELLO.max_items: expected >= 0 (0: the broker's default), got "
                                            f"{hello.max_items}")
        max_items = session_rows(hello.max_items, sc.default_max_items, models, slots, sc.default_ring_mib << 20)
        in_cap, out_cap = capacities(models, max_items)
        sid = self._next_id
        while sid in self.by_id:  # after 2**32 sessions the ids wrap; never reuse a live one
            sid = sid % 0xFFFF_FFFF + 1
        self._next_id = sid % 0xFFFF_FFFF + 1
        layout = RingLayout(sid, slots, in_cap, out_cap)
        limit = sc.max_session_mib << 20
        if layout.total_bytes > limit:
            raise SessionError(
                "TOO_LARGE", f"a ring of {slots} slots x {max_items} rows needs {layout.total_bytes >> 20} MiB, "
                f"over sessions.max_session_mib ({sc.max_session_mib}); ask for fewer slots or max_items",
            )
        self._check_caps(peer.uid, layout.total_bytes)
        segment = Segment.create(segment_name(self.instance, sid), layout)
        token = secrets.randbits(62)
        session = BrokerSession(sid, identity, peer, token, segment, max_items)
        self.by_id[sid] = session
        self._count(peer.uid, layout.total_bytes, +1)
        log.info("session %d for uid %d pid %d: %d slots of %d rows (%d+%d bytes), %.1f MiB", sid, peer.uid, peer.pid,
                 slots, max_items, in_cap, out_cap, layout.total_bytes / (1 << 20))
        return session

    def _check_caps(self, uid: int, nbytes: int) -> None:
        caps, mib = self.caps, 1 << 20
        held = sum(self._sessions_of.values())
        if held >= caps.sessions:
            raise SessionError("LIMIT", f"the broker holds {held} sessions, its cap ({caps.sessions_why}); try "
                                        "again later")
        if self._sessions_of[uid] >= caps.sessions_per_uid:
            raise SessionError("LIMIT", f"uid {uid} holds {self._sessions_of[uid]} sessions, the cap per user "
                                        f"({caps.sessions_per_uid_why}); close some first")
        if self._bytes + nbytes > caps.ring_bytes:
            raise SessionError("LIMIT", f"a ring of {nbytes // mib} MiB would take the rings of all sessions over "
                                        f"{caps.ring_bytes // mib} MiB (sessions.max_ring_mib); try again later")
        if self._bytes_of[uid] + nbytes > caps.ring_bytes_per_uid:
            raise SessionError("LIMIT", f"a ring of {nbytes // mib} MiB would take uid {uid}'s rings over "
                                        f"{caps.ring_bytes_per_uid // mib} MiB ({caps.ring_bytes_per_uid_why}); "
                                        "close some sessions or ask for fewer slots or max_items")

    def _count(self, uid: int, nbytes: int, sign: int) -> None:
        self._sessions_of[uid] += sign
        self._bytes_of[uid] += sign * nbytes
        self._bytes += sign * nbytes

    def uncount(self, session: BrokerSession) -> None:
        """A closing session no longer counts against the caps: its client is done with it."""
        if session.counted:
            session.counted = False
            self._count(session.peer.uid, session.segment.nbytes, -1)

    def destroy(self, session: BrokerSession) -> None:
        """Forget the session and close the broker's mapping; the kernel frees the ring when its client and
        workers have closed theirs. Only called once no worker maps the segment."""
        self.uncount(session)
        self.by_id.pop(session.session_id, None)
        session.segment.close()
        log.info("session %d closed", session.session_id)

    def destroy_all(self) -> None:
        for s in list(self.by_id.values()):
            self.destroy(s)

    def expired(self, now: float) -> list[BrokerSession]:
        return [s for s in self.by_id.values() if s.phase is not Phase.READY and s.deadline and now > s.deadline]
