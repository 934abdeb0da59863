"""Every ZeroMQ message of shmbroker, in one module that the broker, the workers and the clients import.

A message is two frames: frame 0 is the 4-byte envelope ``<u16 version, u16 kind>``, frame 1 the body.
Control messages (handshake, supervision, health) carry a JSON body decoded into a typed ``msgspec.Struct``;
the data plane (``SUBMIT``, ``DONE``) carries fixed-size little-endian binary records. Payload bytes never
travel here: only slot descriptors do. docs/PROTOCOL.md describes the same bytes for C programmers.
"""

from __future__ import annotations

import collections
import enum
import json
import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Annotated, Any, Self, TypeVar

import msgspec
import msgspec.inspect
import numpy as np

PROTOCOL_VERSION = 2
MAX_DIMS = 8
# A ring's most slots, the ceiling of sessions.max_slots (broker/common/config.py takes it from here): the
# bound on the requests in flight that a SUBMIT carries (max_submit_bytes).
MAX_SLOTS = 4096
HELLO_NAME_MAX = 256  # Hello.name's most characters: a bound on the HELLO, so on the control socket's frames


class ProtocolError(ValueError):
    """A message that does not follow this module's format; the text names the part that is wrong."""


class VersionError(ProtocolError):
    """The envelope's protocol version is not the one this side speaks."""


class MsgKind(enum.IntEnum):
    """The first frame's kind: what the body is and how to decode it."""

    # client <-> broker (control socket)
    HELLO = 1
    SETUP = 2
    ATTACHED = 3
    READY = 4
    BYE = 5
    WORKER_DOWN = 6
    WORKER_UP = 7
    HEALTH = 8
    HEALTH_REPLY = 9
    STATS = 10
    STATS_REPLY = 11
    ERROR = 12
    # worker <-> broker (workers socket)
    WORKER_HELLO = 20
    WORKER_READY = 21
    WORKER_FAILED = 22
    ATTACH = 23
    ATTACH_OK = 24
    DETACH = 25
    DETACH_OK = 26
    WORKER_STATS = 27
    WORKER_STATS_REPLY = 28
    SHUTDOWN = 29
    ATTACH_FAILED = 30
    WORKER_PROGRESS = 31
    # client <-> worker (data plane, binary bodies)
    SUBMIT = 32
    DONE = 33
    # caller <-> inline gateway (frontend/inline.py's sockets only; section 10 of docs/PROTOCOL.md)
    INLINE_REQUEST = 40
    INLINE_REPLY = 41
    INLINE_MODELS = 42  # body {}: what the gateway serves
    INLINE_MODELS_REPLY = 43  # body InlineModelsReply: the models SETUP carries and the gateway's rows limit
    # client or worker <-> broker (the ring handout socket, binary records; the ring travels by SCM_RIGHTS)
    RING_REQUEST = 50
    RING_GRANT = 51


class Status(enum.IntEnum):
    """Per-request result code, carried in DONE and in the slot header."""

    OK = 0
    TIMEOUT = 1
    OVERLOADED = 2
    BAD_INPUT = 3
    UNKNOWN_MODEL = 4
    BAD_DTYPE = 5
    BAD_SHAPE = 6
    BAD_SIZE = 7
    BAD_SLOT = 8
    STALE_GENERATION = 9
    WORKER_DIED = 10
    INTERNAL = 11
    SHUTTING_DOWN = 12
    BAD_SESSION = 13
    BAD_IMAGE = 14  # a row of an image input is not a JPEG or PNG this worker decodes, or is over a limit


class DType(enum.IntEnum):
    """Tensor element types on the wire; names follow the KServe v2 datatypes."""

    FP32 = 1
    FP16 = 2
    FP64 = 3
    INT8 = 4
    UINT8 = 5
    INT16 = 6
    INT32 = 7
    INT64 = 8
    BOOL = 9
    UINT16 = 10
    UINT32 = 11
    UINT64 = 12


_NUMPY_OF: dict[DType, np.dtype[Any]] = {
    DType.FP32: np.dtype("<f4"),
    DType.FP16: np.dtype("<f2"),
    DType.FP64: np.dtype("<f8"),
    DType.INT8: np.dtype("i1"),
    DType.UINT8: np.dtype("u1"),
    DType.INT16: np.dtype("<i2"),
    DType.INT32: np.dtype("<i4"),
    DType.INT64: np.dtype("<i8"),
    DType.BOOL: np.dtype("?"),
    DType.UINT16: np.dtype("<u2"),
    DType.UINT32: np.dtype("<u4"),
    DType.UINT64: np.dtype("<u8"),
}
_DTYPE_OF: dict[np.dtype[Any], DType] = {v: k for k, v in _NUMPY_OF.items()}


def numpy_dtype(code: DType) -> np.dtype[Any]:
    return _NUMPY_OF[code]


def dtype_code(dt: np.dtype[Any] | str) -> DType:
    """The wire code of a numpy dtype; raises ProtocolError for a type the protocol does not carry."""
    d = np.dtype(dt).newbyteorder("<") if np.dtype(dt).byteorder == ">" else np.dtype(dt)
    code = _DTYPE_OF.get(d)
    if code is None:
        raise ProtocolError(f"dtype {np.dtype(dt).name} is not one the protocol carries")
    return code


_DTYPE_BY_INT = {int(d): d for d in DType}


def dtype_from_int(value: int) -> DType | None:
    return _DTYPE_BY_INT.get(value)


# ---------------------------------------------------------------------------------------------------------
# Envelope
# ---------------------------------------------------------------------------------------------------------
ENVELOPE = struct.Struct("<HH")


def envelope(kind: MsgKind) -> bytes:
    return ENVELOPE.pack(PROTOCOL_VERSION, kind)


# The data plane's envelopes, compared whole on the hot paths, and the inline gateway's
SUBMIT_ENVELOPE = envelope(MsgKind.SUBMIT)
DONE_ENVELOPE = envelope(MsgKind.DONE)
INLINE_REQUEST_ENVELOPE = envelope(MsgKind.INLINE_REQUEST)
INLINE_REPLY_ENVELOPE = envelope(MsgKind.INLINE_REPLY)
INLINE_MODELS_ENVELOPE = envelope(MsgKind.INLINE_MODELS)
INLINE_MODELS_REPLY_ENVELOPE = envelope(MsgKind.INLINE_MODELS_REPLY)


def read_envelope(frames: list[bytes]) -> MsgKind:
    """The kind of a two-frame message; ProtocolError names what is off (frame count, version, kind)."""
    if len(frames) != 2:
        raise ProtocolError(f"expected 2 frames, got {len(frames)}")
    head = frames[0]
    if len(head) != ENVELOPE.size:
        raise ProtocolError(f"frame 0 must be {ENVELOPE.size} bytes, got {len(head)}")
    version, kind = ENVELOPE.unpack(head)
    if version != PROTOCOL_VERSION:
        raise VersionError(f"protocol version {version} is not supported (this side speaks {PROTOCOL_VERSION})")
    try:
        return MsgKind(kind)
    except ValueError:
        raise ProtocolError(f"unknown message kind {kind}") from None


# ---------------------------------------------------------------------------------------------------------
# Control messages (JSON bodies)
# ---------------------------------------------------------------------------------------------------------
class InputKind:
    """What a client sends for a model input (``TensorSpec.kind``; the config's ``models.NAME.input``)."""

    TENSOR = "tensor"  # an array of ``dtype`` and ``shape``, packed as pack_offsets says
    IMAGE = "image"  # encoded images (JPEG, PNG), one a row, of any length up to ``max_bytes``: IMAGE_ROW
    FRAMES = "frames"  # uint8 HWC frames of the declared shape [-1, H, W, 3]: a tensor on the wire


INPUT_KINDS = (InputKind.TENSOR, InputKind.IMAGE, InputKind.FRAMES)


class TensorSpec(msgspec.Struct, frozen=True):
    """A model input or output: ``shape[0] == -1`` is the batch dimension. An input of kind IMAGE has dtype
    "uint8" and shape [-1]: each row is one encoded image of 1..``max_bytes`` bytes (PROTOCOL 5.4)."""

    name: str
    dtype: str  # numpy name, e.g. "float32"
    shape: list[int]
    kind: str = InputKind.TENSOR
    max_bytes: int = 0  # kind IMAGE: the most bytes of one row (the model's max_image_bytes)


class ModelInfo(msgspec.Struct, frozen=True):
    model_id: int
    name: str
    max_batch: int
    inputs: list[TensorSpec]
    outputs: list[TensorSpec]
    timeout_ms: int


class WorkerInfo(msgspec.Struct, frozen=True):
    worker_id: int
    device: str
    endpoint: str  # where clients connect their SUBMIT socket
    reply_endpoint: str  # where this session's DONE messages come from
    models: list[str]


class Hello(msgspec.Struct, frozen=True):
    protocol: int
    pid: int
    slots: int = 0  # 0: the broker's default
    max_items: int = 0  # items per request a slot holds; 0: the broker's default
    name: Annotated[str, msgspec.Meta(max_length=HELLO_NAME_MAX)] = ""


class SessionRing(msgspec.Struct, frozen=True):
    """A session and the geometry of its ring, which the broker tells the client (SETUP) and each worker
    (ATTACH) in the same fields: both messages are a SessionRing with fields of their own after these."""

    session_id: int
    token: int  # the session's secret: asks for the ring (RING_REQUEST), and authenticates each SUBMIT
    segment_bytes: int
    n_slots: int
    slot_stride: int
    in_capacity: int
    out_capacity: int
    max_items: int

    @classmethod
    def of(cls, ring: SessionRing, **rest: Any) -> Self:
        """This kind of message with ``ring``'s fields, copied by name, and its own fields ``rest``."""
        return cls(**{name: getattr(ring, name) for name in SessionRing.__struct_fields__}, **rest)


class Setup(SessionRing, frozen=True):
    models: list[ModelInfo]
    handshake_timeout_ms: int


class Attached(msgspec.Struct, frozen=True):
    session_id: int


class Ready(msgspec.Struct, frozen=True):
    session_id: int
    token: int
    workers: list[WorkerInfo]


class Bye(msgspec.Struct, frozen=True):
    session_id: int


class WorkerDown(msgspec.Struct, frozen=True):
    worker_id: int
    reason: str


class WorkerUp(msgspec.Struct, frozen=True):
    worker: WorkerInfo


class Health(msgspec.Struct, frozen=True):
    wait_ms: int = 0  # 0: answer now; otherwise answer once ready or after wait_ms


class ModelHealth(msgspec.Struct, frozen=True):
    name: str
    ready: bool
    workers_ready: int
    workers_total: int
    reason: str = ""


class HealthReply(msgspec.Struct, frozen=True):
    ready: bool
    models: list[ModelHealth]
    reason: str = ""


class ProbeResult(msgspec.Struct, frozen=True):
    """One health probe's result, a JSON line on the prober process's stdout (broker/ops/prober_process.py) to
    the broker; ``error`` is empty when the probe passed."""

    model: str
    error: str


class StatsRequest(msgspec.Struct, frozen=True):
    pass


class StageHistogram(msgspec.Struct):
    """Durations of one pipeline stage in fixed buckets: ``counts[i]`` fell in (bounds_us[i-1], bounds_us[i]];
    the last count is above the last bound."""

    bounds_us: list[float]
    counts: list[int]
    count: int
    sum_us: float
    max_us: float


class ModelStats(msgspec.Struct):
    name: str
    requests: dict[str, int]  # by Status name
    batches: int
    batch_items: dict[str, int]  # batch size (items) -> count of batches
    queue_depth: int
    # GPU pipeline only: "queue" (per request), "h2d", "wait", "compute", "d2h" (per batch, CUDA events),
    # "answer" (per batch, host: the batch's end on the device to its DONEs sent), "wake" (its first part: to the
    # completion thread's seeing the end); empty on CPU
    stages: dict[str, StageHistogram] = msgspec.field(default_factory=dict)
    decoder: str = ""  # a model of images: which decoder turns its rows into pixels, and where; else ""


class DropReason:
    """The keys of ``WorkerStats.dropped``: why a worker dropped a SUBMIT, or one entry of it, without an answer."""

    MALFORMED = "malformed"  # not a decodable SUBMIT (PROTOCOL 6, M1-M5); counted per message
    UNKNOWN_SESSION = "unknown_session"  # M6: no such session on this worker; per message
    WRONG_TOKEN = "wrong_token"  # M6: the token is not the session's; per message
    DETACHING = "detaching"  # M6: the session is closing; per message
    LATE_HINTED = "late_hinted"  # an entry for a request taken from its hint long ago (PROTOCOL 4.2); per entry


class WorkerStats(msgspec.Struct):
    worker_id: int
    pid: int
    restarts: int
    models: list[ModelStats]
    in_flight: int = 0  # requests accepted and not yet answered, over all models (slots the worker holds)
    device: str = ""  # "cpu" or the GPU ordinal, as configured
    # SUBMITs dropped without an answer since the worker started, by DropReason; absent from an older peer
    dropped: dict[str, int] = msgspec.field(default_factory=dict)


class StatsReply(msgspec.Struct, frozen=True):
    workers: list[WorkerStats]


class ErrorReply(msgspec.Struct, frozen=True):
    code: str
    message: str


class WorkerHello(msgspec.Struct, frozen=True):
    protocol: int
    worker_id: int
    pid: int


class WorkerReady(msgspec.Struct, frozen=True):
    worker_id: int
    endpoint: str
    models: list[ModelInfo]


class WorkerFailed(msgspec.Struct, frozen=True):
    worker_id: int
    reason: str


class WorkerProgress(msgspec.Struct, frozen=True):
    """A starting worker begins a step of its start (loading, building or warming up one model): the broker's
    start deadline counts from the latest, and health shows it."""

    worker_id: int
    step: str


class Attach(SessionRing, frozen=True):
    client_uid: int  # the only user whose connection to the session's reply socket the worker admits


class AttachOk(msgspec.Struct, frozen=True):
    session_id: int
    reply_endpoint: str


class AttachFailed(msgspec.Struct, frozen=True):
    session_id: int
    reason: str


class Detach(msgspec.Struct, frozen=True):
    session_id: int


class DetachOk(msgspec.Struct, frozen=True):
    session_id: int


class WorkerStatsRequest(msgspec.Struct, frozen=True):
    request_id: int


class WorkerStatsReply(msgspec.Struct, frozen=True):
    request_id: int
    stats: WorkerStats


class Shutdown(msgspec.Struct, frozen=True):
    pass


CONTROL_TYPES: dict[MsgKind, type[msgspec.Struct]] = {
    MsgKind.HELLO: Hello,
    MsgKind.SETUP: Setup,
    MsgKind.ATTACHED: Attached,
    MsgKind.READY: Ready,
    MsgKind.BYE: Bye,
    MsgKind.WORKER_DOWN: WorkerDown,
    MsgKind.WORKER_UP: WorkerUp,
    MsgKind.HEALTH: Health,
    MsgKind.HEALTH_REPLY: HealthReply,
    MsgKind.STATS: StatsRequest,
    MsgKind.STATS_REPLY: StatsReply,
    MsgKind.ERROR: ErrorReply,
    MsgKind.WORKER_HELLO: WorkerHello,
    MsgKind.WORKER_READY: WorkerReady,
    MsgKind.WORKER_FAILED: WorkerFailed,
    MsgKind.ATTACH: Attach,
    MsgKind.ATTACH_OK: AttachOk,
    MsgKind.DETACH: Detach,
    MsgKind.DETACH_OK: DetachOk,
    MsgKind.WORKER_STATS: WorkerStatsRequest,
    MsgKind.WORKER_STATS_REPLY: WorkerStatsReply,
    MsgKind.SHUTDOWN: Shutdown,
    MsgKind.ATTACH_FAILED: AttachFailed,
    MsgKind.WORKER_PROGRESS: WorkerProgress,
}
KIND_OF: dict[type[msgspec.Struct], MsgKind] = {v: k for k, v in CONTROL_TYPES.items()}
_ENCODER = msgspec.json.Encoder()
_DECODERS = {k: msgspec.json.Decoder(t) for k, t in CONTROL_TYPES.items()}

T = TypeVar("T", bound=msgspec.Struct)


def encode(msg: msgspec.Struct) -> list[bytes]:
    """The two frames of a control message."""
    return [envelope(KIND_OF[type(msg)]), _ENCODER.encode(msg)]


def decode(frames: list[bytes]) -> msgspec.Struct:
    """Decode a control message into its typed struct; ProtocolError names the kind and the bad field.

    Whatever the bytes, the only exception is ProtocolError: the callers decode untrusted peers' messages."""
    kind = read_envelope(frames)
    decoder = _DECODERS.get(kind)
    if decoder is None:
        raise ProtocolError(f"message kind {kind.name} is not a control message")
    try:
        result: msgspec.Struct = decoder.decode(frames[1])
    except msgspec.DecodeError as exc:  # ValidationError is a subclass; its text names the field
        raise ProtocolError(f"{kind.name}: {exc}") from None
    except RecursionError:
        # msgspec recurses once per nesting level, unknown fields included, and stops at the interpreter's
        # recursion limit (about 1000 levels, fewer deep in a call stack): a 2 KiB body gets there
        raise ProtocolError(f"{kind.name}: the JSON body nests arrays or objects too deeply to decode") from None
    return result


# -- Size bounds: ZMQ_MAXMSGSIZE of the sockets that receive from clients ---------------------------------
# libzmq applies the option to each frame, and closes the connection of a peer that sends a larger one before
# it is read into memory: that peer's socket reconnects (a DEALER with a new routing id), no other peer sees it.
_JSON_INT_MAX = max(len(str(-(1 << 63))), len(str((1 << 64) - 1)))  # msgspec's int range, in digits
_JSON_CHAR_MAX = len(json.dumps("\U0001f600")) - 2  # a character's longest JSON spelling: a surrogate pair


def _json_max(t: msgspec.inspect.Type) -> int:
    """The longest compact JSON of a value of type ``t``; TypeError for a type without such a bound (a
    message a client sends may hold only ints and strings with a max_length)."""
    if isinstance(t, msgspec.inspect.IntType):
        return _JSON_INT_MAX
    if isinstance(t, msgspec.inspect.StrType) and t.max_length is not None:
        return 2 + t.max_length * _JSON_CHAR_MAX
    if isinstance(t, msgspec.inspect.StructType):
        fields = t.fields
        return 2 + max(len(fields) - 1, 0) + sum(len(f.encode_name) + 3 + _json_max(f.type) for f in fields)
    raise TypeError(f"{t} has no bounded JSON size: give it a msgspec.Meta(max_length=...)")


CLIENT_CONTROL_TYPES: tuple[type[msgspec.Struct], ...] = (Hello, Attached, Bye, Health, StatsRequest)
# The longest body a client sends to broker.sock: every int at 20 digits, Hello.name at HELLO_NAME_MAX
# characters, each in a 12-byte escape (3,204 bytes).
CONTROL_BODY_MAX = max(_json_max(msgspec.inspect.type_info(t)) for t in CLIENT_CONTROL_TYPES)
# broker.sock's ZMQ_MAXMSGSIZE: 4x the longest body, room for whitespace a JSON library adds and for the
# fields of a later revision (the broker ignores unknown fields)
CONTROL_MAXMSGSIZE = 4 * CONTROL_BODY_MAX


def decode_as(frames: list[bytes], expected: type[T]) -> T:
    """Decode and insist on one type (a handshake step that accepts only one answer)."""
    msg = decode(frames)
    if isinstance(msg, ErrorReply) and expected is not ErrorReply:
        raise ProtocolError(f"peer answered {msg.code}: {msg.message}")
    if not isinstance(msg, expected):
        raise ProtocolError(f"expected {KIND_OF[expected].name}, got {KIND_OF[type(msg)].name}")
    return msg


# ---------------------------------------------------------------------------------------------------------
# The inline gateway's messages (frontend/inline.py; docs/PROTOCOL.md section 10): the envelope, a JSON header
# of these types, then one frame per tensor
# ---------------------------------------------------------------------------------------------------------
class InlineTensor(msgspec.Struct, frozen=True):
    name: str
    dtype: str  # numpy name, as in TensorSpec
    shape: list[int]


class InlineRequest(msgspec.Struct, frozen=True):
    id: int
    model: str
    inputs: list[InlineTensor]
    timeout_us: int = 0  # 0: the model's timeout_ms


class InlineRequestId(msgspec.Struct):
    """An INLINE_REQUEST header's id alone: read from a header that fails InlineRequest's schema, so that the
    answer still names it."""

    id: int


class InlineReply(msgspec.Struct, frozen=True):
    id: int
    status: str  # "OK" or the protocol's code (BAD_INPUT, OVERLOADED, TIMEOUT, UNKNOWN_MODEL, ..., BAD_MESSAGE)
    message: str = ""
    outputs: list[InlineTensor] = []


class InlineModelsReply(msgspec.Struct, frozen=True):
    """What the gateway serves: ``max_items`` is the rows limit, the largest ``max_batch``, so a request may have
    ``min(max_items, model.max_batch)`` rows (the gateway's client sends one of more rows than a slot holds as
    parts)."""

    models: list[ModelInfo]
    max_items: int


# ---------------------------------------------------------------------------------------------------------
# Ring handout (one SOCK_SEQPACKET exchange on rings.sock; docs/PROTOCOL.md §3.2)

RING_REQUEST = struct.Struct("<HHIQ")  # kind (RING_REQUEST), protocol version, session_id, token
RING_GRANT = struct.Struct("<HHQ")  # kind (RING_GRANT), GrantStatus, segment_bytes; + the descriptor when OK


class GrantStatus(enum.IntEnum):
    """The broker's answer to RING_REQUEST; only OK carries a descriptor."""

    OK = 0
    BAD_REQUEST = 1  # not one RING_REQUEST record of this protocol version
    NO_SESSION = 2  # no live session with this id and token
    WRONG_USER = 3  # the connecting process's uid is neither the session's client's nor the broker's


# ---------------------------------------------------------------------------------------------------------
# Data plane (binary bodies)
# ---------------------------------------------------------------------------------------------------------
SUBMIT_HEADER = struct.Struct("<IIIIQ")  # session_id, n_requests, n_tensors, flags, token
REQUEST = struct.Struct("<QIIIIII")  # request_id, slot, generation, model_id, first_tensor, n_tensors, timeout_us
TENSOR = struct.Struct("<HBBIQQ8q")  # index, dtype, ndim, reserved, offset, nbytes, dims[8]
TENSOR_ROWS_AT = struct.calcsize("<HBBIQQ")  # dims[0], the row count, within a tensor descriptor
TENSOR_ROWS = struct.Struct("<q")
DONE_HEADER = struct.Struct("<IIII")  # session_id, n_results, n_tensors, text_bytes
RESULT = struct.Struct("<QIIIIIIII")  # request_id, slot, generation, status, first_tensor, n_tensors,
# msg_offset, msg_len, reserved


# A SUBMIT carries an entry per request in flight, so one per slot, and the late entries of requests a worker
# took from their hints and answered before the client's coalesced SUBMIT left (PROTOCOL 4.2), a few at most:
# room for 2 per slot of the largest ring, so 8 per slot of a 1024-slot ring and 512 per slot of a 16-slot one.
SUBMIT_ENTRIES_PER_SLOT = 2
MAX_SUBMIT_REQUESTS = SUBMIT_ENTRIES_PER_SLOT * MAX_SLOTS


def max_submit_bytes(n_inputs: int) -> int:
    """The largest legal SUBMIT body for models of at most ``n_inputs`` inputs (one descriptor each): a
    worker's data socket takes frames up to this (ZMQ_MAXMSGSIZE); 983,064 bytes for one-input models."""
    return SUBMIT_HEADER.size + MAX_SUBMIT_REQUESTS * (REQUEST.size + n_inputs * TENSOR.size)


# The slot header, at the start of every ring slot (PROTOCOL 4): the state word first, written last.
class SlotState:
    FREE = 0
    SUBMITTED = 1
    DONE = 2
    FAILED = 3


SLOT_HEADER_BYTES = 256
SLOT_HEADER = struct.Struct("<IIQI")  # state, generation, request_id, status
STATE_WORD = struct.Struct("<I")
STATE_GEN = struct.Struct("<II")  # a slot header's state and generation words, read together on hot paths
STATUS_AT = struct.calcsize(SLOT_HEADER.format[:-1])  # the status word within a slot header
SLOT_TAIL = struct.Struct("<" + SLOT_HEADER.format.lstrip("<")[1:])  # the header after its state word
# The submit hint (PROTOCOL 4.2): hint bytes and worker id at +20, then a copy of the request's SUBMIT
# record and tensor descriptors, which a spinning worker may take instead of waiting for the message.
HINT = struct.Struct("<HH")
HINT_AT = SLOT_HEADER.size
HINT_RECORD_AT = HINT_AT + HINT.size
HINT_CAPACITY = SLOT_HEADER_BYTES - HINT_RECORD_AT
# A posted request's slot header after its state word, in one pack: generation, request_id, status,
# hint_bytes, hint_worker, then the hint's SUBMIT record (REQUEST's fields); NO_HINT when it does not fit.
NO_HINT = struct.Struct("<" + SLOT_TAIL.format.lstrip("<") + HINT.format.lstrip("<"))
POST = struct.Struct(NO_HINT.format + REQUEST.format.lstrip("<"))


def submit_body(session_id: int, token: int, records: list[bytes], descs: list[bytes], n_tensors: int) -> bytes:
    """A SUBMIT body from packed REQUEST records and their tensor descriptors (the clients' fast encoder;
    ``encode_submit`` writes the same bytes from SubmitRequests)."""
    return b"".join([SUBMIT_HEADER.pack(session_id, len(records), n_tensors, 0, token), *records, *descs])


# A request as a client queues it for its link's next SUBMIT: request_id, slot, generation, model_id, n_tensors,
# timeout_us and its tensor descriptors, packed
SubmitRecord = tuple[int, int, int, int, int, int, bytes]


def drain_submit(session_id: int, token: int, queue: collections.deque[SubmitRecord]) -> bytes | None:
    """The SUBMIT body of every record in ``queue``, taken from its left until it is empty (other threads may
    append meanwhile); None when it was empty. The clients' fast encoder: ``encode_submit`` writes the same
    bytes from SubmitRequests."""
    records: list[bytes] = []
    descs: list[bytes] = []
    n_t = 0
    pack = REQUEST.pack
    while queue:
        rid, slot, gen, model_id, n, timeout_us, desc = queue.popleft()
        records.append(pack(rid, slot, gen, model_id, n_t, n, timeout_us))
        descs.append(desc)
        n_t += n
    if not records:
        return None
    return b"".join([SUBMIT_HEADER.pack(session_id, len(records), n_t, 0, token), *records, *descs])


def done_body(session_id: int, records: list[bytes], descs: list[bytes], n_tensors: int) -> bytes:
    """A DONE body from packed RESULT records without messages and their tensor descriptors (the worker's fast
    encoder; ``encode_done`` writes the same bytes from Results)."""
    return b"".join([DONE_HEADER.pack(session_id, len(records), n_tensors, 0), *records, *descs])


@dataclass(slots=True)
class TensorDesc:
    """Where one tensor lies in a slot: ``offset`` is relative to the slot's input (or output) region."""

    index: int
    dtype: int
    offset: int
    nbytes: int
    shape: tuple[int, ...]


@dataclass(slots=True)
class SubmitRequest:
    request_id: int
    slot: int
    generation: int
    model_id: int
    timeout_us: int
    tensors: list[TensorDesc] = field(default_factory=list)


@dataclass(slots=True)
class SubmitBatch:
    session_id: int
    token: int
    requests: list[SubmitRequest]


@dataclass(slots=True)
class Result:
    request_id: int
    slot: int
    generation: int
    status: int
    tensors: list[TensorDesc] = field(default_factory=list)
    message: str = ""


@dataclass(slots=True)
class DoneBatch:
    session_id: int
    results: list[Result]


def pack_tensor(t: TensorDesc) -> bytes:
    ndim = len(t.shape)
    if ndim > MAX_DIMS:
        raise ProtocolError(f"tensor {t.index} has {ndim} dimensions; the protocol carries at most {MAX_DIMS}")
    dims = (*t.shape, *((0,) * (MAX_DIMS - ndim)))
    return TENSOR.pack(t.index, t.dtype, ndim, 0, t.offset, t.nbytes, *dims)


TENSOR_ALIGN = 64


def pack_offsets(sizes: list[int]) -> tuple[list[int], int]:
    """Offsets of tensors packed in order at TENSOR_ALIGN boundaries, and the bytes they span in all."""
    offsets = []
    end = 0
    for n in sizes:
        start = (end + TENSOR_ALIGN - 1) // TENSOR_ALIGN * TENSOR_ALIGN
        offsets.append(start)
        end = start + n
    return offsets, end


def rows_within(item_sizes: Sequence[int], budget: int, most: int) -> int:
    """The most rows, at most ``most``, whose tensors of these bytes a row, packed (``pack_offsets``), take at
    most ``budget`` bytes; 0 if not even one row fits."""
    per_row = max(1, sum(item_sizes))
    rows = min(most, budget // per_row)
    while rows > 0 and pack_offsets([rows * n for n in item_sizes])[1] > budget:
        rows -= 1
    return rows


# An image input (InputKind.IMAGE) in a slot: the tensor descriptor has dtype UINT8, ndim 1, dims[0] the row count
# and nbytes the span of the whole input; at its offset, a table of one IMAGE_ROW per row, then the images. Each
# row's offset is relative to the input's own start; a row lies within the input's span, in any order.
IMAGE_ROW = struct.Struct("<QQ")  # offset, length
# KServe v2's binary data extension (the HTTP front-end, shmbroker.ray): each element of a BYTES tensor is a
# little-endian u32 length, then that many bytes (one encoded image an element)
BYTES_ELEMENT_LENGTH = struct.Struct("<I")


def image_row_bytes(max_bytes: int) -> int:
    """The most bytes one row of an image input takes in a slot: its table entry and its image."""
    return IMAGE_ROW.size + max_bytes


def pack_image_table(lengths: Sequence[int]) -> tuple[bytes, list[int]]:
    """The row table of images of these lengths packed in order right after it, and each image's offset."""
    offsets = []
    table: list[int] = []  # (offset, length) a row, flat: packed in one call, as IMAGE_ROW's each
    at = IMAGE_ROW.size * len(lengths)
    for n in lengths:
        offsets.append(at)
        table += (at, n)
        at += n
    return struct.pack(f"<{len(table)}Q", *table), offsets


def image_spans(table: bytes | memoryview, rows: int, nbytes: int) -> list[tuple[int, int]] | str:
    """The (offset, length) of each row of an image input of ``nbytes`` bytes from its table, each checked to lie
    within the input (``offset <= nbytes && length <= nbytes - offset``); else the first fault, as text."""
    if len(table) != rows * IMAGE_ROW.size or nbytes < len(table):
        return f"the row table of {rows} rows needs {rows * IMAGE_ROW.size} bytes; the input has {nbytes}"
    spans = list(IMAGE_ROW.iter_unpack(table))
    for k, (off, n) in enumerate(spans):
        if not _span_ok(off, n, nbytes):
            return f"row {k}: bytes [{off}, +{n}) lie outside the input's {nbytes} bytes"
    return spans


# A tensor of a model as the canonical layout needs it: its dtype and its shape without the batch dimension
ItemSpec = tuple[np.dtype[Any], tuple[int, ...]]


def _canonical_descs(specs: Sequence[ItemSpec], rows: int) -> list[TensorDesc]:
    sizes = [rows * math.prod(shape) * dt.itemsize for dt, shape in specs]
    offsets = pack_offsets(sizes)[0]
    return [TensorDesc(k, int(dtype_code(dt)), offsets[k], sizes[k], (rows, *shape))
            for k, (dt, shape) in enumerate(specs)]


@dataclass(frozen=True, slots=True)
class CanonicalRows:
    """A request of ``rows`` rows to one model, its tensors packed canonically (``pack_offsets`` in their
    order): its descriptors are then the same bytes for every such request. The client sends these and
    expects them back; the worker compares a SUBMIT's descriptors with these bytes (one compare accepts dtype,
    shape, size and span at once) and answers with these. Built once per model and row count, never per request."""

    rows: int
    in_descs: list[TensorDesc]  # shared by every such request (the worker compares them by identity)
    in_desc_bytes: bytes  # the SUBMIT tensor descriptors
    in_offsets: list[int]  # where the inputs go in a slot's input region
    in_nbytes: list[int]
    out_descs: list[TensorDesc]
    out_desc_bytes: bytes  # the DONE tensor descriptors
    out_offsets: list[int]  # where the outputs go in a slot's output region
    ok: Result  # an OK answer with these outputs (request id, slot and generation 0; shared, read-only)

    @classmethod
    def of(cls, inputs: Sequence[ItemSpec], outputs: Sequence[ItemSpec], rows: int) -> CanonicalRows:
        ins = _canonical_descs(inputs, rows)
        outs = _canonical_descs(outputs, rows)
        return cls(rows, ins, b"".join(map(pack_tensor, ins)), [d.offset for d in ins], [d.nbytes for d in ins],
                   outs, b"".join(map(pack_tensor, outs)), [d.offset for d in outs], Result(0, 0, 0, Status.OK, outs))


def _unpack_tensors(body: bytes | memoryview, start: int, count: int) -> list[TensorDesc]:
    out = []
    for index, dt, ndim, _r, offset, nbytes, *dims in TENSOR.iter_unpack(body[start : start + count * TENSOR.size]):
        if ndim > MAX_DIMS:
            raise ProtocolError(f"tensor descriptor ndim {ndim} exceeds {MAX_DIMS}")
        out.append(TensorDesc(index, dt, offset, nbytes, tuple(dims[:ndim])))
    return out


def encode_submit(batch: SubmitBatch) -> list[bytes]:
    parts = []
    tensors: list[bytes] = []
    for r in batch.requests:
        parts.append(
            REQUEST.pack(r.request_id, r.slot, r.generation, r.model_id, len(tensors), len(r.tensors), r.timeout_us)
        )
        tensors.extend(pack_tensor(t) for t in r.tensors)
    head = SUBMIT_HEADER.pack(batch.session_id, len(batch.requests), len(tensors), 0, batch.token)
    return [envelope(MsgKind.SUBMIT), b"".join([head, *parts, *tensors])]


def _check_table(what: str, body_len: int, header: int, n_rec: int, rec: int, n_t: int, extra: int = 0) -> None:
    expected = header + n_rec * rec + n_t * TENSOR.size + extra
    if body_len != expected:
        raise ProtocolError(f"{what} body is {body_len} bytes; its header announces {expected}")


def _span_ok(first: int, count: int, total: int) -> bool:
    # written as a C program must write it: no ``first + count`` that could wrap
    return first <= total and count <= total - first


def submit_sender(body: bytes | memoryview) -> tuple[int, int]:
    """A SUBMIT's session_id and token, from its header alone (PROTOCOL 6, M2): checked before the body is
    decoded, so a message without the session's token costs no more than this."""
    if len(body) < SUBMIT_HEADER.size:
        raise ProtocolError(f"SUBMIT body of {len(body)} bytes is shorter than its {SUBMIT_HEADER.size}-byte header")
    session_id, _n_req, _n_t, _flags, token = SUBMIT_HEADER.unpack_from(body)
    return session_id, token


def decode_submit(body: bytes | memoryview) -> SubmitBatch:
    """Decode a SUBMIT body; every count and tensor span is checked against the body's length."""
    submit_sender(body)  # M2: the header is there
    session_id, n_req, n_t, _flags, token = SUBMIT_HEADER.unpack_from(body)
    _check_table("SUBMIT", len(body), SUBMIT_HEADER.size, n_req, REQUEST.size, n_t)
    t_start = SUBMIT_HEADER.size + n_req * REQUEST.size
    tensors = _unpack_tensors(body, t_start, n_t)
    requests = []
    req_bytes = body[SUBMIT_HEADER.size : t_start]
    for rid, slot, gen, model_id, first, count, timeout_us in REQUEST.iter_unpack(req_bytes):
        if not _span_ok(first, count, n_t):
            raise ProtocolError(f"request {rid}: tensors [{first}, +{count}) lie outside the {n_t} in the message")
        requests.append(SubmitRequest(rid, slot, gen, model_id, timeout_us, tensors[first : first + count]))
    return SubmitBatch(session_id, token, requests)


def encode_done(batch: DoneBatch) -> list[bytes]:
    parts = []
    tensors: list[bytes] = []
    texts: list[bytes] = []
    text_len = 0
    for r in batch.results:
        msg = r.message.encode("utf-8", "replace")[:4096]
        parts.append(
            RESULT.pack(
                r.request_id, r.slot, r.generation, r.status, len(tensors), len(r.tensors), text_len, len(msg), 0
            )
        )
        tensors.extend(pack_tensor(t) for t in r.tensors)
        texts.append(msg)
        text_len += len(msg)
    head = DONE_HEADER.pack(batch.session_id, len(batch.results), len(tensors), text_len)
    return [envelope(MsgKind.DONE), b"".join([head, *parts, *tensors, *texts])]


def decode_done(body: bytes | memoryview) -> DoneBatch:
    if len(body) < DONE_HEADER.size:
        raise ProtocolError(f"DONE body of {len(body)} bytes is shorter than its {DONE_HEADER.size}-byte header")
    session_id, n_res, n_t, text_len = DONE_HEADER.unpack_from(body)
    _check_table("DONE", len(body), DONE_HEADER.size, n_res, RESULT.size, n_t, text_len)
    t_start = DONE_HEADER.size + n_res * RESULT.size
    text_start = t_start + n_t * TENSOR.size
    tensors = _unpack_tensors(body, t_start, n_t)
    text = bytes(body[text_start:])
    results = []
    for rid, slot, gen, status, first, count, m_off, m_len, _r in RESULT.iter_unpack(body[DONE_HEADER.size : t_start]):
        if not _span_ok(first, count, n_t) or not _span_ok(m_off, m_len, text_len):
            raise ProtocolError(f"result {rid}: tensor or message span lies outside the message")
        message = text[m_off : m_off + m_len].decode("utf-8", "replace")
        results.append(Result(rid, slot, gen, status, tensors[first : first + count], message))
    return DoneBatch(session_id, results)


# ---------------------------------------------------------------------------------------------------------
# OS and libzmq layouts: the kernel's and libzmq's structs that shmbroker reads or writes, native byte order
# ---------------------------------------------------------------------------------------------------------
UCRED = struct.Struct("3i")  # struct ucred (SO_PEERCRED): pid, uid, gid
TIMEVAL = struct.Struct("ll")  # struct timeval: SO_SNDTIMEO and SO_RCVTIMEO
ZMQ_MONITOR_EVENT = struct.Struct("=H")  # a ZeroMQ monitor message's first frame starts with the event id, u16
