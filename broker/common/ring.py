"""The session ring: one sealed shared-memory segment (a memfd) of fixed-size slots, and the checks on every
descriptor.

Byte layout (all little-endian; docs/PROTOCOL.md has the same table):

    segment = header (HEADER_BYTES) | slot 0 | slot 1 | ... each ``slot_stride`` bytes, page aligned
    slot    = slot header (SLOT_HEADER_BYTES) | input region (in_capacity) | output region (out_capacity)

Ordering rule: a writer writes the payload, then the slot header's other words, then the state word last;
a reader reads the state word first.

A segment has no name in any file system: the broker creates it with ``memfd_create``, seals its size
(``F_SEAL_SHRINK | F_SEAL_GROW``), and hands a descriptor to the session's client and workers only
(broker.common.handout). Nobody can shrink it under another process's mapping (no SIGBUS), and the kernel frees it
when the last descriptor and mapping go.
"""

from __future__ import annotations

import ctypes
import fcntl
import logging
import math
import mmap
import os
import struct
import weakref
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from shmbroker.broker.common.protocol import (
    HINT_AT,
    HINT_CAPACITY,
    HINT_RECORD_AT,
    NO_HINT,
    POST,
    REQUEST,
    SLOT_HEADER,
    SLOT_HEADER_BYTES,
    SLOT_TAIL,
    STATE_WORD,
    STATUS_AT,
    SessionRing,
    SlotState,
)

log = logging.getLogger(__name__)

MAGIC = b"SHMBRNG1"
LAYOUT_VERSION = 1
HEADER_BYTES = 4096
REGION_ALIGN = 256
SLOT_ALIGN = 4096
NAME_PREFIX = "shmb-"  # of the memfd's name, seen only in /proc/PID/maps and /proc/PID/fd
SIZE_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW

# magic, version, header_bytes, session_id, n_slots, slot_stride, slot_header, in_cap, out_cap, total, pid
SEGMENT_HEADER = struct.Struct("<8sIIIIQQQQQI")
class RingError(ValueError):
    """A segment or a descriptor that does not fit the ring; the text names the field."""


def align(n: int, a: int) -> int:
    return (n + a - 1) // a * a


@dataclass(frozen=True)
class RingLayout:
    """Where everything lies in a segment; both ends derive it from the same four numbers."""

    session_id: int
    n_slots: int
    in_capacity: int
    out_capacity: int
    in_offset: int = field(init=False, default=SLOT_HEADER_BYTES)
    out_offset: int = field(init=False)
    slot_stride: int = field(init=False)
    total_bytes: int = field(init=False)
    slot_bases: list[int] = field(init=False, repr=False, compare=False)
    input_bases: list[int] = field(init=False, repr=False, compare=False)
    output_bases: list[int] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        out_offset = SLOT_HEADER_BYTES + align(self.in_capacity, REGION_ALIGN)
        stride = align(out_offset + self.out_capacity, SLOT_ALIGN)
        object.__setattr__(self, "out_offset", out_offset)
        object.__setattr__(self, "slot_stride", stride)
        object.__setattr__(self, "total_bytes", HEADER_BYTES + self.n_slots * stride)
        # the hot paths index these instead of computing offsets per request
        object.__setattr__(self, "slot_bases", [HEADER_BYTES + i * stride for i in range(self.n_slots)])
        object.__setattr__(self, "input_bases", [b + SLOT_HEADER_BYTES for b in self.slot_bases])
        object.__setattr__(self, "output_bases", [b + out_offset for b in self.slot_bases])

    @classmethod
    def of(cls, ring: SessionRing) -> RingLayout:
        """The layout of the ring that SETUP or ATTACH announces (its slot_stride and segment_bytes are the
        ones this derives, when the broker is of this version)."""
        return cls(ring.session_id, ring.n_slots, ring.in_capacity, ring.out_capacity)

    def slot_base(self, slot: int) -> int:
        return self.slot_bases[slot]

    def input_base(self, slot: int) -> int:
        return self.input_bases[slot]

    def output_base(self, slot: int) -> int:
        return self.output_bases[slot]


def check_span(field: str, offset: int, nbytes: int, capacity: int) -> None:
    """Raise RingError unless [offset, offset+nbytes) lies inside [0, capacity); overflow-safe as in C."""
    if offset < 0 or nbytes < 0:
        raise RingError(f"{field}: offset {offset} and size {nbytes} must not be negative")
    if offset > capacity or nbytes > capacity - offset:
        raise RingError(f"{field}: bytes [{offset}, {offset}+{nbytes}) exceed the slot region of {capacity} bytes")


def segment_name(instance: str, session_id: int) -> str:
    """The memfd's name: the project prefix, the broker instance and the session (for a person reading
    /proc/PID/maps; nothing looks a segment up by name)."""
    return f"{NAME_PREFIX}{instance}-s{session_id}"


def _close_mapping(mm: mmap.mmap, fd: int) -> None:
    try:
        mm.close()
    except BufferError:
        # numpy views still hold the buffer; the mapping goes when they do
        log.debug("segment mapping still exported; left to the garbage collector")
    os.close(fd)


class Segment:
    """A mapped ring segment. ``close()`` unmaps and closes this process's descriptor."""

    def __init__(self, name: str, fd: int, size: int, layout: RingLayout, creator: bool) -> None:
        self.name = name
        self.layout = layout
        self.creator = creator
        self._mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        self.buf = memoryview(self._mm)
        # State words are stored through this: one aligned 4-byte store each. struct.pack_into zero-fills
        # before it writes, so a reader polling the word (a spinning client or worker) would see 0 for an
        # instant between SUBMITTED and DONE. (Native order: little-endian on x86-64 and aarch64, as the
        # protocol's.)
        self._words = self.buf.cast("I")
        self.nbytes = size
        self.fd = fd  # open until the mapping goes; the client's liveness lock lives on it (broker.common.liveness)
        self.address = _base_address(self._mm)  # for cudaHostRegister and DMA; valid until close()
        self._finalizer = weakref.finalize(self, _close_mapping, self._mm, fd)

    @classmethod
    def create(cls, name: str, layout: RingLayout) -> Segment:
        """A new sealed segment of ``layout.total_bytes`` (zero-filled pages, allocated as they are first
        touched) with its header written."""
        fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fd, layout.total_bytes)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SIZE_SEALS | fcntl.F_SEAL_SEAL)
            seg = cls(name, fd, layout.total_bytes, layout, creator=True)
        except BaseException:
            os.close(fd)
            raise
        SEGMENT_HEADER.pack_into(
            seg.buf, 0, MAGIC, LAYOUT_VERSION, HEADER_BYTES, layout.session_id, layout.n_slots,
            layout.slot_stride, SLOT_HEADER_BYTES, layout.in_capacity, layout.out_capacity,
            layout.total_bytes, os.getpid(),
        )
        return seg

    @classmethod
    def from_fd(cls, fd: int, expected: RingLayout) -> Segment:
        """Map a received segment descriptor (taking ownership of ``fd``) and check that it is sealed against
        resizing, its size and its header match the layout the broker announced."""
        try:
            try:
                seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
            except OSError:
                seals = 0  # not a memfd
            if seals & SIZE_SEALS != SIZE_SEALS:
                raise RingError("segment descriptor: not a memfd sealed against shrinking and growing")
            size = os.fstat(fd).st_size
            if size != expected.total_bytes:
                raise RingError(f"segment is {size} bytes; the session announced {expected.total_bytes}")
            seg = cls(_memfd_name(fd), fd, size, expected, creator=False)
        except BaseException:
            os.close(fd)
            raise
        seg._verify_header()
        return seg

    def duplicate(self) -> int:
        """A new descriptor of this segment with an open file description of its own, for another process:
        its liveness lock must not be this one's (broker.common.liveness). The caller closes it."""
        return os.open(f"/proc/self/fd/{self.fd}", os.O_RDWR | os.O_CLOEXEC)

    def _verify_header(self) -> None:
        magic, version, hbytes, sid, n_slots, stride, shb, in_cap, out_cap, total, _pid = (
            SEGMENT_HEADER.unpack_from(self.buf, 0)
        )
        lay = self.layout
        checks = {
            "magic": (magic, MAGIC), "layout_version": (version, LAYOUT_VERSION),
            "header_bytes": (hbytes, HEADER_BYTES), "session_id": (sid, lay.session_id),
            "n_slots": (n_slots, lay.n_slots), "slot_stride": (stride, lay.slot_stride),
            "slot_header_bytes": (shb, SLOT_HEADER_BYTES), "in_capacity": (in_cap, lay.in_capacity),
            "out_capacity": (out_cap, lay.out_capacity), "total_bytes": (total, lay.total_bytes),
        }
        for key, (got, want) in checks.items():
            if got != want:
                self.close()
                raise RingError(f"segment header field {key} is {got!r}, expected {want!r}")

    # -- slot header --------------------------------------------------------------------------------------
    def read_slot(self, slot: int) -> tuple[int, int, int, int]:
        """(state, generation, request_id, status) of a slot; the state word is read first."""
        base = self.layout.slot_base(slot)
        state = STATE_WORD.unpack_from(self.buf, base)[0]
        _s, gen, rid, status = SLOT_HEADER.unpack_from(self.buf, base)
        return state, gen, rid, status

    def publish_slot(self, slot: int, state: int, generation: int, request_id: int, status: int) -> None:
        """Write the slot header with the state word last (after the payload is in place)."""
        base = self.layout.slot_base(slot)
        SLOT_TAIL.pack_into(self.buf, base + STATE_WORD.size, generation, request_id, status)
        self._words[base >> 2] = state

    def post_request(self, slot: int, worker_id: int, request_id: int, generation: int, model_id: int,
                     n_tensors: int, timeout_us: int, descs: bytes) -> bool:
        """A client's request in its slot header: the hint for ``worker_id`` (PROTOCOL 4.2, its descriptors
        ``descs``, its record with first_tensor 0), generation and request id, status 0, then the state word
        SUBMITTED, last; one pack for all but the descriptors. Returns whether the hint fitted (else the hint
        word is 0: no hint)."""
        base = self.layout.slot_bases[slot]
        n = REQUEST.size + len(descs)
        if n > HINT_CAPACITY:
            NO_HINT.pack_into(self.buf, base + STATE_WORD.size, generation, request_id, 0, 0, 0)
        else:
            POST.pack_into(self.buf, base + STATE_WORD.size, generation, request_id, 0, n, worker_id,
                           request_id, slot, generation, model_id, 0, n_tensors, timeout_us)
            at = base + HINT_RECORD_AT + REQUEST.size
            self.buf[at : at + len(descs)] = descs
        self._words[base >> 2] = SlotState.SUBMITTED
        return n <= HINT_CAPACITY

    def hint_word(self, slot: int) -> int:
        """The slot header's hint word (hint_bytes and hint_worker, +20): 0 once a worker took the hint."""
        return self._words[(self.layout.slot_bases[slot] + HINT_AT) >> 2]

    def clear_hint(self, slot: int) -> None:
        """A worker that admitted the request from its hint says so (PROTOCOL 4.2): one 4-byte store of 0."""
        self._words[(self.layout.slot_bases[slot] + HINT_AT) >> 2] = 0

    def set_state(self, slot: int, state: int, status: int) -> None:
        base = self.layout.slot_bases[slot]
        self._words[(base + STATUS_AT) >> 2] = status
        self._words[base >> 2] = state

    def set_states(self, slots: list[int], state: int, statuses: int | list[int]) -> None:
        """``set_state`` for each slot: one status for all, or one each."""
        words, bases = self._words, self.layout.slot_bases
        if isinstance(statuses, int):  # the common case, a whole batch OK: no list of statuses is built
            for slot in slots:
                base = bases[slot]
                words[(base + STATUS_AT) >> 2] = statuses
                words[base >> 2] = state
            return
        for slot, status in zip(slots, statuses, strict=True):
            base = bases[slot]
            words[(base + STATUS_AT) >> 2] = status
            words[base >> 2] = state

    # -- tensor views ---------------------------------------------------------------------------------------
    def input_view(self, slot: int, offset: int, dtype: np.dtype[Any], shape: tuple[int, ...]) -> np.ndarray:
        return self._view(self.layout.input_base(slot), self.layout.in_capacity, offset, dtype, shape, "input")

    def output_view(self, slot: int, offset: int, dtype: np.dtype[Any], shape: tuple[int, ...]) -> np.ndarray:
        return self._view(self.layout.output_base(slot), self.layout.out_capacity, offset, dtype, shape, "output")

    def _view(
        self, base: int, cap: int, offset: int, dtype: np.dtype[Any], shape: tuple[int, ...], what: str
    ) -> np.ndarray:
        if min(shape, default=0) < 0:  # (-2, -2) has a positive product: the span check alone lets it by
            raise RingError(f"{what} tensor: shape {list(shape)} has a negative dimension")
        count = math.prod(shape)
        check_span(f"{what} tensor", offset, count * dtype.itemsize, cap)
        return np.frombuffer(self.buf, dtype=dtype, count=count, offset=base + offset).reshape(shape)

    def close(self) -> None:
        """Unmap now if no view is left, else when the last view goes."""
        try:
            self._words.release()
            self.buf.release()
        except BufferError:
            log.debug("views of session %d's segment still exist", self.layout.session_id)
        self._finalizer()


def held_rings(pids: list[int], instance: str) -> dict[str, str]:
    """The rings of broker ``instance`` that processes ``pids`` hold open or mapped, by name, each with a
    ``/proc`` path that opens it ("" when only mapped): what a leak check or an operator can see of them."""
    prefix = f"/memfd:{NAME_PREFIX}{instance}-"
    found: dict[str, str] = {}
    for pid in pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:  # gone, or not ours to read
            continue
        for fd in fds:
            try:
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if link.startswith(prefix):
                found.setdefault(_memfd_link_name(link), f"/proc/{pid}/fd/{fd}")
        try:
            with open(f"/proc/{pid}/maps") as maps:
                for line in maps:
                    at = line.find(prefix)
                    if at >= 0:
                        found.setdefault(_memfd_link_name(line[at:].strip()), "")
        except OSError:
            continue
    return found


def _memfd_name(fd: int) -> str:
    """The name the creator gave the memfd ``fd``."""
    return _memfd_link_name(os.readlink(f"/proc/self/fd/{fd}"))


def _memfd_link_name(link: str) -> str:
    """A memfd's name from how /proc shows it (``/memfd:NAME (deleted)``)."""
    return link.removeprefix("/memfd:").removesuffix(" (deleted)")


def _base_address(mm: mmap.mmap) -> int:
    """The mapping's virtual address. The ctypes view exports the buffer; it is dropped at once so that
    ``mmap.close`` (which refuses while exports exist) still unmaps."""
    view = ctypes.c_char.from_buffer(mm)
    try:
        return ctypes.addressof(view)
    finally:
        del view
