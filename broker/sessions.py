"""The broker's session table: sizing and creating rings, and each session's handshake state.

A session moves SETUP_SENT -> ATTACHING -> READY -> CLOSING -> gone. Its segment is unlinked only when
no worker still maps it (every attached worker answered DETACH_OK, or died).
"""

from __future__ import annotations

import enum
import logging
import math
import secrets
from dataclasses import dataclass, field

import numpy as np

from broker import protocol as P
from broker.config import Config
from broker.ring import RingLayout, Segment, new_segment_name, pack_offsets

log = logging.getLogger(__name__)


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
    pid: int
    token: int
    segment: Segment
    max_items: int
    phase: Phase = Phase.SETUP_SENT
    deadline: float = 0.0  # of the current handshake step
    attached: set[int] = field(default_factory=set)  # workers that map the segment
    pending_attach: set[int] = field(default_factory=set)
    pending_detach: set[int] = field(default_factory=set)
    reply_endpoints: dict[int, str] = field(default_factory=dict)
    by_lock: bool = False  # liveness by the client's segment lock (broker.liveness), else by its pid

    def setup(self, models: list[P.ModelInfo], timeout_ms: int) -> P.Setup:
        lay = self.segment.layout
        return P.Setup(
            self.session_id, self.segment.name, lay.total_bytes, lay.n_slots, lay.slot_stride, lay.in_capacity,
            lay.out_capacity, self.max_items, models, timeout_ms,
        )

    def attach_msg(self) -> P.Attach:
        lay = self.segment.layout
        return P.Attach(
            self.session_id, self.token, self.segment.name, lay.total_bytes, lay.n_slots, lay.slot_stride,
            lay.in_capacity, lay.out_capacity, self.max_items,
        )


def item_bytes(spec: P.TensorSpec) -> int:
    return math.prod(spec.shape[1:]) * np.dtype(spec.dtype).itemsize


def session_rows(asked: int, default: int, models: list[P.ModelInfo]) -> int:
    """Rows a request of a session may have: what the client asked (0: ``default``; 0 again: the largest
    ``max_batch``), never above the largest ``max_batch``."""
    largest = max(m.max_batch for m in models)
    return min(asked or default or largest, largest)


def capacities(models: list[P.ModelInfo], max_items: int) -> tuple[int, int]:
    """Bytes of the input and output regions a slot needs to hold a request of up to ``max_items`` rows."""
    in_cap = out_cap = 0
    for m in models:
        rows = min(max_items, m.max_batch)
        in_cap = max(in_cap, pack_offsets([rows * item_bytes(s) for s in m.inputs])[1])
        out_cap = max(out_cap, pack_offsets([rows * item_bytes(s) for s in m.outputs])[1])
    return in_cap, out_cap


class SessionTable:
    """Creates and finds sessions; owns their segments (the broker is the only creator and unlinker)."""

    def __init__(self, cfg: Config, instance: str) -> None:
        self.cfg = cfg
        self.instance = instance
        self.by_id: dict[int, BrokerSession] = {}
        self._next_id = 1

    def create(self, hello: P.Hello, identity: bytes, models: list[P.ModelInfo]) -> BrokerSession:
        sc = self.cfg.sessions
        if hello.protocol != P.PROTOCOL_VERSION:
            raise SessionError("BAD_VERSION", f"HELLO.protocol {hello.protocol}: this broker speaks "
                                              f"{P.PROTOCOL_VERSION}")
        if not 0 < hello.pid < 2**31:
            raise SessionError("BAD_HELLO", f"HELLO.pid: expected a process id, got {hello.pid}")
        slots = hello.slots or sc.default_slots
        if not 1 <= slots <= sc.max_slots:
            raise SessionError("BAD_HELLO", f"HELLO.slots: expected 1..{sc.max_slots} (sessions.max_slots), "
                                            f"got {slots}")
        if hello.max_items < 0:
            raise SessionError("BAD_HELLO", f"HELLO.max_items: expected >= 0 (0: the broker's default), got "
                                            f"{hello.max_items}")
        max_items = session_rows(hello.max_items, sc.default_max_items, models)
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
        segment = Segment.create(new_segment_name(self.instance), layout, self.cfg.file_mode, self.cfg.group_id())
        token = secrets.randbits(62)
        session = BrokerSession(sid, identity, hello.pid, token, segment, max_items)
        self.by_id[sid] = session
        log.info("session %d for pid %d: %d slots of %d+%d bytes", sid, hello.pid, slots, in_cap, out_cap)
        return session

    def destroy(self, session: BrokerSession) -> None:
        """Unmap and unlink; only called once no worker maps the segment."""
        self.by_id.pop(session.session_id, None)
        session.segment.unlink()
        session.segment.close()
        log.info("session %d closed", session.session_id)

    def destroy_all(self) -> None:
        for s in list(self.by_id.values()):
            self.destroy(s)

    def expired(self, now: float) -> list[BrokerSession]:
        return [s for s in self.by_id.values() if s.phase is not Phase.READY and s.deadline and now > s.deadline]
