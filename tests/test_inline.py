"""The inline gateway (`shmbroker inline`) against a live broker: tensors in ZeroMQ frames over ipc, and
over tcp with CURVE. Real processes and sockets; the caller is plain pyzmq, as a C or Go program would be."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest
import zmq
import zmq.auth

from shmbroker.broker.common.protocol import MsgKind
from tests.conftest import CLI, REPO, RunningBroker, start_broker
from tests.frontends import ask_inline, broker_with_gateway, infer_inline, inline_envelope, start_inline, stop_inline
from tests.models import direct


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[RunningBroker, list[str]]]:
    with broker_with_gateway(tmp_path_factory.mktemp("inline")) as g:
        yield g


@pytest.fixture
def dealer(gateway: tuple[RunningBroker, list[str]]) -> Iterator[zmq.Socket[bytes]]:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.connect(gateway[1][0])
    yield sock
    ctx.destroy(linger=0)


def test_ipc_only_by_default_and_models_listed(gateway: tuple[RunningBroker, list[str]],
                                               dealer: zmq.Socket[bytes]) -> None:
    b, endpoints = gateway
    assert endpoints == [f"ipc://{b.runtime_dir}/inline.sock"]
    reply = ask_inline(dealer, [inline_envelope(MsgKind.INLINE_MODELS), b"{}"])
    assert reply[0] == inline_envelope(MsgKind.INLINE_MODELS_REPLY)
    answer = msgspec.json.decode(reply[1])
    models = {m["name"]: m for m in answer["models"]}
    assert models["nsfw"]["inputs"] == [{"name": "input:0", "dtype": "float32", "shape": [-1, 224, 224, 3],
                                         "kind": "tensor", "max_bytes": 0}]
    # the rows limit: a request may have min(max_items, max_batch) rows, the gateway sending it in parts
    assert answer["max_items"] == max(m["max_batch"] for m in models.values())


def test_results_in_frames_match_onnxruntime(dealer: zmq.Socket[bytes]) -> None:
    x = np.random.default_rng(5).random((2, 224, 224, 3), dtype=np.float32)
    head, frames = infer_inline(dealer, "nsfw", "input:0", x)
    assert head["id"] == 7 and head["status"] == "OK"
    assert head["outputs"] == [{"name": "outputs", "dtype": "float32", "shape": [2, 2]}]
    y = np.frombuffer(frames[0], np.float32).reshape(2, 2)
    np.testing.assert_allclose(y, direct("nsfw", x), rtol=0, atol=1e-5)


def test_errors_name_the_code(dealer: zmq.Socket[bytes]) -> None:
    x = np.ones((1, 256), np.float32)
    head, _ = infer_inline(dealer, "nope", "x", x, rid=1)
    assert (head["id"], head["status"]) == (1, "UNKNOWN_MODEL")
    head, _ = infer_inline(dealer, "tiny", "x", np.ones((1, 255), np.float32), rid=2)
    assert (head["id"], head["status"]) == (2, "BAD_SHAPE") and "shape" in head["message"]
    header = {"id": 3, "model": "tiny", "inputs": [{"name": "x", "dtype": "float32", "shape": [1, 256]}]}
    reply = ask_inline(dealer, [inline_envelope(MsgKind.INLINE_REQUEST), msgspec.json.encode(header),
                                x.tobytes()[:100]])
    head = msgspec.json.decode(reply[1])
    assert (head["id"], head["status"]) == (3, "BAD_MESSAGE") and "inputs[0]" in head["message"]
    # a header that fails the schema still has its id read and echoed
    reply = ask_inline(dealer, [inline_envelope(MsgKind.INLINE_REQUEST),
                                msgspec.json.encode({"id": 5, "model": "tiny"})])
    head = msgspec.json.decode(reply[1])
    assert (head["id"], head["status"]) == (5, "BAD_MESSAGE") and "inputs" in head["message"]
    reply = ask_inline(dealer, [inline_envelope(MsgKind.INLINE_REQUEST), b"{nope"])  # no id to read: 0
    assert (msgspec.json.decode(reply[1])["id"], msgspec.json.decode(reply[1])["status"]) == (0, "BAD_MESSAGE")
    head, frames = infer_inline(dealer, "tiny", "x", x, rid=4)  # the gateway goes on serving
    assert head["status"] == "OK" and len(frames[0]) == 1024


def test_a_failed_request_among_several_outstanding_is_named_by_its_id(dealer: zmq.Socket[bytes]) -> None:
    """Three requests in flight on one DEALER, the middle one malformed after its header: the answers, in any
    order, carry the ids of their requests."""
    rng = np.random.default_rng(3)
    xs = {11: rng.standard_normal((1, 256), dtype=np.float32), 13: rng.standard_normal((2, 256), dtype=np.float32)}
    for rid in (11, 12, 13):
        x = xs.get(rid, np.ones((1, 256), np.float32))
        header = {"id": rid, "model": "tiny", "inputs": [{"name": "x", "dtype": "float32", "shape": list(x.shape)}]}
        data = x.tobytes() if rid in xs else x.tobytes()[:10]  # 12: its data frame is short
        dealer.send_multipart([inline_envelope(MsgKind.INLINE_REQUEST), msgspec.json.encode(header), data])
    answers: dict[int, tuple[dict[str, Any], list[bytes]]] = {}
    while len(answers) < 3:
        assert dealer.poll(60_000), f"answers for {sorted(answers)} only"
        reply = dealer.recv_multipart()
        head = msgspec.json.decode(reply[1])
        answers[head["id"]] = head, reply[2:]
    assert {rid: head["status"] for rid, (head, _) in answers.items()} == {11: "OK", 12: "BAD_MESSAGE", 13: "OK"}
    assert "inputs[0]" in answers[12][0]["message"]
    for rid, x in xs.items():
        y = np.frombuffer(answers[rid][1][0], np.float32).reshape(x.shape)
        np.testing.assert_allclose(y, direct("tiny", x), rtol=0, atol=1e-5)


def test_a_max_batch_request_is_served_through_slots_of_fewer_rows(tmp_path: Path) -> None:
    """`shmbroker inline --max-items 2`: slots of 2 rows. MsgKind.INLINE_MODELS_REPLY announces the largest max_batch as
    the rows limit, a request of tiny's max_batch (16) rows is sent as parts and answered whole, and one past it
    gets BAD_SHAPE naming the model's limit."""
    with broker_with_gateway(tmp_path, "--max-items", "2") as (_b, endpoints):
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        try:
            sock = ctx.socket(zmq.DEALER)
            sock.connect(endpoints[0])
            reply = ask_inline(sock, [inline_envelope(MsgKind.INLINE_MODELS), b"{}"])
            assert msgspec.json.decode(reply[1])["max_items"] == 16  # tiny's max_batch; nsfw's is 4
            x = np.random.default_rng(9).standard_normal((16, 256), dtype=np.float32)
            head, frames = infer_inline(sock, "tiny", "x", x, rid=21)
            assert (head["id"], head["status"]) == (21, "OK"), head
            np.testing.assert_allclose(np.frombuffer(frames[0], np.float32).reshape(16, 256), direct("tiny", x),
                                       rtol=0, atol=1e-5)
            head, _ = infer_inline(sock, "tiny", "x", np.ones((17, 256), np.float32), rid=22)
            assert (head["id"], head["status"]) == (22, "BAD_SHAPE")
            assert "model 'tiny' has max_batch 16" in head["message"], head
        finally:
            ctx.destroy(linger=0)


def test_tcp_needs_curve(gateway: tuple[RunningBroker, list[str]]) -> None:
    b, _ = gateway
    env = dict(os.environ, SHMBROKER_RUNTIME_DIR=str(b.runtime_dir))
    r = subprocess.run([*CLI, "inline", "--tcp", "tcp://127.0.0.1:*"], env=env,
                       cwd=REPO, capture_output=True, text=True, timeout=60, check=False)
    assert r.returncode == 2 and "CURVE" in r.stderr


def test_tcp_with_curve_serves_an_authorised_client(tmp_path: Path) -> None:
    """A gateway of its own (one gateway per runtime directory: the module's already serves its broker's)."""
    server_public, server_secret = zmq.curve_keypair()
    secret_file = tmp_path / "server.key"
    secret_file.write_bytes(server_secret)
    secret_file.chmod(0o600)  # the gateway refuses a secret key others may read
    allowed = tmp_path / "clients"
    allowed.mkdir()
    _public_file, secret_path = zmq.auth.create_certificates(str(tmp_path), "client")
    (allowed / "client.key").write_bytes((tmp_path / "client.key").read_bytes())  # only its public key
    client_public, client_secret = zmq.auth.load_certificate(str(secret_path))
    with broker_with_gateway(tmp_path, "--tcp", "tcp://127.0.0.1:*", "--curve-secret-file", str(secret_file),
                             "--curve-clients", str(allowed)) as (_b, endpoints):
        tcp = next(e for e in endpoints if e.startswith("tcp://"))
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        try:
            sock = ctx.socket(zmq.DEALER)
            sock.curve_serverkey = server_public
            sock.curve_publickey = client_public
            sock.curve_secretkey = client_secret or b""
            sock.connect(tcp)
            x = np.random.default_rng(2).standard_normal((3, 256), dtype=np.float32)
            head, frames = infer_inline(sock, "tiny", "x", x)
            assert head["status"] == "OK"
            np.testing.assert_allclose(np.frombuffer(frames[0], np.float32).reshape(3, 256), direct("tiny", x),
                                       rtol=0, atol=1e-5)
        finally:
            ctx.destroy(linger=0)
        assert f"the public keys in --curve-clients {allowed} may connect (1)" in (tmp_path / "inline.log").read_text()


def _answers(endpoint: str) -> bool:
    """True when a gateway answers MsgKind.INLINE_MODELS on ``endpoint`` (a fresh DEALER, so a fresh connection)."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        sock = ctx.socket(zmq.DEALER)
        sock.connect(endpoint)
        sock.send_multipart([inline_envelope(MsgKind.INLINE_MODELS), b"{}"])
        return bool(sock.poll(60_000)) and sock.recv_multipart()[0] == inline_envelope(MsgKind.INLINE_MODELS_REPLY)
    finally:
        ctx.destroy(linger=0)


def test_a_second_gateway_on_the_runtime_dir_refuses_to_start(gateway: tuple[RunningBroker, list[str]]) -> None:
    b, endpoints = gateway
    path = b.runtime_dir / "inline.sock"
    before = path.stat().st_ino
    env = dict(os.environ, SHMBROKER_RUNTIME_DIR=str(b.runtime_dir))
    r = subprocess.run([*CLI, "inline"], env=env, cwd=REPO, capture_output=True,
                       text=True, timeout=60, check=False)
    assert r.returncode == 2, r.stderr
    assert str(path) in r.stderr and "another `shmbroker inline`" in r.stderr and "--runtime-dir" in r.stderr, r.stderr
    assert path.stat().st_ino == before  # not taken over: the first gateway still owns the file and answers on it
    assert _answers(endpoints[0])


def test_the_broker_leaves_a_live_gateways_socket_alone(tmp_path: Path) -> None:
    """The broker's stop and its next start (the janitor) remove their own socket files, not the gateway's;
    the gateway, stopped, removes its own."""
    b = start_broker(tmp_path, "process")
    proc: subprocess.Popen[str] | None = None
    try:
        proc, endpoints = start_inline(b, tmp_path / "inline.log")
        path = b.runtime_dir / "inline.sock"
        ino = path.stat().st_ino
        assert b.stop() == 0, b.log()
        assert sorted(p.name for p in b.runtime_dir.glob("*.sock")) == ["inline.sock"]
        assert path.stat().st_ino == ino and _answers(endpoints[0])
        b = start_broker(tmp_path, "process")  # same runtime dir: its janitor runs
        assert path.stat().st_ino == ino and _answers(endpoints[0])
        assert stop_inline(proc) == 0, (tmp_path / "inline.log").read_text()[-3000:]
        proc = None
        assert not path.exists()
    finally:
        if proc is not None:
            proc.kill()
        assert b.stop() == 0, b.log()


def test_a_gateway_removes_only_its_own_socket_and_a_dead_ones_is_stale(tmp_path: Path) -> None:
    """A gateway killed leaves its file, which the next gateway takes; a gateway that exits leaves a file put in
    its socket's place alone; the broker's stop removes a file nothing listens on."""
    b = start_broker(tmp_path, "process")
    path = b.runtime_dir / "inline.sock"
    try:
        first, _ = start_inline(b, tmp_path / "first.log")
        first.send_signal(signal.SIGKILL)
        first.wait(30)
        assert path.exists()  # stale: nothing listens, and the lock died with the process
        second, endpoints = start_inline(b, tmp_path / "second.log")
        assert _answers(endpoints[0])
        path.unlink()  # someone else's socket in its place: the gateway's exit must not remove it
        other = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            other.bind(str(path))
            other.listen()
            theirs = path.stat().st_ino
            assert stop_inline(second) == 0, (tmp_path / "second.log").read_text()[-3000:]
            assert path.exists() and path.stat().st_ino == theirs
        finally:
            other.close()
    finally:
        assert b.stop() == 0, b.log()
    assert not list(b.runtime_dir.glob("*.sock"))  # the other one's file refused connections: stale, removed
