"""One client must not take the service down: hostile control messages, oversized frames, leftover sockets.

Real processes throughout (``shmbroker serve``, its worker process, ``shmbroker http``), peers built from
raw ZeroMQ sockets as a hostile program would:

- JSON nested far deeper than the decoder recurses, in a HELLO (broker.sock), a WORKER_HELLO (workers.sock)
  and an HTTP infer body: answered as a malformed message (ERROR BAD_MESSAGE, HTTP 400), never a crash;
- frames over the receiving socket's ZMQ_MAXMSGSIZE (a SUBMIT to a worker, a HELLO to the broker): ZeroMQ
  closes that peer's connection before anything is decoded; every other peer goes on being served, and the
  offender's socket reconnects and is served again once it sends legal messages; a peer that does so in a
  loop gets connections at its uid's pace only (broker.common.peergate);
- a SUBMIT's header (session and token) is checked before its body is decoded;
- a killed worker's reply socket files are removed when the broker reaps it.
"""

from __future__ import annotations

import os
import signal
import struct
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import zmq
from zmq.utils.monitor import recv_monitor_message

from shmbroker.broker.common import protocol as P
from shmbroker.broker.common import runtime
from shmbroker.broker.common.peergate import CONNECTS_PER_S
from shmbroker.client import Client, WorkerDied
from tests.conftest import (
    REPO,
    TINY_MODELS,
    RunningBroker,
    arr,
    running_broker,
    start_broker,
    wait_for_new_worker,
)
from tests.frontends import start_frontend
from tests.models import direct
from tests.rawclient import RawClient

X = np.ones((1, 256), np.float32)
DEPTH = 1000  # the reported HELLO: about 2 KiB, past the recursion limit of any Python decoder's call stack
WAIT_MS = 20_000
OVERSIZED = 16 << 20  # a frame far past both sockets' bounds; still a cheap allocation for the test itself


def nested(depth: int = DEPTH) -> bytes:
    return b"[" * depth + b"]" * depth


def monitored_dealer(ctx: zmq.Context[zmq.Socket[bytes]], endpoint: str
                     ) -> tuple[zmq.Socket[bytes], zmq.Socket[bytes]]:
    """A DEALER connected to ``endpoint`` and a monitor of its connection (handshake and disconnect events)."""
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    mon = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED)
    sock.connect(endpoint)
    wait_event(mon, zmq.EVENT_HANDSHAKE_SUCCEEDED)
    return sock, mon


def wait_event(mon: zmq.Socket[bytes], event: int, timeout_ms: int = WAIT_MS) -> None:
    """Block until the monitor reports ``event``; AssertionError when it does not come in time."""
    end = time.monotonic() + timeout_ms / 1e3
    while (left := end - time.monotonic()) > 0:
        if not mon.poll(int(left * 1000)):
            break
        if recv_monitor_message(mon)["event"] == event:
            return
    raise AssertionError(f"no monitor event {event} within {timeout_ms} ms")


def answer(sock: zmq.Socket[bytes], timeout_ms: int = WAIT_MS) -> object:
    """The next control message on ``sock``, decoded; AssertionError when none comes in time."""
    assert sock.poll(timeout_ms), "no answer"
    return P.decode(sock.recv_multipart())


def assert_serving(b: RunningBroker) -> None:
    """The broker process is alive and a fresh client gets a correct result."""
    assert b.proc.poll() is None, f"the broker exited {b.proc.returncode}\n{b.log()}"
    with Client(b.runtime_dir, connect_timeout=20) as c:
        np.testing.assert_allclose(arr(c.infer("tiny", X)), direct("tiny", X), rtol=0, atol=1e-5)


def dropped(b: RunningBroker) -> dict[str, int]:
    return dict(b.stats().workers[0].dropped)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningBroker]:
    with running_broker(tmp_path_factory.mktemp("hostile-msgs"), models=TINY_MODELS) as b:
        yield b


@pytest.fixture
def ctx() -> Iterator[zmq.Context[zmq.Socket[bytes]]]:
    c: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        yield c
    finally:
        c.destroy(linger=0)


# -- 1. JSON nested too deep -----------------------------------------------------------------------------
def test_deeply_nested_hello_gets_bad_message_and_the_broker_keeps_serving(
        tiny: RunningBroker, ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    with Client(tiny.runtime_dir) as bystander:  # a session open before, and after, the attack
        sock, _mon = monitored_dealer(ctx, runtime.endpoint(tiny.runtime_dir, runtime.CONTROL_SOCKET))
        body = b'{"protocol":1,"pid":%d,"x":%s}' % (os.getpid(), nested())
        sock.send_multipart([P.envelope(P.MsgKind.HELLO), body])
        err = answer(sock)
        assert isinstance(err, P.ErrorReply) and err.code == "BAD_MESSAGE", err
        assert "HELLO" in err.message and "nest" in err.message, err.message
        assert_serving(tiny)
        np.testing.assert_allclose(arr(bystander.infer("tiny", X)), direct("tiny", X), rtol=0, atol=1e-5)


def test_deeply_nested_worker_hello_gets_bad_message_and_the_broker_keeps_serving(
        tiny: RunningBroker, ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    sock, _mon = monitored_dealer(ctx, runtime.endpoint(tiny.runtime_dir, runtime.WORKERS_SOCKET))
    # worker_id out of range: were it ever decoded, the broker would refuse it rather than take it for worker 0
    body = b'{"protocol":1,"worker_id":999,"pid":%d,"x":%s}' % (os.getpid(), nested())
    sock.send_multipart([P.envelope(P.MsgKind.WORKER_HELLO), body])
    err = answer(sock)
    assert isinstance(err, P.ErrorReply) and err.code == "BAD_MESSAGE", err
    assert "WORKER_HELLO" in err.message, err.message
    assert_serving(tiny)
    assert tiny.stats().workers[0].restarts == 0


def test_deeply_nested_json_over_http_is_400_naming_the_body(tmp_path: Path) -> None:
    b = start_broker(tmp_path, "process", models=TINY_MODELS)
    front = None
    try:
        front = start_frontend(b, tmp_path / "http.log", workers=1)
        good = b'{"inputs":[{"name":"x","datatype":"FP32","shape":[1,256],"data":[%s]}]}' % b",".join([b"1"] * 256)
        bad = good[:-1] + b',"x":%s}' % nested()
        status, _h, reply = front.raw("POST", "/v2/models/tiny/infer", bad, {"Content-Type": "application/json"})
        assert status == 400, (status, reply)
        assert b"request body" in reply and b"nest" in reply, reply
        status, _h, reply = front.raw("POST", "/v2/models/tiny/infer", good, {"Content-Type": "application/json"})
        assert status == 200, (status, reply)
    finally:
        if front is not None:
            front.proc.send_signal(signal.SIGTERM)
            assert front.proc.wait(60) == 0, front.log_path.read_text()[-4000:]
        assert b.stop() == 0, b.log()


# -- 2. oversized frames ---------------------------------------------------------------------------------
def test_oversized_submit_is_refused_before_decoding_and_the_worker_keeps_serving(tiny: RunningBroker) -> None:
    """A SUBMIT of 16 MiB (a consistent header and a wrong token) is over the data socket's ZMQ_MAXMSGSIZE:
    ZeroMQ closes the sender's connection and the worker never sees it (no drop counted); others go on, and
    the sender's PUSH reconnects and is served again."""
    raw = RawClient(tiny.runtime_dir)
    try:
        worker = tiny.worker_pids()
        before = dropped(tiny)
        with Client(tiny.runtime_dir) as bystander:
            mon = raw.link.push.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED)
            n = OVERSIZED // (P.REQUEST.size + P.TENSOR.size)
            head = P.SUBMIT_HEADER.pack(raw.session_id, n, n, 0, raw.token ^ 1)
            raw.send_frames([P.envelope(P.MsgKind.SUBMIT), head + bytes(n * (P.REQUEST.size + P.TENSOR.size))])
            wait_event(mon, zmq.EVENT_DISCONNECTED)
            wait_event(mon, zmq.EVENT_HANDSHAKE_SUCCEEDED)  # the PUSH reconnects on its own
            np.testing.assert_allclose(arr(bystander.infer("tiny", X)), direct("tiny", X), rtol=0, atol=1e-5)
            raw.link.push.disable_monitor()
            mon.close(0)
        raw.send(raw.prepare(0, "tiny", X))  # the offender, legal again, is served
        (r,) = raw.recv() or []
        assert r.status == P.Status.OK, r.message
        np.testing.assert_allclose(raw.output(r, "tiny"), direct("tiny", X), rtol=0, atol=1e-5)
        assert dropped(tiny) == before, "the worker decoded the oversized SUBMIT"
        assert tiny.worker_pids() == worker
        assert_serving(tiny)
    finally:
        raw.close()
    assert P.max_submit_bytes(1) < OVERSIZED


RECONNECTOR = """
import time, zmq
from zmq.utils.monitor import recv_monitor_message
from shmbroker.broker.common import protocol as P
def main(endpoint, sockets, seconds, nbytes):
    ctx = zmq.Context()
    frames = [P.envelope(P.MsgKind.SUBMIT), zmq.Frame(bytes(int(nbytes)))]  # session 0, token 0: a wrong one
    socks, mons = [], []
    for _ in range(int(sockets)):
        s = ctx.socket(zmq.PUSH)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.RECONNECT_IVL, 1)  # reconnect at once after each drop
        mons.append(s.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED))
        s.connect(endpoint)
        socks.append(s)
    poller = zmq.Poller()
    for m in mons:
        poller.register(m, zmq.POLLIN)
    print("ready", flush=True)
    handshakes, t0 = 0, time.monotonic()
    while time.monotonic() - t0 < float(seconds):
        for s in socks:
            try:
                s.send_multipart(frames, zmq.NOBLOCK, copy=False)
            except zmq.Again:
                pass
        for m, _ in poller.poll(1):
            recv_monitor_message(m)
            handshakes += 1
    print("handshakes", handshakes, time.monotonic() - t0, flush=True)
"""


def test_a_peer_looping_oversized_frames_is_paced_and_others_are_served(tmp_path: Path) -> None:
    """50 sockets send SUBMITs over the data socket's ZMQ_MAXMSGSIZE and reconnect at once after each drop:
    the worker admits that uid's connections at its pace only (its burst, then CONNECTS_PER_S), so the
    loop cannot keep the worker's IO thread busy; a session open meanwhile gets every answer, right."""
    per_uid = 4
    b = start_broker(tmp_path, "process", models=TINY_MODELS,
                     sessions=f"default_slots = 8\nmax_sessions_per_uid = {per_uid}\nmax_sessions = 8")
    try:
        worker = b.worker_pids()
        before = dropped(b)
        with Client(b.runtime_dir) as bystander:
            proc = subprocess.Popen([sys.executable, "-c", f"{RECONNECTOR}\nimport sys\nmain(*sys.argv[1:])\n",
                                     runtime.worker_endpoint(b.runtime_dir, 0), "50", "5", str(OVERSIZED)],
                                    cwd=REPO, env=dict(os.environ, PYTHONPATH=str(REPO)), stdout=subprocess.PIPE,
                                    text=True)
            assert proc.stdout is not None
            try:
                assert proc.stdout.readline().strip() == "ready"
                answered = 0
                while proc.poll() is None:
                    np.testing.assert_allclose(arr(bystander.infer("tiny", X)), direct("tiny", X), rtol=0, atol=1e-5)
                    answered += 1
                out, _ = proc.communicate(timeout=60)
            finally:
                proc.kill()
            assert answered > 0
        _, handshakes, elapsed = out.split()
        burst = 2 * per_uid  # the worker's: a data and a reply connection per session
        assert int(handshakes) <= burst + CONNECTS_PER_S * (float(elapsed) + 1), out
        decoded = (P.DropReason.MALFORMED, P.DropReason.UNKNOWN_SESSION, P.DropReason.WRONG_TOKEN)
        after = dropped(b)
        assert [after.get(k, 0) for k in decoded] == [before.get(k, 0) for k in decoded], "an oversized SUBMIT was read"
        assert b.worker_pids() == worker and b.stats().workers[0].restarts == 0
        assert_serving(b)  # the offender's uid is served again once it stops
    finally:
        assert b.stop_released() == 0, b.log()


def test_submit_header_is_checked_before_the_body(tiny: RunningBroker) -> None:
    """A SUBMIT with a wrong token is dropped for the token (M6) before its body is decoded: a descriptor
    with ndim 9 (M4) in it is never looked at."""
    raw = RawClient(tiny.runtime_dir)
    try:
        before = dropped(tiny)
        frames = P.encode_submit(P.SubmitBatch(raw.session_id, raw.token ^ 1, [raw.prepare(1, "tiny", X)]))
        body = bytearray(frames[1])
        struct.pack_into("<B", body, P.SUBMIT_HEADER.size + P.REQUEST.size + 3, 9)  # tensor 0's ndim
        raw.send_frames([frames[0], bytes(body)])
        raw.send(raw.prepare(2, "tiny", X))  # answered after the drop: the worker took both, in order
        (r,) = raw.recv() or []
        assert r.status == P.Status.OK, r.message
        after = dropped(tiny)
        moved = {k: after.get(k, 0) - before.get(k, 0) for k in after}
        assert moved == {"wrong_token": 1}, (before, after)
    finally:
        raw.close()


def test_oversized_hello_is_refused_and_other_clients_are_unaffected(
        tiny: RunningBroker, ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    """A HELLO over the control socket's ZMQ_MAXMSGSIZE closes that peer's connection, undecoded (no reply,
    no session); a HELLO within it whose name is too long is BAD_MESSAGE naming the field. The offender's
    DEALER reconnects (with a new routing id) and is answered again; a session open meanwhile is untouched."""
    with Client(tiny.runtime_dir) as bystander:
        sock, mon = monitored_dealer(ctx, runtime.endpoint(tiny.runtime_dir, runtime.CONTROL_SOCKET))
        body = b'{"protocol":1,"pid":%d,"name":"%s"}' % (os.getpid(), b"n" * OVERSIZED)
        sock.send_multipart([P.envelope(P.MsgKind.HELLO), body])
        wait_event(mon, zmq.EVENT_DISCONNECTED)
        wait_event(mon, zmq.EVENT_HANDSHAKE_SUCCEEDED)
        sock.send_multipart(P.encode(P.Health()))
        assert isinstance(answer(sock), P.HealthReply)  # the first answer: the HELLO got none
        long_name = "n" * (P.HELLO_NAME_MAX + 1)
        sock.send_multipart(P.encode(P.Hello(P.PROTOCOL_VERSION, os.getpid(), 1, 1, long_name)))
        err = answer(sock)
        assert isinstance(err, P.ErrorReply) and err.code == "BAD_MESSAGE" and "$.name" in err.message, err
        np.testing.assert_allclose(arr(bystander.infer("tiny", X)), direct("tiny", X), rtol=0, atol=1e-5)
    assert_serving(tiny)
    assert OVERSIZED > P.CONTROL_MAXMSGSIZE > len(P.encode(P.Hello(1, 1, 1, 1, "n" * P.HELLO_NAME_MAX))[1])


# -- 3. leftover sockets ---------------------------------------------------------------------------------
def reply_sockets(b: RunningBroker, worker_id: int) -> set[str]:
    return {p.name for p in b.runtime_dir.glob(f"w{worker_id}-s*-*.sock")}


def served_again(c: Client, limit: float = 30.0) -> None:
    """Wait until ``c`` is served by the restarted worker: its link comes with WORKER_UP, once the worker has
    bound the session's new reply socket. A request on the dead worker's link, which the client may not
    have dropped yet, fails WorkerDied at once: then wait for the new link (no sleep) and ask again."""
    end = time.monotonic() + limit
    while True:
        try:
            np.testing.assert_allclose(arr(c.infer("tiny", X)), direct("tiny", X), rtol=0, atol=1e-5)
            return
        except WorkerDied:
            if time.monotonic() > end:
                raise
            c.wait_ready("tiny", max(0.1, end - time.monotonic()))


def test_killed_workers_reply_sockets_are_removed_when_it_is_reaped(tmp_path: Path) -> None:
    b = start_broker(tmp_path, "process", models=TINY_MODELS)
    try:
        with Client(b.runtime_dir) as c1, Client(b.runtime_dir) as c2:
            for c in (c1, c2):
                np.testing.assert_allclose(arr(c.infer("tiny", X)), direct("tiny", X), rtol=0, atol=1e-5)
            old = reply_sockets(b, 0)
            assert len(old) == 2, old
            (worker,) = b.worker_pids()
            os.kill(worker, signal.SIGKILL)
            wait_for_new_worker(b, worker)
            assert b.health(wait_s=60).ready
            for c in (c1, c2):
                served_again(c)
            new = reply_sockets(b, 0)
            assert not old & new, f"the dead worker's reply sockets are still there: {sorted(old & new)}"
            assert len(new) == 2, new
    finally:
        assert b.stop_released() == 0, b.log()
