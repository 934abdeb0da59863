"""Hostile callers of the inline gateway (`shmbroker inline`), against a live broker with real processes: each
malformed request gets exactly one reply naming its id; requests past --max-pending are answered OVERLOADED at
once while the worker is stopped, and every request accepted is answered once; a request whose wait ends is
answered TIMEOUT; a CURVE secret key others may read is refused, and TCP needs --curve-clients or, said outright,
--curve-any-client."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shmbroker.broker.common import protocol as P
from shmbroker.broker.common.protocol import MsgKind
from tests.conftest import CLI, REPO, RunningBroker, start_broker
from tests.frontends import (
    TINY_X,
    broker_with_gateway,
    flood_a_stalled_worker,
    infer_inline,
    inline_dealer,
    inline_envelope,
    inline_replies,
    next_is_only,
    start_inline,
    tiny_request,
)

X = TINY_X
DATA = X.tobytes()
GOOD_ID = 900_001


def _header(rid: Any, **fields: Any) -> bytes:
    """A tiny request's header, with ``fields`` replaced."""
    head = {"id": rid, "model": "tiny", "inputs": [{"name": "x", "dtype": "float32", "shape": [1, 256]}], **fields}
    return msgspec.json.encode(head)


def _one(rid: Any, **tensor: Any) -> bytes:
    """A header with one input, ``tensor`` replacing its fields."""
    return _header(rid, inputs=[{"name": "x", "dtype": "float32", "shape": [1, 256], **tensor}])


def _nested(depth: int, kind: str = "list") -> bytes:
    """A JSON value nested ``depth`` deep, of lists or of objects; built as bytes, as no encoder recurses so far."""
    if kind == "list":
        return b"[" * depth + b"]" * depth
    return b'{"a":' * depth + b"1" + b"}" * depth


def _padded(rid: Any, pad: bytes, first: bool = False) -> bytes:
    """A tiny request's header with a member ``pad`` of raw JSON bytes, last (or ``first``)."""
    head = _header(rid)
    return b'{"pad":' + pad + b"," + head[1:] if first else head[:-1] + b',"pad":' + pad + b"}"


REQ = inline_envelope(MsgKind.INLINE_REQUEST)
# (case, frames, the id the reply must carry, its status, a part its message must name)
CASES: list[tuple[str, list[bytes], int, str, str]] = [
    ("wrong_kind", [inline_envelope(99), _header(101), DATA], 101, "BAD_MESSAGE", "envelope"),
    ("wrong_version", [P.ENVELOPE.pack(P.PROTOCOL_VERSION + 1, MsgKind.INLINE_REQUEST), _header(102), DATA], 102,
     "BAD_MESSAGE", "envelope"),
    ("short_envelope", [b"\x01\x00", _header(103), DATA], 103, "BAD_MESSAGE", "envelope"),
    ("envelope_only", [REQ], 0, "BAD_MESSAGE", "frames"),
    ("header_not_json", [REQ, b"{nope", DATA], 0, "BAD_MESSAGE", "header"),
    ("header_a_list", [REQ, msgspec.json.encode([{"id": 106, "model": "tiny"}]), DATA], 0, "BAD_MESSAGE", "header"),
    ("id_a_string", [REQ, _header("107"), DATA], 0, "BAD_MESSAGE", "id"),
    ("id_past_64_bits", [REQ, _header(2**64 + 108), DATA], 0, "BAD_MESSAGE", "id"),
    ("model_missing", [REQ, msgspec.json.encode({"id": 109, "inputs": []}), DATA], 109, "BAD_MESSAGE", "model"),
    ("inputs_a_map", [REQ, _header(110, inputs={"x": [1, 256]}), DATA], 110, "BAD_MESSAGE", "inputs"),
    ("input_a_list", [REQ, _header(111, inputs=[["x", "float32", [1, 256]]]), DATA], 111, "BAD_MESSAGE",
     "inputs[0]"),
    ("name_not_a_string", [REQ, _one(112, name=5), DATA], 112, "BAD_MESSAGE", "inputs[0].name"),
    ("unknown_dtype", [REQ, _one(113, dtype="float128"), DATA + DATA + DATA + DATA], 113, "BAD_MESSAGE",
     "inputs[0].dtype"),
    ("subarray_dtype", [REQ, _one(114, dtype="(256,)f4", shape=[1]), DATA], 114, "BAD_MESSAGE", "inputs[0].dtype"),
    ("big_endian_dtype", [REQ, _one(115, dtype=">f4"), DATA], 115, "BAD_MESSAGE", "inputs[0].dtype"),
    ("frame_longer", [REQ, _header(116), DATA + DATA], 116, "BAD_MESSAGE", "inputs[0]"),
    ("frame_shorter", [REQ, _header(117), DATA[:100]], 117, "BAD_MESSAGE", "inputs[0]"),
    ("two_frames_for_one_input", [REQ, _header(118), DATA, DATA], 118, "BAD_MESSAGE", "frames"),
    ("no_data_frame", [REQ, _header(119)], 119, "BAD_MESSAGE", "frames"),
    ("input_given_twice", [REQ, _header(120, inputs=[{"name": "x", "dtype": "float32", "shape": [1, 256]}] * 2),
                           DATA, DATA], 120, "BAD_MESSAGE", "'x'"),
    ("negative_dims", [REQ, _one(121, shape=[-1, -256]), DATA], 121, "BAD_MESSAGE", "inputs[0].shape"),
    ("product_2_124", [REQ, _one(122, shape=[2**62, 2**62]), b""], 122, "BAD_MESSAGE", "inputs[0]"),
    ("huge_dims_and_a_zero", [REQ, _one(123, shape=[2**62, 2**62, 0]), b""], 123, "BAD_SHAPE", "shape"),
    ("dims_past_64_bits", [REQ, _one(124, shape=[2**64 + 1, 0]), b""], 124, "BAD_MESSAGE", "inputs[0].shape"),
    ("ten_to_the_five_dims", [REQ, _one(125, shape=[1] * 100_000), DATA[:4]], 125, "BAD_MESSAGE", "header"),
    ("nine_dims", [REQ, _one(133, shape=[1] * 9), DATA[:4]], 133, "BAD_MESSAGE", "inputs[0].shape"),
    ("zero_rows", [REQ, _one(126, shape=[0, 256]), b""], 126, "BAD_SHAPE", "shape[0]"),
    ("header_too_large", [REQ, _header(132, pad="x" * 70_000), DATA], 132, "BAD_MESSAGE", "header"),
    ("timeout_negative", [REQ, _header(127, timeout_us=-5), DATA], 127, "BAD_MESSAGE", "timeout_us"),
    ("timeout_past_u32", [REQ, _header(128, timeout_us=2**40), DATA], 128, "BAD_MESSAGE", "timeout_us"),
    ("unknown_model", [REQ, _header(129, model="nope"), DATA], 129, "UNKNOWN_MODEL", "'nope'"),
    ("input_not_the_models", [REQ, _one(130, name="y"), DATA], 130, "BAD_INPUT", "'y'"),
    ("dtype_not_the_models", [REQ, _one(131, dtype="float64"), DATA + DATA], 131, "BAD_DTYPE", "dtype"),
    # nesting past what the decoder's recursion takes, refused before it decodes, with the id read around it
    ("lists_nested_1000_deep", [REQ, _padded(134, _nested(1000)), DATA], 134, "BAD_MESSAGE", "nested 1001 deep"),
    ("objects_nested_5000_deep", [REQ, _padded(135, _nested(5000, "object")), DATA], 135, "BAD_MESSAGE",
     "header: nested"),
    ("id_after_the_nesting", [REQ, _padded(136, _nested(1000), first=True), DATA], 136, "BAD_MESSAGE", "nested"),
    ("id_nested_1000_deep", [REQ, _header(0)[:-1] + b',"id":' + _nested(1000) + b"}", DATA], 0, "BAD_MESSAGE",
     "nested"),
    ("header_nested_30000_deep", [REQ, _nested(30_000), DATA], 0, "BAD_MESSAGE", "nested 30000 deep"),
    ("nesting_never_closed", [REQ, b'{"id":137,"pad":' + b"[" * 5000, DATA], 0, "BAD_MESSAGE", "header"),
    ("nested_and_too_large", [REQ, _padded(138, _nested(40_000)), DATA], 138, "BAD_MESSAGE", "header"),
    ("nested_envelope_wrong", [inline_envelope(99), _padded(139, _nested(1000)), DATA], 139, "BAD_MESSAGE",
     "envelope"),
]


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[RunningBroker, list[str], Path]]:
    """A broker and a gateway with its default options; the gateway's log path."""
    tmp = tmp_path_factory.mktemp("inline-hostile")
    with broker_with_gateway(tmp) as (b, endpoints):
        yield b, endpoints, tmp / "inline.log"


@pytest.mark.parametrize(("frames", "rid", "status", "named"), [pytest.param(*c[1:], id=c[0]) for c in CASES])
def test_a_malformed_request_gets_exactly_one_reply_with_its_id(
        gateway: tuple[RunningBroker, list[str], Path], frames: list[bytes], rid: int, status: str,
        named: str) -> None:
    _b, endpoints, log_path = gateway
    logged = log_path.stat().st_size
    with inline_dealer(endpoints[0]) as sock:
        sock.send_multipart(frames)
        sock.send_multipart(tiny_request(GOOD_ID))
        heads = {h["id"]: h for h in inline_replies(sock, 2, 30_000)}
        assert set(heads) == {rid, GOOD_ID}, heads
        assert (heads[rid]["status"], heads[rid]["outputs"]) == (status, []), heads[rid]
        assert named in heads[rid]["message"], heads[rid]
        assert len(heads[rid]["message"]) < 400, heads[rid]  # bounded, whatever the caller sent
        assert heads[GOOD_ID]["status"] == "OK", heads[GOOD_ID]  # the gateway goes on serving
        assert next_is_only(sock, GOOD_ID + 1)["status"] == "OK"
    with open(log_path, "rb") as fh:
        fh.seek(logged)
        assert b"Traceback" not in fh.read()  # what this request made the gateway log


# -- fuzzed headers: each message one reply, with the id whenever the header is a JSON object with an integer id
_JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
                     lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner,
                                                                                max_size=3), max_leaves=8)
_DEEP = st.builds(_nested, st.integers(1, 12_000), st.sampled_from(["list", "object"]))
_VALUE = _JSON.map(msgspec.json.encode) | _DEEP  # raw JSON bytes: a shallow value, or one nested past any limit
_IDS = st.integers(-(2**63), 2**64 - 1)
_NO_ID = _VALUE.filter(lambda v: not v.lstrip(b"-").isdigit())  # anything but an integer of 64 bits, or nothing
_TINY_INPUTS = msgspec.json.encode([{"name": "x", "dtype": "float32", "shape": [1, 256]}])


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is no JSON")


def _ids_after_a_change(header: bytes, written: int) -> set[int]:
    """The ids a reply to a header with bytes cut or changed may carry: 0, the id written, or the id the header
    now holds (a change can make another integer of the id, or a key "id" of another one)."""
    ids = {0, written}
    with contextlib.suppress(ValueError, RecursionError):  # not UTF-8, not JSON, or too deep for the json module
        head = json.loads(header.decode(), parse_constant=_no_constant)  # strict: no NaN or Infinity
        if isinstance(head, dict) and isinstance(head.get("id"), int):
            ids.add(head["id"])
    return ids


@st.composite
def fuzzed_request(draw: st.DrawFn) -> tuple[list[bytes], int | None, int]:
    """(frames, the id the reply must carry or None when bytes of the header were changed, the id written): a
    header object whose members are each the right value, a wrong one, or one nested thousands deep, maybe with
    bytes of it cut or changed; an envelope and data frames that may be wrong too."""
    rid = draw(_IDS | st.none())  # None: no integer id
    fields: dict[bytes, bytes] = {
        b"id": msgspec.json.encode(rid) if rid is not None else draw(_NO_ID),
        b"model": draw(st.sampled_from([b'"tiny"']) | _VALUE),
        b"inputs": draw(st.sampled_from([_TINY_INPUTS]) | _VALUE),
    }
    if rid is None and draw(st.booleans()):
        del fields[b"id"]
    for key in draw(st.lists(st.sampled_from([b"timeout_us", b"pad", b"meta", b"x"]), max_size=3, unique=True)):
        fields[key] = draw(_VALUE)
    members = [b'"' + k + b'":' + v for k, v in fields.items()]
    header = b"{" + b",".join(draw(st.permutations(members))) + b"}"
    expect: int | None = rid if rid is not None else 0
    if draw(st.integers(0, 3)) == 0:  # bytes cut or changed: the id is read or not, depending on what is left
        cut = draw(st.integers(0, len(header)))
        header = header[:cut] + draw(st.binary(max_size=4)) + header[cut + draw(st.integers(0, 3)):]
        expect = None
    envelope = draw(st.sampled_from([REQ, REQ, REQ, inline_envelope(99), b"\x01"]))
    data = [DATA] * draw(st.integers(0, 2))
    return [envelope, header, *data], expect, rid or 0


def test_fuzzed_headers_each_get_exactly_one_reply_with_their_id(
        gateway: tuple[RunningBroker, list[str], Path]) -> None:
    """Hundreds of fuzzed requests, one at a time on one DEALER: each gets exactly one reply, the next one, with
    its id when the header has one; none is a fault of the gateway's (INTERNAL) or logs a traceback; the
    gateway serves a correct request after them."""
    _b, endpoints, log_path = gateway
    logged = log_path.stat().st_size
    with inline_dealer(endpoints[0]) as sock:

        @settings(max_examples=300, deadline=None, database=None, derandomize=True,
                  suppress_health_check=list(HealthCheck))
        @given(fuzzed_request())
        def one(case: tuple[list[bytes], int | None, int]) -> None:
            frames, expect, written = case
            sock.send_multipart(frames)
            (head,) = inline_replies(sock, 1, 30_000)
            if expect is None:
                assert head["id"] in _ids_after_a_change(frames[1], written), (head, frames[1][:200])
            else:
                assert head["id"] == expect, (head, frames[1][:200])
            assert head["status"] != "INTERNAL" and (head["status"] == "OK" or head["message"]), head

        one()
        assert next_is_only(sock, GOOD_ID)["status"] == "OK"
    with open(log_path, "rb") as fh:
        fh.seek(logged)
        assert b"Traceback" not in fh.read()


def test_a_nested_header_past_the_cap_is_answered_overloaded_with_its_id(tmp_path: Path) -> None:
    """With --max-pending 1 held by a request the stopped worker cannot answer, a header nested 1000 deep is
    answered OVERLOADED at once, with its id read around the nesting; then the held one is answered OK."""
    with broker_with_gateway(tmp_path, "--max-pending", "1") as (b, endpoints), inline_dealer(endpoints[0]) as sock:
        assert next_is_only(sock, 1)["status"] == "OK"
        with b.workers_stopped():
            sock.send_multipart(tiny_request(2, timeout_us=120_000_000))
            sock.send_multipart([REQ, _padded(3, _nested(1000)), DATA])
            (refused,) = inline_replies(sock, 1)
        assert (refused["id"], refused["status"]) == (3, "OVERLOADED"), refused
        (held,) = inline_replies(sock, 1)
        assert (held["id"], held["status"]) == (2, "OK"), held
        assert next_is_only(sock, 4)["status"] == "OK"


def test_brackets_inside_strings_are_not_nesting(gateway: tuple[RunningBroker, list[str], Path]) -> None:
    """A correct request with a member whose string holds thousands of brackets (and escaped quotes) is served."""
    _b, endpoints, _log = gateway
    with inline_dealer(endpoints[0]) as sock:
        sock.send_multipart([REQ, _padded(5, msgspec.json.encode('\\"' + "[{" * 5000)), DATA])
        (head,) = inline_replies(sock, 1)
        assert (head["id"], head["status"]) == (5, "OK"), head


def test_past_max_pending_requests_are_overloaded_and_each_gets_one_reply(tmp_path: Path) -> None:
    """Cap 64, the worker stopped, 300 requests of 4 KiB on one DEALER: the first 64 are held, the other 236
    answered OVERLOADED at once; once the worker goes on, the 64 are answered OK, each once."""
    with broker_with_gateway(tmp_path, "--max-pending", "64") as (b, endpoints), inline_dealer(endpoints[0]) as sock:
        x = np.random.default_rng(4).standard_normal((4, 256), dtype=np.float32)  # 4 KiB
        flood_a_stalled_worker(b, sock, 300, 64, x, "--max-pending 64")


def test_requests_whose_wait_ends_while_the_worker_is_stopped_are_answered_timeout_once(
        gateway: tuple[RunningBroker, list[str], Path]) -> None:
    """40 requests with a 0.3 s timeout while the worker is stopped: the 16 in the gateway's slots and the 24
    waiting for one are each answered TIMEOUT, with the worker still stopped; once it goes on, the requests it
    then answers late get no second reply."""
    b, endpoints, _log = gateway
    with inline_dealer(endpoints[0]) as sock:
        assert next_is_only(sock, 2000)["status"] == "OK"
        with b.workers_stopped():
            for rid in range(1, 41):
                sock.send_multipart(tiny_request(rid, timeout_us=300_000))
            heads = inline_replies(sock, 40, 30_000)
        assert sorted(h["id"] for h in heads) == list(range(1, 41))
        assert {h["status"] for h in heads} == {"TIMEOUT"}, heads[:3]
        assert {"slot" in h["message"] for h in heads} == {True, False}  # waiting for a slot, and in one
        assert next_is_only(sock, 2001)["status"] == "OK"


def test_requests_held_at_a_stop_are_answered_before_the_gateway_exits(tmp_path: Path) -> None:
    """SIGTERM while 5 requests wait on a stopped worker: the gateway answers each CLIENT_CLOSED once the session's
    close gave up on them, and only then exits 0."""
    b = start_broker(tmp_path, "process")
    gateway: subprocess.Popen[str] | None = None
    try:
        gateway, endpoints = start_inline(b, tmp_path / "inline.log")
        with inline_dealer(endpoints[0]) as sock:
            assert next_is_only(sock, 3000)["status"] == "OK"
            workers = b.worker_pids()
            for pid in workers:
                os.kill(pid, signal.SIGSTOP)
            try:
                for rid in range(1, 6):
                    sock.send_multipart(tiny_request(rid, timeout_us=120_000_000))
                # answered once the 5 before it were taken in
                sock.send_multipart([inline_envelope(MsgKind.INLINE_MODELS), b"{}"])
                assert sock.poll(60_000) and sock.recv_multipart()[0] == inline_envelope(MsgKind.INLINE_MODELS_REPLY)
                gateway.terminate()
                heads = inline_replies(sock, 5)
            finally:
                for pid in workers:
                    os.kill(pid, signal.SIGCONT)
        assert sorted(h["id"] for h in heads) == [1, 2, 3, 4, 5]
        assert {h["status"] for h in heads} == {"CLIENT_CLOSED"}, heads
        assert gateway.wait(30) == 0, (tmp_path / "inline.log").read_text()[-3000:]
        gateway = None
    finally:
        if gateway is not None:
            gateway.kill()
        assert b.stop() == 0, b.log()


def _curve_keys(tmp: Path, mode: int) -> tuple[bytes, Path]:
    """A server key pair: the public key, and the secret key's file with ``mode``."""
    public, secret = zmq.curve_keypair()
    path = tmp / "server.key"
    path.write_bytes(secret)
    path.chmod(mode)
    return public, path


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604], ids=oct)
def test_a_curve_secret_key_others_may_read_is_refused(tmp_path: Path, mode: int) -> None:
    _public, key = _curve_keys(tmp_path, mode)
    r = _inline_exit(tmp_path, "--tcp", "tcp://127.0.0.1:*", "--curve-secret-file", str(key), "--curve-any-client")
    assert r.returncode == 2, r.stderr
    assert str(key) in r.stderr and f"mode {mode:04o}" in r.stderr and "chmod 600" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr


def _inline_exit(tmp: Path, *options: str) -> subprocess.CompletedProcess[str]:
    """`shmbroker inline OPTIONS` with no broker to find: an option it refuses ends it first, exit 2."""
    env = dict(os.environ, SHMBROKER_RUNTIME_DIR=str(tmp / "run"))
    return subprocess.run([*CLI, "inline", *options], env=env, cwd=REPO, capture_output=True, text=True, timeout=60,
                          check=False)


@pytest.mark.parametrize(("options", "named"), [
    pytest.param([], ["--curve-clients", "--curve-any-client"], id="neither"),
    pytest.param(["--curve-clients", "CLIENTS", "--curve-any-client"], ["--curve-clients", "--curve-any-client"],
                 id="both"),
    pytest.param(["--curve-clients", "MISSING"], ["--curve-clients", "no such directory"], id="no_directory"),
])
def test_tcp_without_a_decision_on_who_may_connect_is_refused(tmp_path: Path, options: list[str],
                                                               named: list[str]) -> None:
    """--tcp serves only with --curve-clients DIR (an allow-list) or --curve-any-client, exactly one, else exit 2
    naming both; CURVE alone would serve any caller's key pair."""
    _public, key = _curve_keys(tmp_path, 0o600)
    (tmp_path / "clients").mkdir()
    paths = {"CLIENTS": str(tmp_path / "clients"), "MISSING": str(tmp_path / "missing")}
    r = _inline_exit(tmp_path, "--tcp", "tcp://127.0.0.1:*", "--curve-secret-file", str(key),
                     *(paths.get(o, o) for o in options))
    assert r.returncode == 2, r.stderr
    assert all(n in r.stderr for n in named) and "Traceback" not in r.stderr, r.stderr


def test_curve_any_client_without_tcp_is_refused(tmp_path: Path) -> None:
    r = _inline_exit(tmp_path, "--curve-any-client")
    assert r.returncode == 2 and "--curve-any-client: applies to --tcp only" in r.stderr, r.stderr


def test_tcp_with_curve_any_client_serves_any_key_pair_and_says_so(tmp_path: Path) -> None:
    """--curve-any-client, said outright: the log warns that any caller knowing the public key is served, and
    names --curve-clients; such a caller, with a key pair of its own, is indeed served."""
    public, key = _curve_keys(tmp_path, 0o600)
    with broker_with_gateway(tmp_path, "--tcp", "tcp://127.0.0.1:*", "--curve-secret-file", str(key),
                             "--curve-any-client") as (_b, endpoints):
        warnings = [line for line in (tmp_path / "inline.log").read_text().splitlines() if "WARNING" in line]
        assert any("--curve-any-client" in line and "--curve-clients" in line and "public key" in line
                   for line in warnings), warnings
        tcp = next(e for e in endpoints if e.startswith("tcp://"))
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        try:
            sock = ctx.socket(zmq.DEALER)
            sock.curve_serverkey = public
            sock.curve_publickey, sock.curve_secretkey = zmq.curve_keypair()
            sock.connect(tcp)
            head, _frames = infer_inline(sock, "tiny", "x", X)
            assert head["status"] == "OK"
        finally:
            ctx.destroy(linger=0)
