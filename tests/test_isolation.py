"""Isolation between local users (the threat model in docs/ARCHITECTURE.md, "Access"): the boundary is the uid.

A member of the clients' group cannot pose as a worker, map another user's ring (even knowing its token),
take its answers, or shrink it; a client cannot shrink its own ring under the worker either; and the broker
judges a client's liveness by the pid the kernel reports, not the one HELLO claims. Children of other uids
need root to start (CI runs as root); the rest runs as any user.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import zmq

from shmbroker.broker.common import protocol as P
from shmbroker.broker.common import runtime
from shmbroker.broker.common.handout import HandoutError, fetch_ring
from shmbroker.broker.serving.sessions import FD_RESERVE, FDS_PER_SESSION
from shmbroker.client import Client, HandshakeError, ShmBrokerError
from tests.conftest import REPO, RunningBroker, arr, start_broker, wait_until
from tests.models import direct
from tests.rawclient import RawClient

root_only = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run children as other uids")
NOBODY, NOGROUP = 65534, 65534  # a member of the broker's group "nogroup" in these tests
X = np.ones((1, 256), np.float32)


@pytest.fixture
def group_broker() -> Iterator[RunningBroker]:
    """A process-mode broker whose clients' group is "nogroup", in a directory every uid can enter."""
    d = Path(tempfile.mkdtemp(prefix="shmb-iso-"))
    d.chmod(0o755)
    b = start_broker(d, "process", extra='group = "nogroup"')
    try:
        yield b
    finally:
        assert b.stop() == 0, b.log()
        shutil.rmtree(d, ignore_errors=True)


def run_as(uid: int, gid: int, code: str, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """Run ``code`` in a child that imports first (the interpreter may live where ``uid`` cannot read), then
    drops to ``uid``:``gid`` (keeping ``gid`` as its only group) and runs ``main(*argv[1:])``."""
    script = f"import os, sys\n{code}\nos.setgroups([{gid}]); os.setgid({gid}); os.setuid({uid})\nmain(*sys.argv[1:])\n"
    return subprocess.run([sys.executable, "-c", script, *args], cwd=REPO, env=dict(os.environ, PYTHONPATH=str(REPO)),
                          capture_output=True, text=True, timeout=timeout, check=False)


SERVED = """
import numpy as np
from shmbroker.client import Client
def main(rd):
    with Client(rd) as c:
        print("served", float(np.asarray(c.infer("tiny", np.ones((1, 256), np.float32))).sum()) > 0)
"""  # run_as's code: one session of the uid, served


def _ones(c: Client) -> float:
    return float(np.asarray(c.infer("tiny", np.ones((1, 256), np.float32))).sum())


# -- the worker channel ---------------------------------------------------------------------------------
@root_only
def test_a_group_member_cannot_reach_the_workers_socket(group_broker: RunningBroker) -> None:
    r = run_as(NOBODY, NOGROUP, """
import socket
def main(path):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.connect(path)
    except PermissionError:
        print("refused")
""", str(group_broker.runtime_dir / runtime.WORKERS_SOCKET))
    assert r.stdout.strip() == "refused", r.stdout + r.stderr


def test_a_process_that_is_not_a_worker_gets_no_session(group_broker: RunningBroker) -> None:
    """Even of the broker's own uid: a WORKER_HELLO from a process the broker did not start is ignored, so
    no ATTACH (tokens) ever reaches it."""
    b = group_broker
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        impostor = ctx.socket(zmq.DEALER)
        impostor.connect(runtime.endpoint(b.runtime_dir, runtime.WORKERS_SOCKET))
        impostor.send_multipart(P.encode(P.WorkerHello(P.PROTOCOL_VERSION, 0, os.getpid())))
        with Client(b.runtime_dir) as c:
            assert _ones(c) > 0  # a session was attached meanwhile, by the real worker
        assert not impostor.poll(500), "the impostor was sent a message"
        assert "refused a worker HELLO" in b.log()
    finally:
        ctx.destroy(linger=0)


# -- rings ----------------------------------------------------------------------------------------------
def test_rings_have_no_name_to_open(group_broker: RunningBroker) -> None:
    with Client(group_broker.runtime_dir) as c:
        assert _ones(c) > 0
        assert not [n for n in os.listdir("/dev/shm") if group_broker.instance in n]
        assert os.readlink(f"/proc/self/fd/{c.segment.fd}").startswith("/memfd:shmb-")


@root_only
def test_another_user_with_the_token_cannot_get_the_ring(group_broker: RunningBroker) -> None:
    b = group_broker
    c = RawClient(b.runtime_dir)  # a client whose token the test can read, as if it had leaked
    try:
        r = run_as(NOBODY, NOGROUP, """
from pathlib import Path
from shmbroker.broker.common.handout import HandoutError, fetch_ring
def main(rd, sid, token):
    try:
        fetch_ring(Path(rd), int(sid), int(token), 10)
        print("granted")
    except HandoutError as exc:
        print(exc)
""", str(b.runtime_dir), str(c.session_id), str(c.token))
        assert "this process's user is not the session's" in r.stdout, r.stdout + r.stderr
        # and a wrong token is refused for the session's own user too
        with pytest.raises(HandoutError, match="token is wrong"):
            fetch_ring(b.runtime_dir, c.session_id, c.token ^ 1, 10)
        fd = fetch_ring(b.runtime_dir, c.session_id, c.token, 10)  # the right one is granted
        os.close(fd)
    finally:
        c.close()


def test_nobody_can_resize_a_ring_and_the_worker_keeps_serving(group_broker: RunningBroker) -> None:
    """The client's own descriptor, or one reopened through /proc: the seals refuse both."""
    with Client(group_broker.runtime_dir) as c:
        assert _ones(c) > 0
        fd = os.open(f"/proc/self/fd/{c.segment.fd}", os.O_RDWR)
        try:
            for victim in (c.segment.fd, fd):
                with pytest.raises(PermissionError):
                    os.ftruncate(victim, 4096)
        finally:
            os.close(fd)
        assert _ones(c) > 0
        assert group_broker.health().ready


# -- replies --------------------------------------------------------------------------------------------
THIEF = """
import glob, zmq
def main(rd, seconds):
    ctx = zmq.Context()
    pulls = []
    for path in glob.glob(rd + "/w*-s*.sock"):
        s = ctx.socket(zmq.PULL)
        s.connect("ipc://" + path)
        pulls.append(s)
    print("ready", len(pulls), flush=True)
    poller = zmq.Poller()
    for s in pulls:
        poller.register(s, zmq.POLLIN)
    stolen = 0
    end = __import__("time").monotonic() + float(seconds)
    while __import__("time").monotonic() < end:
        for s, _ in poller.poll(100):
            s.recv_multipart()
            stolen += 1
    print("stolen", stolen, flush=True)
"""


@root_only
def test_another_user_cannot_take_a_sessions_answers(group_broker: RunningBroker) -> None:
    b = group_broker
    with Client(b.runtime_dir) as c:
        expected = _ones(c)
        proc = subprocess.Popen([sys.executable, "-c", f"import os, sys\n{THIEF}\nos.setgroups([{NOGROUP}]); "
                                 f"os.setgid({NOGROUP}); os.setuid({NOBODY})\nmain(*sys.argv[1:])\n",
                                 str(b.runtime_dir), "5"], cwd=REPO, env=dict(os.environ, PYTHONPATH=str(REPO)),
                                stdout=subprocess.PIPE, text=True)
        assert proc.stdout is not None
        ready = proc.stdout.readline().split()
        assert ready[0] == "ready" and int(ready[1]) >= 1, ready  # it found the reply socket files
        done = threading.Event()
        answers = []

        def load() -> None:
            while not done.is_set():
                answers.append(_ones(c))

        t = threading.Thread(target=load)
        t.start()
        out, _ = proc.communicate(timeout=60)
        done.set()
        t.join()
    assert out.split()[-1] == "0", out  # the worker refused its connections: nothing to steal
    assert len(answers) > 0 and all(a == expected for a in answers)
    assert "refused a connection from" in b.log()


@root_only
def test_one_user_at_its_cap_leaves_sessions_for_another() -> None:
    d = Path(tempfile.mkdtemp(prefix="shmb-iso-"))
    d.chmod(0o755)
    b = start_broker(d, "process", extra='group = "nogroup"',
                     sessions="default_slots = 2\nmax_sessions_per_uid = 2\nmax_sessions = 8")
    try:
        held = [Client(b.runtime_dir), Client(b.runtime_dir)]
        with pytest.raises(HandshakeError, match="max_sessions_per_uid"):
            Client(b.runtime_dir)
        r = run_as(NOBODY, NOGROUP, SERVED, str(b.runtime_dir))
        assert r.stdout.strip() == "served True", r.stdout + r.stderr
        for c in held:
            c.close()
    finally:
        assert b.stop() == 0, b.log()
        shutil.rmtree(d, ignore_errors=True)


@root_only
def test_at_the_open_files_cap_one_user_leaves_sessions_for_another() -> None:
    """The open-files limit allows 12 sessions, with the default caps (1024 sessions, 256 per uid): the per-uid
    cap scales with it to 3, so a uid that takes all it may, refused past them naming both settings, leaves
    sessions to another uid; the start log says the caps in effect."""
    d = Path(tempfile.mkdtemp(prefix="shmb-iso-"))
    d.chmod(0o755)
    b = start_broker(d, "process", extra='group = "nogroup"', sessions="default_slots = 1",
                     max_fds=FD_RESERVE + 12 * FDS_PER_SESSION)
    held: list[Client] = []
    try:
        with pytest.raises(HandshakeError) as refused:
            for _ in range(12):
                held.append(Client(b.runtime_dir))
        assert len(held) == 3, len(held)
        message = str(refused.value)
        assert refused.value.code == "LIMIT" and "max_sessions_per_uid" in message and "LimitNOFILE" in message
        r = run_as(NOBODY, NOGROUP, SERVED, str(b.runtime_dir))
        assert r.stdout.strip() == "served True", r.stdout + r.stderr
        assert "session caps: 12 sessions (the open-files limit: raise LimitNOFILE), 3 per uid" in b.log()
    finally:
        for c in held:
            c.close()
        assert b.stop() == 0, b.log()
        shutil.rmtree(d, ignore_errors=True)


# -- liveness -------------------------------------------------------------------------------------------
LIAR = """
import os, time, zmq
from pathlib import Path
from shmbroker.broker.common import protocol as P, runtime
from shmbroker.broker.common.handout import fetch_ring
def main(rd):
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.connect(runtime.endpoint(Path(rd), runtime.CONTROL_SOCKET))
    s.send_multipart(P.encode(P.Hello(P.PROTOCOL_VERSION, 1, 2, 0, "liar")))  # pid 1, and it takes no lock
    setup = P.decode(s.recv_multipart())
    fd = fetch_ring(Path(rd), setup.session_id, setup.token, 10)
    s.send_multipart(P.encode(P.Attached(setup.session_id)))
    P.decode(s.recv_multipart())
    print("ready", flush=True)
    time.sleep(3600)
"""


def test_a_client_that_lies_about_its_pid_is_reaped_when_it_dies(group_broker: RunningBroker) -> None:
    b = group_broker
    proc = subprocess.Popen([sys.executable, "-c", f"{LIAR}\nimport sys\nmain(sys.argv[1])\n", str(b.runtime_dir)],
                            cwd=REPO, env=dict(os.environ, PYTHONPATH=str(REPO)), stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "ready"
    assert len(b.segments()) == 1
    proc.kill()
    proc.wait()
    wait_until(lambda: not b.segments(), "the broker reaps the dead client's session")
    assert f"client pid {proc.pid} is gone" in b.log()


# -- the ring handout under a flood ----------------------------------------------------------------------
FLOODER = """
import collections, socket, sys, time
def main(path, hold, seconds):
    held = collections.deque()
    made = 0
    end = time.monotonic() + float(seconds)
    print("ready", flush=True)
    while time.monotonic() < end:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        s.setblocking(False)
        try:
            s.connect(path)
        except OSError:  # the backlog is full: try again, as fast as it goes
            s.close()
            continue
        made += 1
        held.append(s)
        if len(held) > int(hold):
            held.popleft().close()
    print("made", made, flush=True)
"""
FLOOD_HOLD = 1200  # silent connections the flooder keeps open (the reported attack)


@root_only
def test_a_member_flooding_rings_sock_leaves_every_session_served(group_broker: RunningBroker) -> None:
    """A group member holds ~1,200 silent connections to rings.sock and opens more as fast as it can: every
    session opened meanwhile by another uid gets its ring and a worker, and every request is answered."""
    b = group_broker
    proc = subprocess.Popen([sys.executable, "-c", f"import os, sys\n{FLOODER}\nos.setgroups([{NOGROUP}]); "
                             f"os.setgid({NOGROUP}); os.setuid({NOBODY})\nmain(*sys.argv[1:])\n",
                             str(b.runtime_dir / runtime.RINGS_SOCKET), str(FLOOD_HOLD), "8"],
                            cwd=REPO, env=dict(os.environ, PYTHONPATH=str(REPO)), stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    try:
        assert proc.stdout.readline().strip() == "ready"
        failures: list[str] = []
        sessions = 0
        while proc.poll() is None and sessions < 40:
            try:
                with Client(b.runtime_dir, slots=2, connect_timeout=30) as c:
                    for _ in range(3):
                        np.testing.assert_allclose(arr(c.infer("tiny", X)), direct("tiny", X), rtol=0, atol=1e-5)
                sessions += 1
            except ShmBrokerError as exc:
                failures.append(f"{type(exc).__name__}: {exc}")
        out, _ = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert not failures, failures[:5]
    assert sessions >= 5, (sessions, out)  # the flood lasted long enough to meet several sessions
    assert int(out.split()[-1]) > FLOOD_HOLD, out  # it made more connections than it held: a flood
    assert b.health().ready
