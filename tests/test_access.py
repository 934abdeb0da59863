"""Access (bench/RESULTS.md#reliability, item 6): who can reach a broker and its rings, and what error texts give away.

Segment and socket modes are checked in tests/test_lifecycle.py (0600 by default; 0660 and the group with
``broker.group``), as is a child of another uid failing to open a segment. Here, run as root, children of
other uids try the whole handshake, and every error text a client can provoke is checked for segment
names and paths. The TCP endpoint is the inline gateway's (for callers that cannot map shared memory): an
unauthenticated client is refused.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import msgspec
import numpy as np
import pytest
import zmq
import zmq.auth
import zmq.utils.monitor

from shmbroker.broker.common import protocol as P
from shmbroker.broker.common.runtime import CONTROL_SOCKET, endpoint
from shmbroker.client import Client
from tests.conftest import REPO, RunningBroker, start_broker
from tests.frontends import start_inline, stop_inline

root_only = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run children as other uids")

# Imports first (the interpreter lives under /root, which other uids cannot read), then drop to uid/gid,
# then try a session and one request. Exit 0: served; 13: refused; the error text goes to stdout.
CHILD = """
import os, sys
import numpy as np
from shmbroker.client import Client, ShmBrokerError
uid, gid = int(sys.argv[1]), int(sys.argv[2])
os.setgroups([]); os.setgid(gid); os.setuid(uid)
try:
    with Client(sys.argv[3], connect_timeout=1.5) as c:
        c.infer("tiny", np.ones((1, 256), np.float32))
except (ShmBrokerError, OSError) as exc:
    print(f"{type(exc).__name__}: {exc}")
    sys.exit(13)
sys.exit(0)
"""


def session_as(uid: int, gid: int, runtime_dir: Path) -> tuple[int, str]:
    r = subprocess.run([sys.executable, "-c", CHILD, str(uid), str(gid), str(runtime_dir)], cwd=REPO,
                       env=dict(os.environ, PYTHONPATH=str(REPO)), capture_output=True, text=True, timeout=60,
                       check=False)
    return r.returncode, r.stdout + r.stderr


def no_secrets(text: str) -> None:
    """No segment name, /dev/shm path or runtime-dir socket path in a text a client is shown."""
    for needle in ("shmb-", "/dev/shm", ".sock"):
        assert needle not in text, f"{needle!r} leaked in: {text}"


@pytest.fixture
def public_tmp() -> Iterator[Path]:
    """A directory every uid can enter (pytest's are private to root): only the broker's own modes count."""
    d = Path(tempfile.mkdtemp(prefix="shmb-access-"))
    d.chmod(0o755)
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


@root_only
def test_other_uid_cannot_complete_a_handshake(public_tmp: Path) -> None:
    b = start_broker(public_tmp, "process")
    try:
        code, out = session_as(65534, 65534, b.runtime_dir)
        assert code == 13, out
        assert "HandshakeError" in out
        no_secrets(out)
        # even with the runtime directory opened up by mistake, the 0600 socket file refuses the connection
        os.chmod(b.runtime_dir, 0o755)
        try:
            code, out = session_as(65534, 65534, b.runtime_dir)
        finally:
            os.chmod(b.runtime_dir, 0o700)
        assert code == 13, out
        no_secrets(out)
        with Client(b.runtime_dir) as c:  # the owner is still served
            c.infer("tiny", np.ones((1, 256), np.float32))
    finally:
        assert b.stop() == 0, b.log()


@root_only
def test_group_members_are_served_and_others_refused(public_tmp: Path) -> None:
    b = start_broker(public_tmp, "process", extra='group = "nogroup"')
    try:
        code, out = session_as(65534, 65534, b.runtime_dir)  # nobody:nogroup, a member of the group
        assert code == 0, out
        code, out = session_as(65533, 65533, b.runtime_dir)  # another user, outside the group
        assert code == 13, out
        no_secrets(out)
    finally:
        assert b.stop_released() == 0, b.log()


def control_errors(runtime_dir: Path, msgs: list[msgspec.Struct]) -> list[P.ErrorReply]:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.connect(endpoint(runtime_dir, CONTROL_SOCKET))
    out = []
    try:
        for m in msgs:
            s.send_multipart(P.encode(m))
            if isinstance(m, P.Bye):
                continue  # BYE is never answered
            assert s.poll(10_000), f"no answer to {m}"
            reply = P.decode(s.recv_multipart())
            assert isinstance(reply, P.ErrorReply), reply
            out.append(reply)
    finally:
        ctx.destroy(linger=0)
    return out


def test_error_texts_name_no_segment_or_path(process_broker: RunningBroker) -> None:
    """Errors a client can provoke about its own and other sessions show no segment name or path."""
    with Client(process_broker.runtime_dir) as victim:
        errs = control_errors(process_broker.runtime_dir, [
            P.Attached(victim.session_id),  # another user's session
            P.Bye(victim.session_id),  # not its owner: ignored (no answer), the Attached below is answered
            P.Attached(victim.session_id),
            P.Hello(P.PROTOCOL_VERSION, os.getpid(), 1, -1, "x"),  # BAD_HELLO max_items
            P.Hello(P.PROTOCOL_VERSION, os.getpid(), 10**6, 1, "x"),  # BAD_HELLO slots
            P.Ready(victim.session_id, 1, []),  # not for the broker: BAD_MESSAGE
        ])
        assert [e.code for e in errs] == ["BAD_SESSION", "BAD_SESSION", "BAD_HELLO", "BAD_HELLO", "BAD_MESSAGE"]
        victim.infer("tiny", np.ones((1, 256), np.float32))  # its session is untouched
        for e in errs:
            no_secrets(e.message)


HANDSHAKE_FAILED = (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                    | zmq.EVENT_HANDSHAKE_FAILED_AUTH)


def handshake_outcome(ctx: zmq.Context[zmq.Socket[bytes]], endpoint_: str, server_key: bytes | None,
                      keys: tuple[bytes, bytes] | None) -> int:
    """Connect a DEALER (CURVE when ``server_key`` is given) and return the first handshake event it sees."""
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if server_key is not None and keys is not None:
        sock.curve_serverkey = server_key
        sock.curve_publickey, sock.curve_secretkey = keys
    mon = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | HANDSHAKE_FAILED)
    sock.connect(endpoint_)
    assert mon.poll(30_000), "no handshake event"
    event = zmq.utils.monitor.recv_monitor_message(mon)["event"]
    sock.disable_monitor()
    mon.close(0)
    sock.close(0)
    return int(event)


def test_tcp_endpoint_refuses_unauthenticated_clients(process_broker: RunningBroker, tmp_path: Path) -> None:
    """The inline gateway's TCP endpoint (off by default, and it refuses to start without CURVE:
    tests/test_inline.py) completes a handshake only with a client whose public key it was given."""
    server_public, server_secret = zmq.curve_keypair()
    (tmp_path / "server.key").write_bytes(server_secret)
    (tmp_path / "server.key").chmod(0o600)  # the gateway refuses a key that others may read
    allowed = tmp_path / "clients"
    allowed.mkdir()
    _pub, secret_path = zmq.auth.create_certificates(str(tmp_path), "client")
    (allowed / "client.key").write_bytes((tmp_path / "client.key").read_bytes())  # its public key only
    client_public, client_secret = zmq.auth.load_certificate(str(secret_path))
    proc, endpoints = start_inline(process_broker, tmp_path / "tcp.log", "--tcp", "tcp://127.0.0.1:*",
                                   "--curve-secret-file", str(tmp_path / "server.key"), "--curve-clients",
                                   str(allowed))
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        tcp = next(e for e in endpoints if e.startswith("tcp://"))
        assert handshake_outcome(ctx, tcp, None, None) & HANDSHAKE_FAILED  # no CURVE at all
        stranger = zmq.curve_keypair()  # CURVE, but a key the gateway was not given
        assert handshake_outcome(ctx, tcp, server_public, stranger) & HANDSHAKE_FAILED
        known = (client_public, client_secret or b"")
        assert handshake_outcome(ctx, tcp, server_public, known) == zmq.EVENT_HANDSHAKE_SUCCEEDED
    finally:
        ctx.destroy(linger=0)
        assert stop_inline(proc) == 0
