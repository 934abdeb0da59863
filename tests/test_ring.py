"""broker.common.ring: the layout arithmetic, the span checks and real sealed segments."""

from __future__ import annotations

import ctypes
import fcntl
import os
import secrets
from collections.abc import Callable, Iterator

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shmbroker.broker.common import protocol as P
from shmbroker.broker.common import ring as R
from shmbroker.broker.common.protocol import SlotState
from shmbroker.broker.common.ring import RingError, RingLayout, Segment


# ---------------------------------------------------------------------------------------------------------
# Layout
# ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("in_cap", "out_cap", "out_offset", "stride"),
    [
        (0, 0, 256, 4096),
        (1, 1, 512, 4096),
        (256, 0, 512, 4096),
        (257, 0, 768, 4096),
        (1024, 4096 - 256 - 1024, 1280, 4096),
        (1024, 4096 - 256 - 1024 + 1, 1280, 8192),
        (1000, 1000, 1280, 4096),
        (1 << 20, 8, 256 + (1 << 20), (1 << 20) + 4096),
    ],
)
def test_layout_offsets(in_cap: int, out_cap: int, out_offset: int, stride: int) -> None:
    lay = RingLayout(session_id=1, n_slots=3, in_capacity=in_cap, out_capacity=out_cap)
    assert lay.in_offset == P.SLOT_HEADER_BYTES == 256
    assert lay.out_offset == out_offset
    assert lay.slot_stride == stride
    assert lay.total_bytes == R.HEADER_BYTES + 3 * stride
    assert lay.slot_base(0) == R.HEADER_BYTES
    assert lay.slot_base(2) == R.HEADER_BYTES + 2 * stride
    assert lay.input_base(1) == R.HEADER_BYTES + stride + 256
    assert lay.output_base(1) == R.HEADER_BYTES + stride + out_offset
    # the precomputed tables the hot paths index agree with the formulas
    assert lay.slot_bases == [lay.slot_base(i) for i in range(3)]
    assert lay.output_bases == [lay.output_base(i) for i in range(3)]


@settings(database=None, max_examples=300)
@given(st.integers(1, 64), st.integers(0, 1 << 24), st.integers(0, 1 << 24))
def test_layout_alignment_and_disjoint_regions(n_slots: int, in_cap: int, out_cap: int) -> None:
    lay = RingLayout(session_id=9, n_slots=n_slots, in_capacity=in_cap, out_capacity=out_cap)
    assert lay.slot_stride % R.SLOT_ALIGN == 0
    assert lay.total_bytes == R.HEADER_BYTES + n_slots * lay.slot_stride
    for slot in {0, n_slots - 1}:
        assert lay.slot_base(slot) % R.SLOT_ALIGN == 0
        assert lay.input_base(slot) % R.REGION_ALIGN == 0
        assert lay.output_base(slot) % R.REGION_ALIGN == 0
        # header | input | output, in order, inside the slot and not overlapping
        assert lay.input_base(slot) >= lay.slot_base(slot) + P.SLOT_HEADER_BYTES
        assert lay.input_base(slot) + in_cap <= lay.output_base(slot)
        assert lay.output_base(slot) + out_cap <= lay.slot_base(slot) + lay.slot_stride
    assert lay.output_base(n_slots - 1) + out_cap <= lay.total_bytes
    # no slack of a whole page: the stride is the smallest aligned size that fits
    assert lay.slot_stride - R.SLOT_ALIGN < lay.out_offset + out_cap


def test_layout_is_frozen_and_derived_fields_are_not_arguments() -> None:
    lay = RingLayout(1, 2, 3, 4)
    with pytest.raises(AttributeError):
        lay.n_slots = 5  # type: ignore[misc]
    with pytest.raises(TypeError):
        RingLayout(1, 2, 3, 4, 256)  # type: ignore[call-arg]
    assert lay == RingLayout(1, 2, 3, 4)


# ---------------------------------------------------------------------------------------------------------
# check_span / pack_offsets
# ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("offset", "nbytes", "capacity"),
    [(0, 0, 0), (0, 100, 100), (100, 0, 100), (99, 1, 100), (0, 0, 100), (50, 50, 100), (2**63, 1, 2**64)],
)
def test_check_span_accepts(offset: int, nbytes: int, capacity: int) -> None:
    R.check_span("input tensor", offset, nbytes, capacity)  # does not raise


@pytest.mark.parametrize(
    ("offset", "nbytes", "capacity"),
    [
        (0, 101, 100),
        (100, 1, 100),  # size = capacity - offset + 1
        (60, 41, 100),
        (101, 0, 100),
        (1, 0, 0),
        (0, 1, 0),
        (2**64 - 1, 0, 100),
        (0, 2**64 - 1, 100),
        (2**64 - 1, 2**64 - 1, 100),
        (2**64 - 1, 2, 2**64),  # would wrap to 1 in 64-bit arithmetic
        (2, 2**64 - 1, 2**64),
    ],
)
def test_check_span_refuses(offset: int, nbytes: int, capacity: int) -> None:
    with pytest.raises(RingError, match=r"output tensor 3: .*exceed the slot region"):
        R.check_span("output tensor 3", offset, nbytes, capacity)


@pytest.mark.parametrize(("offset", "nbytes"), [(-1, 0), (0, -1), (-1, 2), (-(2**63), 2**63), (5, -5)])
def test_check_span_refuses_negatives(offset: int, nbytes: int) -> None:
    with pytest.raises(RingError, match=r"input tensor: .*must not be negative"):
        R.check_span("input tensor", offset, nbytes, 100)


@settings(database=None, max_examples=500)
@given(st.integers(-(2**64), 2**65), st.integers(-(2**64), 2**65), st.integers(0, 2**64))
def test_check_span_matches_interval_arithmetic(offset: int, nbytes: int, capacity: int) -> None:
    inside = offset >= 0 and nbytes >= 0 and offset + nbytes <= capacity
    if inside:
        R.check_span("x", offset, nbytes, capacity)
    else:
        with pytest.raises(RingError):
            R.check_span("x", offset, nbytes, capacity)


def test_pack_offsets_examples() -> None:
    assert P.pack_offsets([]) == ([], 0)
    assert P.pack_offsets([1]) == ([0], 1)
    assert P.pack_offsets([1, 1]) == ([0, 64], 65)
    assert P.pack_offsets([64, 10]) == ([0, 64], 74)
    assert P.pack_offsets([65, 10, 3]) == ([0, 128, 192], 195)
    assert P.pack_offsets([0, 5]) == ([0, 0], 5)


@settings(database=None, max_examples=300)
@given(st.lists(st.integers(0, 1 << 20), max_size=16))
def test_pack_offsets_alignment(sizes: list[int]) -> None:
    offsets, end = P.pack_offsets(sizes)
    assert len(offsets) == len(sizes)
    assert all(o % P.TENSOR_ALIGN == 0 for o in offsets)
    prev_end = 0
    for o, n in zip(offsets, sizes, strict=True):
        assert prev_end <= o < prev_end + P.TENSOR_ALIGN  # aligned, and no more padding than needed
        prev_end = o + n
    assert end == prev_end


# ---------------------------------------------------------------------------------------------------------
# Segments: sealed memfds
# ---------------------------------------------------------------------------------------------------------
def _instance() -> str:
    return "t" + secrets.token_hex(4)  # a per-test instance: never a running broker's


SegmentFactory = Callable[..., Segment]


@pytest.fixture
def segments() -> Iterator[SegmentFactory]:
    """``segments(layout)`` creates a segment; all are closed after."""
    made: list[Segment] = []

    def create(layout: RingLayout) -> Segment:
        seg = Segment.create(R.segment_name(_instance(), layout.session_id), layout)
        made.append(seg)
        return seg

    try:
        yield create
    finally:
        for seg in made:
            seg.close()


@pytest.fixture
def opened() -> Iterator[list[Segment]]:
    """Segments a test opened (not created): closed after the test."""
    segs: list[Segment] = []
    try:
        yield segs
    finally:
        for seg in segs:
            seg.close()


LAYOUT = RingLayout(session_id=42, n_slots=4, in_capacity=1000, out_capacity=300)


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def reopen(seg: Segment, layout: RingLayout) -> Segment:
    """What a client or worker does with the descriptor the broker hands over."""
    return Segment.from_fd(seg.duplicate(), layout)


def test_segment_name_names_the_instance_and_session() -> None:
    assert R.segment_name("abc123", 7) == "shmb-abc123-s7"


def test_create_size_header_and_no_name_in_dev_shm(segments: SegmentFactory) -> None:
    before = set(os.listdir("/dev/shm"))
    seg = segments(LAYOUT)
    assert set(os.listdir("/dev/shm")) == before  # nothing to list, nothing to open by name
    st_ = os.fstat(seg.fd)
    assert st_.st_size == LAYOUT.total_bytes
    assert os.readlink(f"/proc/self/fd/{seg.fd}").startswith("/memfd:shmb-")
    assert seg.creator
    header = R.SEGMENT_HEADER.unpack_from(seg.buf, 0)
    assert header == (
        R.MAGIC, R.LAYOUT_VERSION, R.HEADER_BYTES, 42, 4, LAYOUT.slot_stride, P.SLOT_HEADER_BYTES,
        1000, 300, LAYOUT.total_bytes, os.getpid(),
    )  # fmt: skip
    # every slot starts FREE and zeroed
    assert all(seg.read_slot(i) == (SlotState.FREE, 0, 0, 0) for i in range(LAYOUT.n_slots))


def test_nobody_can_shrink_or_grow_a_segment(segments: SegmentFactory, opened: list[Segment]) -> None:
    seg = segments(LAYOUT)
    other = reopen(seg, LAYOUT)
    opened.append(other)
    for fd in (seg.fd, other.fd):
        for size in (0, LAYOUT.total_bytes // 2, LAYOUT.total_bytes * 2):
            with pytest.raises(PermissionError):
                os.ftruncate(fd, size)
        with pytest.raises(PermissionError):  # and nobody can lift the seals
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_WRITE)
    assert os.fstat(other.fd).st_size == LAYOUT.total_bytes


def test_from_fd_refuses_an_unsealed_descriptor(tmp_path) -> None:
    unsealed = os.memfd_create("shmb-x", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(unsealed, LAYOUT.total_bytes)
    with pytest.raises(RingError, match="sealed"):
        Segment.from_fd(unsealed, LAYOUT)
    plain = os.open(tmp_path / "ring", os.O_RDWR | os.O_CREAT, 0o600)
    os.ftruncate(plain, LAYOUT.total_bytes)
    with pytest.raises(RingError, match="sealed"):
        Segment.from_fd(plain, LAYOUT)
    for fd in (unsealed, plain):  # from_fd took ownership of both, and closed them
        with pytest.raises(OSError):
            os.fstat(fd)


def test_a_duplicate_has_its_own_lock(segments: SegmentFactory, opened: list[Segment]) -> None:
    """The broker's liveness probe (an exclusive flock on its descriptor) must see a client's shared lock."""
    seg = segments(LAYOUT)
    client = reopen(seg, LAYOUT)
    opened.append(client)
    fcntl.flock(client.fd, fcntl.LOCK_SH)
    with pytest.raises(BlockingIOError):
        fcntl.flock(seg.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    fcntl.flock(client.fd, fcntl.LOCK_UN)
    fcntl.flock(seg.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)


def test_open_matching_layout(segments: SegmentFactory, opened: list[Segment]) -> None:
    seg = segments(LAYOUT)
    other = reopen(seg, LAYOUT)
    opened.append(other)
    assert not other.creator
    assert other.layout == LAYOUT
    assert len(other.buf) == LAYOUT.total_bytes


@pytest.mark.parametrize(
    ("layout", "field"),
    [
        (RingLayout(43, 4, 1000, 300), "session_id"),
        (RingLayout(42, 4, 1024, 300), "in_capacity"),  # same stride and size, other capacity
        (RingLayout(42, 4, 1000, 200), "out_capacity"),
    ],
)
def test_open_with_mismatching_header_names_the_field(segments: SegmentFactory, layout: RingLayout, field: str) -> None:
    seg = segments(LAYOUT)
    assert layout.total_bytes == LAYOUT.total_bytes  # so that the header check, not the size check, refuses
    fds = _open_fds()
    with pytest.raises(RingError, match=f"segment header field {field} is") as info:
        reopen(seg, layout)
    # closed at once, not when the garbage collector gets to the traceback that still holds the mapping
    assert _open_fds() == fds
    del info


@pytest.mark.parametrize(
    ("offset", "value", "field"),
    [
        (0, b"SHMBRNG2", "magic"),
        (8, (2).to_bytes(4, "little"), "layout_version"),
        (12, (8192).to_bytes(4, "little"), "header_bytes"),
        (20, (5).to_bytes(4, "little"), "n_slots"),
        (24, (8192).to_bytes(8, "little"), "slot_stride"),
        (32, (128).to_bytes(8, "little"), "slot_header_bytes"),
        (56, (1).to_bytes(8, "little"), "total_bytes"),
    ],
)
def test_open_with_corrupt_header_names_the_field(
    segments: SegmentFactory, offset: int, value: bytes, field: str
) -> None:
    seg = segments(LAYOUT)
    seg.buf[offset : offset + len(value)] = value
    with pytest.raises(RingError, match=f"segment header field {field} is"):
        reopen(seg, LAYOUT)


def test_open_with_mismatching_size(segments: SegmentFactory) -> None:
    seg = segments(LAYOUT)
    bigger = RingLayout(42, 5, 1000, 300)
    fds = _open_fds()
    with pytest.raises(RingError, match=f"segment is {LAYOUT.total_bytes} bytes; the session announced") as info:
        reopen(seg, bigger)
    assert _open_fds() == fds
    del info


def test_publish_and_read_slot_across_mappings(segments: SegmentFactory, opened: list[Segment]) -> None:
    seg = segments(LAYOUT)
    other = reopen(seg, LAYOUT)
    opened.append(other)
    other.publish_slot(2, SlotState.SUBMITTED, generation=7, request_id=2**64 - 1, status=0)
    assert seg.read_slot(2) == (SlotState.SUBMITTED, 7, 2**64 - 1, 0)
    # the state word is the first 4 bytes of the slot
    base = LAYOUT.slot_base(2)
    assert P.STATE_WORD.unpack_from(seg.buf, base)[0] == SlotState.SUBMITTED
    assert P.SLOT_HEADER.unpack_from(seg.buf, base) == (SlotState.SUBMITTED, 7, 2**64 - 1, 0)
    # the neighbours are untouched
    assert seg.read_slot(1) == (SlotState.FREE, 0, 0, 0)
    assert seg.read_slot(3) == (SlotState.FREE, 0, 0, 0)

    seg.set_state(2, SlotState.DONE, status=5)
    assert other.read_slot(2) == (SlotState.DONE, 7, 2**64 - 1, 5)
    seg.publish_slot(2, SlotState.FAILED, generation=2**32 - 1, request_id=3, status=10)
    assert other.read_slot(2) == (SlotState.FAILED, 2**32 - 1, 3, 10)
    # the header at the segment start is not disturbed by slot writes
    assert R.SEGMENT_HEADER.unpack_from(other.buf, 0)[0] == R.MAGIC


@pytest.mark.parametrize("n_descs", [1, 2, 3, 4])  # 3 and 4 descriptors do not fit the hint capacity
def test_post_request_writes_the_slot_header_and_hint_of_protocol_4_2(segments: SegmentFactory, n_descs: int) -> None:
    seg = segments(LAYOUT)
    descs = bytes(range(64)) * n_descs
    base = LAYOUT.slot_base(1)
    seg.buf[base : base + P.SLOT_HEADER_BYTES] = b"\xee" * P.SLOT_HEADER_BYTES  # old garbage: a missed byte shows
    fits = seg.post_request(1, 3, 2**64 - 2, 2**32 - 1, 9, n_descs, 123456, descs)
    posted = bytes(seg.buf[base : base + P.SLOT_HEADER_BYTES])
    assert fits == (P.REQUEST.size + len(descs) <= P.HINT_CAPACITY)
    # the layout written out field by field, as a C client would
    reference = P.SLOT_HEADER.pack(SlotState.SUBMITTED, 2**32 - 1, 2**64 - 2, 0)
    if fits:
        reference += P.HINT.pack(P.REQUEST.size + len(descs), 3)
        reference += P.REQUEST.pack(2**64 - 2, 1, 2**32 - 1, 9, 0, n_descs, 123456) + descs
    else:
        reference += P.HINT.pack(0, 0)
    assert P.HINT.unpack_from(posted, P.HINT_AT) == ((P.REQUEST.size + len(descs), 3) if fits else (0, 0))
    assert seg.read_slot(1) == (SlotState.SUBMITTED, 2**32 - 1, 2**64 - 2, 0)
    # past the hint's end, the old bytes are left alone
    end = P.HINT_RECORD_AT + P.REQUEST.size + len(descs) if fits else P.HINT_RECORD_AT
    assert len(reference) == end
    assert posted[:end] == reference and posted[end:] == b"\xee" * (P.SLOT_HEADER_BYTES - end)


def test_a_taken_hint_reads_zero_and_the_rest_of_the_header_stays(segments: SegmentFactory,
                                                                   opened: list[Segment]) -> None:
    seg = segments(LAYOUT)
    worker = reopen(seg, LAYOUT)
    opened.append(worker)
    assert seg.post_request(2, 7, 11, 3, 1, 1, 0, b"\x01" * P.TENSOR.size)
    assert seg.hint_word(2) == (P.REQUEST.size + P.TENSOR.size) | (7 << 16)
    header = bytes(seg.buf[LAYOUT.slot_base(2) : LAYOUT.slot_base(2) + P.SLOT_HEADER_BYTES])
    worker.clear_hint(2)
    assert seg.hint_word(2) == 0 and seg.read_slot(2) == (SlotState.SUBMITTED, 3, 11, 0)
    after = bytes(seg.buf[LAYOUT.slot_base(2) : LAYOUT.slot_base(2) + P.SLOT_HEADER_BYTES])
    assert after[: P.HINT_AT] == header[: P.HINT_AT] and after[P.HINT_AT + 4 :] == header[P.HINT_AT + 4 :]
    assert not seg.post_request(1, 7, 12, 3, 1, 3, 0, b"\x01" * 3 * P.TENSOR.size)  # too big: no hint
    assert seg.hint_word(1) == 0


def test_last_slot_is_usable(segments: SegmentFactory) -> None:
    seg = segments(LAYOUT)
    last = LAYOUT.n_slots - 1
    seg.publish_slot(last, SlotState.DONE, 1, 2, 3)
    assert seg.read_slot(last) == (SlotState.DONE, 1, 2, 3)
    out = seg.output_view(last, 300 - 4, np.dtype("<f4"), (1,))
    out[0] = 1.5
    whole = np.frombuffer(seg.buf, np.uint8)
    assert out.ctypes.data == whole.ctypes.data + LAYOUT.output_base(last) + 296
    assert LAYOUT.output_base(last) + 300 <= len(whole) == LAYOUT.total_bytes
    assert bytes(whole[LAYOUT.output_base(last) + 296 :][:4]) == np.float32(1.5).tobytes()
    del out, whole


def test_views_write_through_between_mappings(segments: SegmentFactory, opened: list[Segment]) -> None:
    seg = segments(LAYOUT)
    other = reopen(seg, LAYOUT)
    opened.append(other)
    f32 = np.dtype("<f4")

    src = seg.input_view(1, 64, f32, (2, 3))
    src[...] = np.arange(6, dtype=f32).reshape(2, 3)
    dst = other.input_view(1, 64, f32, (2, 3))
    np.testing.assert_array_equal(dst, np.arange(6, dtype=f32).reshape(2, 3))
    dst[1, 2] = -1.0  # and back the other way
    assert src[1, 2] == -1.0

    out_w = other.output_view(1, 0, np.dtype("<i8"), (4,))
    out_w[:] = [1, 2, 3, 2**62]
    out_r = seg.output_view(1, 0, np.dtype("<i8"), (4,))
    assert out_r.tolist() == [1, 2, 3, 2**62]
    # the bytes are where the layout says
    raw = bytes(seg.buf[LAYOUT.input_base(1) + 64 : LAYOUT.input_base(1) + 64 + 24])
    assert raw == np.array([[0, 1, 2], [3, 4, -1]], dtype=f32).tobytes()
    raw_out = bytes(seg.buf[LAYOUT.output_base(1) : LAYOUT.output_base(1) + 32])
    assert raw_out == np.array([1, 2, 3, 2**62], dtype="<i8").tobytes()
    # input and output of one slot, and the same region of two slots, do not alias
    assert seg.input_view(0, 64, f32, (2, 3)).tolist() == [[0.0] * 3] * 2
    assert seg.input_view(1, 0, np.dtype("<i8"), (4,)).tolist() == [0] * 4
    del src, dst, out_w, out_r


@pytest.mark.parametrize(
    ("region", "offset", "shape"),
    [
        ("input", 1000 - 4, (2,)),
        ("input", 1000, (1,)),
        ("input", -4, (1,)),
        ("input", 0, (251,)),
        ("output", 0, (76,)),
        ("output", 2**64 - 1, (1,)),
    ],
)
def test_views_outside_the_region_are_refused(
    segments: SegmentFactory, region: str, offset: int, shape: tuple[int, ...]
) -> None:
    seg = segments(LAYOUT)
    view = seg.input_view if region == "input" else seg.output_view
    with pytest.raises(RingError, match=f"{region} tensor"):
        view(0, offset, np.dtype("<f4"), shape)


@pytest.mark.parametrize("shape", [(-2, -2), (0, -5), (-1, 4), (-4,)])
def test_views_with_a_negative_dimension_are_refused(segments: SegmentFactory, shape: tuple[int, ...]) -> None:
    seg = segments(LAYOUT)
    for view in (seg.input_view, seg.output_view):
        with pytest.raises(RingError, match=r"tensor: shape .* has a negative dimension"):
            view(0, 0, np.dtype("<f4"), shape)


def test_views_at_the_region_end_are_accepted(segments: SegmentFactory) -> None:
    seg = segments(LAYOUT)
    assert seg.input_view(0, 0, np.dtype("<f4"), (250,)).shape == (250,)
    assert seg.input_view(0, 1000, np.dtype("<f4"), (0,)).shape == (0,)
    assert seg.output_view(3, 296, np.dtype("<f4"), (1,)).shape == (1,)


def test_the_memory_outlives_the_creators_mapping(segments: SegmentFactory, opened: list[Segment]) -> None:
    """The broker closing its mapping (a session ended) leaves a client's and a worker's intact."""
    seg = segments(LAYOUT)
    other = reopen(seg, LAYOUT)
    opened.append(other)
    seg.publish_slot(0, SlotState.DONE, 1, 1, 0)
    seg.close()
    assert other.read_slot(0) == (SlotState.DONE, 1, 1, 0)


def test_close_with_live_views_keeps_them_valid(segments: SegmentFactory) -> None:
    seg = segments(LAYOUT)
    view = seg.input_view(0, 0, np.dtype("<u1"), (8,))
    fds = _open_fds()
    seg.close()
    assert _open_fds() == fds - 1  # the descriptor goes now; the mapping when the view does
    view[:] = 7  # still mapped
    assert view.tolist() == [7] * 8
    del view


def test_address_is_the_mapping_and_does_not_pin_it(segments: SegmentFactory, opened: list[Segment]) -> None:
    seg = segments(LAYOUT)
    other = reopen(seg, LAYOUT)
    opened.append(other)
    assert seg.nbytes == LAYOUT.total_bytes and seg.address % 4096 == 0
    # bytes read at address + offset are the ones another mapping wrote at that offset
    other.input_view(2, 8, np.dtype("<u1"), (4,))[:] = [9, 8, 7, 6]
    at = seg.address + LAYOUT.input_base(2) + 8
    assert ctypes.string_at(at, 4) == bytes([9, 8, 7, 6])
    seg.close()  # the address accessor left no export behind: the mapping goes now
    with open("/proc/self/maps") as maps:
        assert f"{seg.address:x}-" not in maps.read()
