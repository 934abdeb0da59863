"""broker.common.protocol: the envelope, the JSON control messages and the SUBMIT / DONE binary codecs."""

from __future__ import annotations

import contextlib
import json
import re
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shmbroker.broker.common import protocol as P

# ---------------------------------------------------------------------------------------------------------
# Control messages
# ---------------------------------------------------------------------------------------------------------
_SPEC_IN = P.TensorSpec(name="input:0", dtype="float32", shape=[-1, 224, 224, 3])
_SPEC_OUT = P.TensorSpec(name="outputs", dtype="float32", shape=[-1, 2])
_MODEL = P.ModelInfo(model_id=3, name="nsfw", max_batch=16, inputs=[_SPEC_IN], outputs=[_SPEC_OUT], timeout_ms=5000)
_WORKER = P.WorkerInfo(
    worker_id=2,
    device="cuda:1",
    endpoint="ipc:///run/shmbroker/w2.sock",
    reply_endpoint="ipc:///run/shmbroker/w2-reply.sock",
    models=["nsfw", "tiny"],
)
_WSTATS = P.WorkerStats(
    worker_id=2,
    pid=4242,
    restarts=1,
    models=[
        P.ModelStats(
            name="tiny",
            requests={"OK": 10, "TIMEOUT": 1},
            batches=4,
            batch_items={"1": 2, "4": 2},
            queue_depth=5,
        )
    ],
    dropped={"wrong_token": 2, "malformed": 1},
)
_RING: dict[str, Any] = dict(
    session_id=7,
    token=2**62 - 1,
    segment_bytes=1 << 20,
    n_slots=16,
    slot_stride=8192,
    in_capacity=4096,
    out_capacity=1024,
    max_items=4,
)

# one sample per control kind, every field away from its default where it has one
CONTROL_SAMPLES: list[msgspec.Struct] = [
    P.Hello(protocol=1, pid=1234, slots=32, max_items=4, name="client-a"),
    P.Setup(**_RING, models=[_MODEL], handshake_timeout_ms=5000),
    P.Attached(session_id=7),
    P.Ready(session_id=7, token=2**64 - 1, workers=[_WORKER]),
    P.Bye(session_id=7),
    P.WorkerDown(worker_id=2, reason="exit code -9"),
    P.WorkerUp(worker=_WORKER),
    P.Health(wait_ms=250),
    P.HealthReply(
        ready=False,
        models=[P.ModelHealth(name="nsfw", ready=False, workers_ready=0, workers_total=1, reason="loading")],
        reason="not all models ready",
    ),
    P.StatsRequest(),
    P.StatsReply(workers=[_WSTATS]),
    P.ErrorReply(code="BAD_SESSION", message="no session 9 — ünïcode too"),
    P.WorkerHello(protocol=1, worker_id=2, pid=999),
    P.WorkerReady(worker_id=2, endpoint="ipc:///tmp/w.sock", models=[_MODEL]),
    P.WorkerFailed(worker_id=2, reason="CUDA out of memory"),
    P.WorkerProgress(worker_id=2, step="model nsfw (1 of 2): loading its torch engine"),
    P.Attach(**{**_RING, "token": 55}, client_uid=1000),
    P.AttachOk(session_id=7, reply_endpoint="ipc:///tmp/r.sock"),
    P.AttachFailed(session_id=7, reason="cannot map segment: No such file or directory"),
    P.Detach(session_id=7),
    P.DetachOk(session_id=7),
    P.WorkerStatsRequest(request_id=11),
    P.WorkerStatsReply(request_id=11, stats=_WSTATS),
    P.Shutdown(),
]


def test_samples_cover_every_control_kind() -> None:
    kinds = {P.KIND_OF[type(m)] for m in CONTROL_SAMPLES}
    assert kinds == set(P.CONTROL_TYPES)
    # the data plane's, the ring handout's and the inline gateway's (its own socket) are the only ones that
    # decode() does not take
    assert set(P.MsgKind) - set(P.CONTROL_TYPES) == {P.MsgKind.SUBMIT, P.MsgKind.DONE, P.MsgKind.RING_REQUEST,
                                                     P.MsgKind.RING_GRANT, *INLINE_KINDS}


INLINE_KINDS = (P.MsgKind.INLINE_REQUEST, P.MsgKind.INLINE_REPLY, P.MsgKind.INLINE_MODELS,
                P.MsgKind.INLINE_MODELS_REPLY)


def test_the_inline_kinds_keep_their_numbers() -> None:
    """docs/PROTOCOL.md section 10: what inline callers already send and expect."""
    assert [int(k) for k in INLINE_KINDS] == [40, 41, 42, 43]
    assert P.PROTOCOL_VERSION.to_bytes(2, "little") + b"\x2a\x00" == P.INLINE_MODELS_ENVELOPE


@pytest.mark.parametrize("msg", CONTROL_SAMPLES, ids=lambda m: type(m).__name__)
def test_control_round_trip(msg: msgspec.Struct) -> None:
    frames = P.encode(msg)
    assert len(frames) == 2
    assert all(isinstance(f, bytes) for f in frames)
    assert P.ENVELOPE.unpack(frames[0]) == (P.PROTOCOL_VERSION, P.KIND_OF[type(msg)])
    assert P.read_envelope(frames) is P.KIND_OF[type(msg)]
    out = P.decode(frames)
    assert type(out) is type(msg)
    assert out == msg
    assert P.decode_as(frames, type(msg)) == msg


def test_setup_and_attach_carry_one_session_ring_in_the_fields_of_protocol_2() -> None:
    """SETUP and ATTACH are a SessionRing with fields of their own after its eight: the JSON stays flat, field
    for field what a version 2 reader (examples/c) parses."""
    ring = P.SessionRing(**_RING)
    setup = P.Setup.of(ring, models=[_MODEL], handshake_timeout_ms=5000)
    attach = P.Attach.of(setup, client_uid=1000)  # from a Setup too: only the ring's fields are copied
    assert P.Setup(**_RING, models=[_MODEL], handshake_timeout_ms=5000) == setup
    assert P.Attach(**_RING, client_uid=1000) == attach
    assert list(P.Setup.__struct_fields__) == [*_RING, "models", "handshake_timeout_ms"]
    assert list(P.Attach.__struct_fields__) == [*_RING, "client_uid"]
    flat = json.dumps({**_RING, "client_uid": 1000}, separators=(",", ":")).encode()
    assert P.encode(attach)[1] == flat
    assert P.decode([P.envelope(P.MsgKind.ATTACH), flat]) == attach


def test_defaults_fill_missing_optional_fields() -> None:
    frames = [P.envelope(P.MsgKind.HELLO), b'{"protocol": 1, "pid": 5}']
    assert P.decode(frames) == P.Hello(protocol=1, pid=5, slots=0, max_items=0, name="")
    assert P.decode([P.envelope(P.MsgKind.HEALTH), b"{}"]) == P.Health(wait_ms=0)


def test_worker_stats_of_an_older_peer_decode_with_nothing_dropped() -> None:
    """WorkerStats.dropped is newer than the other fields: a peer that does not send it still decodes, and an
    older reader ignores it."""
    old = {"worker_id": 0, "pid": 9, "restarts": 0, "models": []}
    reply = P.decode([P.envelope(P.MsgKind.STATS_REPLY), msgspec.json.encode({"workers": [old]})])
    assert isinstance(reply, P.StatsReply) and reply.workers[0].dropped == {}

    class OldWorkerStats(msgspec.Struct):
        worker_id: int
        pid: int
        restarts: int
        models: list[P.ModelStats]

    assert msgspec.json.decode(msgspec.json.encode(_WSTATS), type=OldWorkerStats).worker_id == 2


# -- envelope refusals -------------------------------------------------------------------------------------
_BODY = b'{"session_id": 1}'


@pytest.mark.parametrize("n", [0, 1, 3, 4])
def test_wrong_frame_count(n: int) -> None:
    frames = [P.envelope(P.MsgKind.BYE), *([_BODY] * (n - 1))] if n else []
    with pytest.raises(P.ProtocolError, match=f"expected 2 frames, got {n}"):
        P.decode(frames)
    with pytest.raises(P.ProtocolError, match="frames"):
        P.read_envelope(frames)


@pytest.mark.parametrize("head", [b"", b"\x01", b"\x01\x00\x05", b"\x01\x00\x05\x00\x00"])
def test_envelope_of_wrong_size(head: bytes) -> None:
    with pytest.raises(P.ProtocolError, match=f"frame 0 must be 4 bytes, got {len(head)}"):
        P.decode([head, _BODY])


@pytest.mark.parametrize("version", [0, P.PROTOCOL_VERSION - 1, P.PROTOCOL_VERSION + 1, 0xFFFF])
def test_wrong_version(version: int) -> None:
    frames = [P.ENVELOPE.pack(version, P.MsgKind.BYE), _BODY]
    with pytest.raises(P.VersionError, match=f"protocol version {version} is not supported"):
        P.decode(frames)
    assert issubclass(P.VersionError, P.ProtocolError)


@pytest.mark.parametrize("kind", [0, 13, 19, 34, 39, 0xFFFF])
def test_unknown_kind(kind: int) -> None:
    frames = [P.ENVELOPE.pack(P.PROTOCOL_VERSION, kind), _BODY]
    with pytest.raises(P.ProtocolError, match=f"unknown message kind {kind}"):
        P.decode(frames)


@pytest.mark.parametrize("kind", [P.MsgKind.SUBMIT, P.MsgKind.DONE, *INLINE_KINDS])
def test_data_plane_kind_is_not_a_control_message(kind: P.MsgKind) -> None:
    with pytest.raises(P.ProtocolError, match=f"{kind.name} is not a control message"):
        P.decode([P.envelope(kind), b"{}"])


# -- body refusals -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("body", [b"", b"{", b"not json", b'{"session_id": 1', b"\xff\xfe", b'{"session_id": 1}x'])
def test_bad_json(body: bytes) -> None:
    with pytest.raises(P.ProtocolError, match=r"^BYE: "):
        P.decode([P.envelope(P.MsgKind.BYE), body])


@pytest.mark.parametrize(
    ("kind", "body", "field"),
    [
        (P.MsgKind.HELLO, {"protocol": "1", "pid": 5}, "$.protocol"),
        (P.MsgKind.HELLO, {"protocol": 1, "pid": 5, "name": 3}, "$.name"),
        (P.MsgKind.HELLO, {"protocol": 1, "pid": True}, "$.pid"),
        (P.MsgKind.BYE, {"session_id": 1.5}, "$.session_id"),
        (P.MsgKind.BYE, {"session_id": None}, "$.session_id"),
        (P.MsgKind.HEALTH_REPLY, {"ready": 1, "models": []}, "$.ready"),
        (
            P.MsgKind.READY,
            {"session_id": 1, "token": 2, "workers": [{**msgspec.to_builtins(_WORKER), "worker_id": "2"}]},
            "$.workers[0].worker_id",
        ),
        (
            P.MsgKind.WORKER_STATS_REPLY,
            {"request_id": 1, "stats": {**msgspec.to_builtins(_WSTATS), "models": [{"name": 5}]}},
            "$.stats.models[0].name",
        ),
        (P.MsgKind.BYE, {"session_id": [1]}, "$.session_id"),
    ],
)
def test_field_of_wrong_type_is_named(kind: P.MsgKind, body: dict[str, object], field: str) -> None:
    with pytest.raises(P.ProtocolError) as info:
        P.decode([P.envelope(kind), json.dumps(body).encode()])
    text = str(info.value)
    assert text.startswith(f"{kind.name}: ")
    assert field in text


@pytest.mark.parametrize(
    ("kind", "body", "name"),
    [
        (P.MsgKind.HELLO, {"pid": 5}, "protocol"),
        (P.MsgKind.BYE, {}, "session_id"),
        (P.MsgKind.WORKER_UP, {}, "worker"),
    ],
)
def test_missing_required_field_is_named(kind: P.MsgKind, body: dict[str, object], name: str) -> None:
    with pytest.raises(P.ProtocolError, match=f"missing required field `{name}`"):
        P.decode([P.envelope(kind), json.dumps(body).encode()])


def test_body_of_wrong_json_type() -> None:
    with pytest.raises(P.ProtocolError, match="Expected `object`, got `array`"):
        P.decode([P.envelope(P.MsgKind.BYE), b"[1]"])


# -- decode_as ---------------------------------------------------------------------------------------------
def test_decode_as_returns_the_expected_type() -> None:
    msg = P.Attached(session_id=4)
    out = P.decode_as(P.encode(msg), P.Attached)
    assert isinstance(out, P.Attached)
    assert out.session_id == 4


def test_decode_as_refuses_another_kind() -> None:
    with pytest.raises(P.ProtocolError, match="expected SETUP, got HELLO"):
        P.decode_as(P.encode(P.Hello(protocol=1, pid=1)), P.Setup)
    with pytest.raises(P.ProtocolError, match="expected DETACH_OK, got ATTACH_OK"):
        P.decode_as(P.encode(P.AttachOk(session_id=1, reply_endpoint="x")), P.DetachOk)


def test_decode_as_turns_an_error_reply_into_protocol_error() -> None:
    frames = P.encode(P.ErrorReply(code="OVERLOADED", message="too many sessions"))
    with pytest.raises(P.ProtocolError, match="peer answered OVERLOADED: too many sessions"):
        P.decode_as(frames, P.Setup)
    assert P.decode_as(frames, P.ErrorReply) == P.ErrorReply(code="OVERLOADED", message="too many sessions")


def test_decode_as_still_validates() -> None:
    with pytest.raises(P.ProtocolError, match="version"):
        P.decode_as([P.ENVELOPE.pack(9, P.MsgKind.ATTACHED), b'{"session_id": 1}'], P.Attached)
    with pytest.raises(P.ProtocolError, match="session_id"):
        P.decode_as([P.envelope(P.MsgKind.ATTACHED), b'{"session_id": "x"}'], P.Attached)


# -- dtypes ------------------------------------------------------------------------------------------------
def test_dtype_codes_round_trip() -> None:
    for code in P.DType:
        assert P.dtype_code(P.numpy_dtype(code)) is code
        assert P.dtype_from_int(int(code)) is code
    assert P.dtype_code(">f4") is P.DType.FP32
    assert P.dtype_code(np.dtype("float16")) is P.DType.FP16
    assert P.dtype_from_int(0) is None
    assert P.dtype_from_int(200) is None
    with pytest.raises(P.ProtocolError, match="complex64"):
        P.dtype_code("complex64")


# ---------------------------------------------------------------------------------------------------------
# SUBMIT / DONE
# ---------------------------------------------------------------------------------------------------------
def _td(index: int, shape: tuple[int, ...], offset: int = 0, dtype: P.DType = P.DType.FP32) -> P.TensorDesc:
    nbytes = int(np.prod(shape, dtype=np.int64)) * P.numpy_dtype(dtype).itemsize
    return P.TensorDesc(index=index, dtype=int(dtype), offset=offset, nbytes=nbytes, shape=shape)


def _submit_sample() -> P.SubmitBatch:
    return P.SubmitBatch(
        session_id=7,
        token=2**64 - 1,
        requests=[
            P.SubmitRequest(1, slot=0, generation=1, model_id=0, timeout_us=500_000, tensors=[_td(0, (1, 256))]),
            P.SubmitRequest(
                2**64 - 1,
                slot=15,
                generation=2**32 - 1,
                model_id=3,
                timeout_us=0,
                tensors=[_td(0, (2, 224, 224, 3)), _td(1, (), offset=1204224, dtype=P.DType.INT64)],
            ),
            P.SubmitRequest(3, slot=4, generation=9, model_id=1, timeout_us=1, tensors=[]),
            P.SubmitRequest(
                4,
                slot=5,
                generation=1,
                model_id=1,
                timeout_us=7,
                tensors=[_td(2, (1, 1, 1, 1, 1, 1, 1, 2), offset=64, dtype=P.DType.UINT8)],
            ),
        ],
    )


def _done_sample() -> P.DoneBatch:
    return P.DoneBatch(
        session_id=7,
        results=[
            P.Result(1, slot=0, generation=1, status=P.Status.OK, tensors=[_td(0, (1, 256))]),
            P.Result(
                2,
                slot=15,
                generation=3,
                status=P.Status.BAD_SHAPE,
                message="input 0: shape (3,) is not [-1,256]",
            ),
            P.Result(3, slot=4, generation=9, status=P.Status.OK, tensors=[_td(0, (4, 2)), _td(1, (4,), offset=64)]),
            P.Result(4, slot=5, generation=1, status=P.Status.INTERNAL, message="CUDA error: ünïcödé ✓"),
            P.Result(5, slot=6, generation=1, status=P.Status.TIMEOUT),
        ],
    )


def test_submit_round_trip() -> None:
    batch = _submit_sample()
    frames = P.encode_submit(batch)
    assert len(frames) == 2
    assert P.read_envelope(frames) is P.MsgKind.SUBMIT
    body = frames[1]
    n_t = sum(len(r.tensors) for r in batch.requests)
    assert len(body) == P.SUBMIT_HEADER.size + len(batch.requests) * P.REQUEST.size + n_t * P.TENSOR.size
    assert P.decode_submit(body) == batch
    assert P.decode_submit(memoryview(body)) == batch


def test_submit_header_and_tensor_indices_on_the_wire() -> None:
    body = P.encode_submit(_submit_sample())[1]
    session_id, n_req, n_t, flags, token = P.SUBMIT_HEADER.unpack_from(body)
    assert (session_id, n_req, n_t, flags, token) == (7, 4, 4, 0, 2**64 - 1)
    spans = [P.REQUEST.unpack_from(body, P.SUBMIT_HEADER.size + i * P.REQUEST.size)[4:6] for i in range(n_req)]
    assert spans == [(0, 1), (1, 2), (3, 0), (3, 1)]


def test_empty_submit_round_trip() -> None:
    batch = P.SubmitBatch(session_id=1, token=2, requests=[])
    body = P.encode_submit(batch)[1]
    assert len(body) == P.SUBMIT_HEADER.size
    assert P.decode_submit(body) == batch


def test_done_round_trip() -> None:
    batch = _done_sample()
    frames = P.encode_done(batch)
    assert len(frames) == 2
    assert P.read_envelope(frames) is P.MsgKind.DONE
    out = P.decode_done(frames[1])
    assert out == batch
    assert out.results[3].message == "CUDA error: ünïcödé ✓"
    assert out.results[4].message == ""
    assert P.decode_done(memoryview(frames[1])) == batch


def test_done_message_is_capped() -> None:
    batch = P.DoneBatch(1, [P.Result(1, 0, 1, P.Status.INTERNAL, message="x" * 10_000)])
    out = P.decode_done(P.encode_done(batch)[1])
    assert out.results[0].message == "x" * 4096


def test_pack_refuses_more_than_max_dims() -> None:
    t = P.TensorDesc(index=0, dtype=1, offset=0, nbytes=4, shape=(1,) * (P.MAX_DIMS + 1))
    with pytest.raises(P.ProtocolError, match="9 dimensions"):
        P.encode_submit(P.SubmitBatch(1, 1, [P.SubmitRequest(1, 0, 1, 0, 0, [t])]))
    with pytest.raises(P.ProtocolError, match="9 dimensions"):
        P.encode_done(P.DoneBatch(1, [P.Result(1, 0, 1, 0, [t])]))


# -- SUBMIT refusals ---------------------------------------------------------------------------------------
def _tensor_bytes(ndim: int = 1) -> bytes:
    return P.TENSOR.pack(0, int(P.DType.FP32), ndim, 0, 0, 4, *([1] * P.MAX_DIMS))


def _submit_body(requests: list[tuple[int, int]], n_tensors: int, ndim: int = 1) -> bytes:
    """A hand-made SUBMIT body: ``requests`` are (first_tensor, n_tensors) pairs."""
    head = P.SUBMIT_HEADER.pack(1, len(requests), n_tensors, 0, 9)
    reqs = [P.REQUEST.pack(i, 0, 1, 0, first, count, 100) for i, (first, count) in enumerate(requests)]
    return b"".join([head, *reqs, *([_tensor_bytes(ndim)] * n_tensors)])


def test_hand_made_submit_is_accepted() -> None:
    # the refusals below differ from this body in one number only
    out = P.decode_submit(_submit_body([(0, 1), (1, 1), (2, 0)], 2))
    assert [len(r.tensors) for r in out.requests] == [1, 1, 0]
    assert out.requests[0].tensors[0] == P.TensorDesc(0, int(P.DType.FP32), 0, 4, (1,))


def test_submit_truncated_at_every_length() -> None:
    body = P.encode_submit(_submit_sample())[1]
    for cut in range(len(body)):
        with pytest.raises(P.ProtocolError, match="SUBMIT body"):
            P.decode_submit(body[:cut])


@pytest.mark.parametrize("extra", [1, P.TENSOR.size, P.REQUEST.size])
def test_submit_longer_than_announced(extra: int) -> None:
    body = P.encode_submit(_submit_sample())[1]
    with pytest.raises(P.ProtocolError, match="its header announces"):
        P.decode_submit(body + b"\0" * extra)


def test_submit_header_announcing_too_much() -> None:
    body = bytearray(P.encode_submit(_submit_sample())[1])
    for n_req, n_t in [(5, 4), (4, 5), (0xFFFFFFFF, 4), (4, 0xFFFFFFFF), (0xFFFFFFFF, 0xFFFFFFFF)]:
        struct.pack_into("<II", body, 4, n_req, n_t)
        with pytest.raises(P.ProtocolError, match="its header announces"):
            P.decode_submit(bytes(body))


@pytest.mark.parametrize(
    ("first", "count"),
    [(0xFFFFFFFF, 1), (1, 0xFFFFFFFF), (0xFFFFFFFF, 0xFFFFFFFF), (0, 3), (2, 1), (3, 0), (1, 2)],
)
def test_submit_tensor_span_outside_table(first: int, count: int) -> None:
    with pytest.raises(P.ProtocolError, match=r"request 1: tensors .* lie outside the 2 in the message"):
        P.decode_submit(_submit_body([(0, 1), (first, count)], 2))


def test_submit_span_ending_at_table_end_is_accepted() -> None:
    out = P.decode_submit(_submit_body([(2, 0), (0, 2)], 2))
    assert [len(r.tensors) for r in out.requests] == [0, 2]


@pytest.mark.parametrize("ndim", [9, 255])
def test_submit_ndim_above_max(ndim: int) -> None:
    with pytest.raises(P.ProtocolError, match=f"ndim {ndim} exceeds 8"):
        P.decode_submit(_submit_body([(0, 1)], 1, ndim=ndim))


def test_submit_ndim_max_is_accepted() -> None:
    out = P.decode_submit(_submit_body([(0, 1)], 1, ndim=P.MAX_DIMS))
    assert out.requests[0].tensors[0].shape == (1,) * P.MAX_DIMS


# -- DONE refusals -----------------------------------------------------------------------------------------
def _done_body(results: list[tuple[int, int, int, int]], n_tensors: int, text: bytes, ndim: int = 1) -> bytes:
    """A hand-made DONE body: ``results`` are (first_tensor, n_tensors, msg_offset, msg_len)."""
    head = P.DONE_HEADER.pack(1, len(results), n_tensors, len(text))
    res = [P.RESULT.pack(i, 0, 1, 0, f, c, mo, ml, 0) for i, (f, c, mo, ml) in enumerate(results)]
    return b"".join([head, *res, *([_tensor_bytes(ndim)] * n_tensors), text])


def test_hand_made_done_is_accepted() -> None:
    out = P.decode_done(_done_body([(0, 1, 0, 3), (1, 0, 3, 2)], 1, b"abcde"))
    assert [r.message for r in out.results] == ["abc", "de"]
    assert [len(r.tensors) for r in out.results] == [1, 0]


def test_done_truncated_at_every_length() -> None:
    body = P.encode_done(_done_sample())[1]
    for cut in range(len(body)):
        with pytest.raises(P.ProtocolError, match="DONE body"):
            P.decode_done(body[:cut])


@pytest.mark.parametrize("extra", [1, P.TENSOR.size, P.RESULT.size])
def test_done_longer_than_announced(extra: int) -> None:
    body = P.encode_done(_done_sample())[1]
    with pytest.raises(P.ProtocolError, match="its header announces"):
        P.decode_done(body + b"x" * extra)


def test_done_header_announcing_too_much_text() -> None:
    body = bytearray(P.encode_done(_done_sample())[1])
    text_len = struct.unpack_from("<I", body, 12)[0]
    for announced in [text_len + 1, 0xFFFFFFFF]:
        struct.pack_into("<I", body, 12, announced)
        with pytest.raises(P.ProtocolError, match="its header announces"):
            P.decode_done(bytes(body))


@pytest.mark.parametrize(("first", "count"), [(0xFFFFFFFF, 1), (1, 0xFFFFFFFF), (0, 2), (1, 1), (2, 0)])
def test_done_tensor_span_outside_table(first: int, count: int) -> None:
    with pytest.raises(P.ProtocolError, match="result 1: tensor or message span lies outside"):
        P.decode_done(_done_body([(0, 0, 0, 0), (first, count, 0, 0)], 1, b"abcd"))


@pytest.mark.parametrize(
    ("offset", "length"), [(0, 5), (4, 1), (5, 0), (0xFFFFFFFF, 1), (1, 0xFFFFFFFF), (0xFFFFFFFF, 0xFFFFFFFF)]
)
def test_done_message_span_outside_text(offset: int, length: int) -> None:
    with pytest.raises(P.ProtocolError, match="result 1: tensor or message span lies outside"):
        P.decode_done(_done_body([(0, 1, 0, 4), (0, 0, offset, length)], 1, b"abcd"))


def test_done_message_span_ending_at_text_end_is_accepted() -> None:
    out = P.decode_done(_done_body([(0, 1, 4, 0), (0, 0, 1, 3)], 1, b"abcd"))
    assert [r.message for r in out.results] == ["", "bcd"]


@pytest.mark.parametrize("ndim", [9, 200])
def test_done_ndim_above_max(ndim: int) -> None:
    with pytest.raises(P.ProtocolError, match=f"ndim {ndim} exceeds 8"):
        P.decode_done(_done_body([(0, 1, 0, 0)], 1, b"", ndim=ndim))


def test_done_invalid_utf8_message_is_replaced_not_raised() -> None:
    out = P.decode_done(_done_body([(0, 0, 0, 3)], 0, b"a\xffb"))
    assert out.results[0].message == "a\ufffdb"


# ---------------------------------------------------------------------------------------------------------
# Properties
# ---------------------------------------------------------------------------------------------------------
u32 = st.integers(0, 2**32 - 1)
u64 = st.integers(0, 2**64 - 1)
tensor_descs = st.builds(
    P.TensorDesc,
    index=st.integers(0, 2**16 - 1),
    dtype=st.integers(0, 255),
    offset=u64,
    nbytes=u64,
    shape=st.lists(st.integers(-(2**63), 2**63 - 1), max_size=P.MAX_DIMS).map(tuple),
)
submit_batches = st.builds(
    P.SubmitBatch,
    session_id=u32,
    token=u64,
    requests=st.lists(
        st.builds(
            P.SubmitRequest,
            request_id=u64,
            slot=u32,
            generation=u32,
            model_id=u32,
            timeout_us=u32,
            tensors=st.lists(tensor_descs, max_size=4),
        ),
        max_size=6,
    ),
)
done_batches = st.builds(
    P.DoneBatch,
    session_id=u32,
    results=st.lists(
        st.builds(
            P.Result,
            request_id=u64,
            slot=u32,
            generation=u32,
            status=u32,
            tensors=st.lists(tensor_descs, max_size=4),
            message=st.text(st.characters(codec="utf-8"), max_size=64),
        ),
        max_size=6,
    ),
)


@settings(database=None, max_examples=200)
@given(submit_batches)
def test_submit_round_trip_property(batch: P.SubmitBatch) -> None:
    assert P.decode_submit(P.encode_submit(batch)[1]) == batch


@settings(database=None, max_examples=200)
@given(done_batches)
def test_done_round_trip_property(batch: P.DoneBatch) -> None:
    assert P.decode_done(P.encode_done(batch)[1]) == batch


def _decodes_or_protocol_error(fn: Callable[..., object], *args: object) -> None:
    with contextlib.suppress(P.ProtocolError):  # any other exception fails the test
        fn(*args)


@settings(database=None, max_examples=500)
@given(st.binary(max_size=2048))
def test_random_bytes_never_crash_the_binary_decoders(data: bytes) -> None:
    _decodes_or_protocol_error(P.decode_submit, data)
    _decodes_or_protocol_error(P.decode_done, data)


@settings(database=None, max_examples=300)
@given(st.data())
def test_mutated_bodies_never_crash_the_binary_decoders(data: st.DataObject) -> None:
    # start from valid bodies so that the corruption gets past the length check often
    submit = bytearray(P.encode_submit(data.draw(submit_batches, label="submit"))[1])
    done = bytearray(P.encode_done(data.draw(done_batches, label="done"))[1])
    for body, fn in ((submit, P.decode_submit), (done, P.decode_done)):
        for _ in range(data.draw(st.integers(1, 4), label="n_mutations")):
            pos = data.draw(st.integers(0, len(body) - 1), label="pos")
            body[pos] = data.draw(st.integers(0, 255), label="byte")
        _decodes_or_protocol_error(fn, bytes(body))


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=12,
)


@settings(database=None, max_examples=500)
@given(
    st.lists(st.binary(max_size=64), max_size=3),
    st.integers(0, 2**16 - 1),
    st.sampled_from(list(P.MsgKind)),
    st.binary(max_size=256),
    json_values,
)
def test_random_frames_never_crash_decode(
    frames: list[bytes], version: int, kind: P.MsgKind, body: bytes, doc: object
) -> None:
    _decodes_or_protocol_error(P.decode, frames)
    _decodes_or_protocol_error(P.decode, [P.ENVELOPE.pack(version, kind), body])
    _decodes_or_protocol_error(P.decode, [P.envelope(kind), body])
    _decodes_or_protocol_error(P.decode, [P.envelope(kind), json.dumps(doc).encode()])


def test_protocol_md_lists_every_kind_with_its_value() -> None:
    """PROTOCOL.md §2.1's table is MsgKind, the inline gateway's kinds included."""
    text = (Path(__file__).parent.parent / "docs" / "PROTOCOL.md").read_text()
    table = text[text.index("### 2.1 MsgKind table"):text.index("### 2.2")]
    rows = re.findall(r"^\| ([A-Z_]+) \| (\d+) \|", table, re.MULTILINE)
    assert {name: int(value) for name, value in rows} == {k.name: int(k) for k in P.MsgKind}
