"""Hostile callers of the inline gateway (`shmbroker inline`), against a live broker with real processes: each
malformed request gets exactly one reply naming its id; requests past --max-pending are answered OVERLOADED at
once while the worker is stopped, and every request accepted is answered once; a request whose wait ends is
answered TIMEOUT; a CURVE secret key others may read is refused, and TCP without --curve-clients is warned of."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest
import zmq

from broker import protocol as P
from frontend.inline import INLINE_MODELS, INLINE_MODELS_REPLY, INLINE_REPLY, INLINE_REQUEST
from tests.conftest import REPO, RunningBroker, start_broker
from tests.test_inline import _env, _infer, broker_with_gateway, start_inline

X = np.ones((1, 256), np.float32)  # the tiny model's input: 1024 bytes
DATA = X.tobytes()
GOOD_ID = 900_001


def _header(rid: Any, **fields: Any) -> bytes:
    """A tiny request's header, with ``fields`` replaced."""
    head = {"id": rid, "model": "tiny", "inputs": [{"name": "x", "dtype": "float32", "shape": [1, 256]}], **fields}
    return msgspec.json.encode(head)


def _one(rid: Any, **tensor: Any) -> bytes:
    """A header with one input, ``tensor`` replacing its fields."""
    return _header(rid, inputs=[{"name": "x", "dtype": "float32", "shape": [1, 256], **tensor}])


REQ = _env(INLINE_REQUEST)
# (case, frames, the id the reply must carry, its status, a part its message must name)
CASES: list[tuple[str, list[bytes], int, str, str]] = [
    ("wrong_kind", [_env(99), _header(101), DATA], 101, "BAD_MESSAGE", "envelope"),
    ("wrong_version", [P.ENVELOPE.pack(2, INLINE_REQUEST), _header(102), DATA], 102, "BAD_MESSAGE", "envelope"),
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
]


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[RunningBroker, list[str], Path]]:
    """A broker and a gateway with its default options; the gateway's log path."""
    tmp = tmp_path_factory.mktemp("inline-hostile")
    with broker_with_gateway(tmp) as (b, endpoints):
        yield b, endpoints, tmp / "inline.log"


@contextlib.contextmanager
def _dealer(endpoint: str) -> Iterator[zmq.Socket[bytes]]:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.RCVHWM, 0)  # nothing dropped on our side however many replies wait
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.connect(endpoint)
        yield sock
    finally:
        ctx.destroy(linger=0)


def _good(rid: int, timeout_us: int = 0, x: np.ndarray = X) -> list[bytes]:
    head = {"id": rid, "model": "tiny", "inputs": [{"name": "x", "dtype": "float32", "shape": list(x.shape)}],
            "timeout_us": timeout_us}
    return [REQ, msgspec.json.encode(head), x.tobytes()]


def _replies(sock: zmq.Socket[bytes], count: int, wait_ms: int = 60_000) -> list[dict[str, Any]]:
    """The headers of the next ``count`` replies, each awaited up to ``wait_ms``."""
    heads: list[dict[str, Any]] = []
    for _ in range(count):
        assert sock.poll(wait_ms), f"{len(heads)} replies of {count} came: {heads[-3:]}"
        frames = sock.recv_multipart()
        assert frames[0] == _env(INLINE_REPLY), frames[:2]
        heads.append(msgspec.json.decode(frames[1]))
    return heads


def _next_is_only(sock: zmq.Socket[bytes], rid: int) -> dict[str, Any]:
    """Send a good request and return its reply, which must be the next one: no late or second reply of an
    earlier request comes before it."""
    sock.send_multipart(_good(rid))
    (head,) = _replies(sock, 1)
    assert head["id"] == rid, f"a reply of an earlier request came late: {head}"
    return head


@pytest.mark.parametrize(("frames", "rid", "status", "named"), [pytest.param(*c[1:], id=c[0]) for c in CASES])
def test_a_malformed_request_gets_exactly_one_reply_with_its_id(
        gateway: tuple[RunningBroker, list[str], Path], frames: list[bytes], rid: int, status: str,
        named: str) -> None:
    _b, endpoints, log_path = gateway
    logged = log_path.stat().st_size
    with _dealer(endpoints[0]) as sock:
        sock.send_multipart(frames)
        sock.send_multipart(_good(GOOD_ID))
        heads = {h["id"]: h for h in _replies(sock, 2, 30_000)}
        assert set(heads) == {rid, GOOD_ID}, heads
        assert (heads[rid]["status"], heads[rid]["outputs"]) == (status, []), heads[rid]
        assert named in heads[rid]["message"], heads[rid]
        assert len(heads[rid]["message"]) < 400, heads[rid]  # bounded, whatever the caller sent
        assert heads[GOOD_ID]["status"] == "OK", heads[GOOD_ID]  # the gateway goes on serving
        assert _next_is_only(sock, GOOD_ID + 1)["status"] == "OK"
    with open(log_path, "rb") as fh:
        fh.seek(logged)
        assert b"Traceback" not in fh.read()  # what this request made the gateway log


def test_past_max_pending_requests_are_overloaded_and_each_gets_one_reply(tmp_path: Path) -> None:
    """Cap 64, the worker stopped, 300 requests of 4 KiB on one DEALER: the first 64 are held, the other 236
    answered OVERLOADED at once; once the worker goes on, the 64 are answered OK, each once."""
    with broker_with_gateway(tmp_path, "--max-pending", "64") as (b, endpoints), _dealer(endpoints[0]) as sock:
        x = np.random.default_rng(4).standard_normal((4, 256), dtype=np.float32)  # 4 KiB
        assert _next_is_only(sock, 1000)["status"] == "OK"  # linked and warm
        workers = b.worker_pids()
        for pid in workers:
            os.kill(pid, signal.SIGSTOP)
        try:
            for rid in range(1, 301):
                sock.send_multipart(_good(rid, timeout_us=120_000_000, x=x))  # held until the worker goes on
            refused = _replies(sock, 236)
        finally:
            for pid in workers:
                os.kill(pid, signal.SIGCONT)
        assert sorted(h["id"] for h in refused) == list(range(65, 301)), [h["id"] for h in refused]
        assert {h["status"] for h in refused} == {"OVERLOADED"}
        assert "--max-pending 64" in refused[0]["message"], refused[0]
        held = _replies(sock, 64)
        assert sorted(h["id"] for h in held) == list(range(1, 65))
        assert {h["status"] for h in held} == {"OK"}, [h for h in held if h["status"] != "OK"][:3]
        assert _next_is_only(sock, 1001)["status"] == "OK"


def test_requests_whose_wait_ends_while_the_worker_is_stopped_are_answered_timeout_once(
        gateway: tuple[RunningBroker, list[str], Path]) -> None:
    """40 requests with a 0.3 s timeout while the worker is stopped: the 16 in the gateway's slots and the 24
    waiting for one are each answered TIMEOUT, with the worker still stopped; once it goes on, the requests it
    then answers late get no second reply."""
    b, endpoints, _log = gateway
    with _dealer(endpoints[0]) as sock:
        assert _next_is_only(sock, 2000)["status"] == "OK"
        workers = b.worker_pids()
        for pid in workers:
            os.kill(pid, signal.SIGSTOP)
        try:
            for rid in range(1, 41):
                sock.send_multipart(_good(rid, timeout_us=300_000))
            heads = _replies(sock, 40, 30_000)
        finally:
            for pid in workers:
                os.kill(pid, signal.SIGCONT)
        assert sorted(h["id"] for h in heads) == list(range(1, 41))
        assert {h["status"] for h in heads} == {"TIMEOUT"}, heads[:3]
        assert {"slot" in h["message"] for h in heads} == {True, False}  # waiting for a slot, and in one
        assert _next_is_only(sock, 2001)["status"] == "OK"


def test_requests_held_at_a_stop_are_answered_before_the_gateway_exits(tmp_path: Path) -> None:
    """SIGTERM while 5 requests wait on a stopped worker: the gateway answers each CLIENT_CLOSED once the session's
    close gave up on them, and only then exits 0."""
    b = start_broker(tmp_path, "process")
    gateway: subprocess.Popen[str] | None = None
    try:
        gateway, endpoints = start_inline(b, tmp_path / "inline.log")
        with _dealer(endpoints[0]) as sock:
            assert _next_is_only(sock, 3000)["status"] == "OK"
            workers = b.worker_pids()
            for pid in workers:
                os.kill(pid, signal.SIGSTOP)
            try:
                for rid in range(1, 6):
                    sock.send_multipart(_good(rid, timeout_us=120_000_000))
                sock.send_multipart([_env(INLINE_MODELS), b"{}"])  # answered once the 5 before it were taken in
                assert sock.poll(60_000) and sock.recv_multipart()[0] == _env(INLINE_MODELS_REPLY)
                gateway.terminate()
                heads = _replies(sock, 5)
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
    env = dict(os.environ, SHMBROKER_RUNTIME_DIR=str(tmp_path / "run"))
    r = subprocess.run([sys.executable, "-m", "broker.cli", "inline", "--tcp", "tcp://127.0.0.1:*",
                        "--curve-secret-file", str(key)], env=env, cwd=REPO, capture_output=True, text=True,
                       timeout=60, check=False)
    assert r.returncode == 2, r.stderr
    assert str(key) in r.stderr and f"mode {mode:04o}" in r.stderr and "chmod 600" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr


def test_tcp_without_curve_clients_is_warned_of_at_start(tmp_path: Path) -> None:
    """A 0600 key is taken; without --curve-clients the log says that any caller knowing the public key is
    served, and names the option; such a caller, with a key pair of its own, is indeed served."""
    public, key = _curve_keys(tmp_path, 0o600)
    with broker_with_gateway(tmp_path, "--tcp", "tcp://127.0.0.1:*", "--curve-secret-file", str(key)) as (
            _b, endpoints):
        warnings = [line for line in (tmp_path / "inline.log").read_text().splitlines() if "WARNING" in line]
        assert any("--curve-clients" in line and "public key" in line for line in warnings), warnings
        tcp = next(e for e in endpoints if e.startswith("tcp://"))
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        try:
            sock = ctx.socket(zmq.DEALER)
            sock.curve_serverkey = public
            sock.curve_publickey, sock.curve_secretkey = zmq.curve_keypair()
            sock.connect(tcp)
            head, _frames = _infer(sock, "tiny", "x", X)
            assert head["status"] == "OK"
        finally:
            ctx.destroy(linger=0)
