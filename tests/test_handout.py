"""broker.common.handout: the ring handout over a real SOCK_SEQPACKET socket, served as the broker's loop serves it.

Another uid's refusal needs children of other uids: tests/test_isolation.py.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import select
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from shmbroker.broker.common import handout as handout_module
from shmbroker.broker.common import protocol as P
from shmbroker.broker.common import runtime
from shmbroker.broker.common.handout import Grantable, HandoutError, RingHandout, fetch_ring, peer_of_address
from shmbroker.broker.common.ring import RingLayout, Segment, segment_name

LAYOUT = RingLayout(session_id=5, n_slots=2, in_capacity=512, out_capacity=512)
TOKEN = 0x1234_5678_9ABC


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[Path, Segment, RingHandout]]:
    """A handout for one session, served by a thread that polls and dispatches like the broker's loop."""
    with serving(tmp_path, timeout_s=0.5) as s:
        yield s


@contextlib.contextmanager
def serving(tmp_path: Path, timeout_s: float) -> Iterator[tuple[Path, Segment, RingHandout]]:
    """``served`` with a handshake timeout of ``timeout_s``."""
    seg = Segment.create(segment_name("test", LAYOUT.session_id), LAYOUT)

    def lookup(session_id: int, token: int) -> Grantable | None:
        return Grantable(seg, os.getuid()) if (session_id, token) == (LAYOUT.session_id, TOKEN) else None

    handout = RingHandout(tmp_path / runtime.RINGS_SOCKET, 0o600, None, lookup, timeout_s=timeout_s)
    stop = threading.Event()

    def loop() -> None:
        while not stop.is_set():
            ready, _, _ = select.select(handout.fds(), [], [], 0.05)
            now = time.monotonic()
            for fd in ready:
                handout.on_readable(fd, now)
            handout.expire(now)

    t = threading.Thread(target=loop, daemon=True)
    t.start()
    try:
        yield tmp_path, seg, handout
    finally:
        stop.set()
        t.join()
        handout.close()
        seg.close()


def test_the_right_token_gets_the_ring_with_a_lock_of_its_own(served: tuple[Path, Segment, RingHandout]) -> None:
    rd, seg, _ = served
    fd = fetch_ring(rd, LAYOUT.session_id, TOKEN, 5)
    got = Segment.from_fd(fd, LAYOUT)
    try:
        seg.publish_slot(1, P.SlotState.DONE, 3, 7, 0)
        assert got.read_slot(1) == (P.SlotState.DONE, 3, 7, 0)  # the same memory
        fcntl.flock(got.fd, fcntl.LOCK_SH)  # the client's liveness lock, seen by the broker's probe
        with pytest.raises(BlockingIOError):
            fcntl.flock(seg.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    finally:
        got.close()


@pytest.mark.parametrize(("session_id", "token"), [(LAYOUT.session_id, TOKEN ^ 1), (99, TOKEN)])
def test_a_wrong_session_or_token_gets_no_ring(served: tuple[Path, Segment, RingHandout], session_id: int,
                                               token: int) -> None:
    with pytest.raises(HandoutError, match="the session is gone or the token is wrong"):
        fetch_ring(served[0], session_id, token, 5)


@pytest.mark.parametrize("request_bytes", [b"", b"\x00" * 15, b"\x00" * 17,
                                           P.RING_REQUEST.pack(P.MsgKind.RING_REQUEST, 1, LAYOUT.session_id, TOKEN),
                                           P.RING_REQUEST.pack(P.MsgKind.HELLO, P.PROTOCOL_VERSION, 5, TOKEN)])
def test_a_malformed_request_gets_bad_request_and_no_descriptor(served: tuple[Path, Segment, RingHandout],
                                                                request_bytes: bytes) -> None:
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as s:
        s.settimeout(5)
        s.connect(str(served[0] / runtime.RINGS_SOCKET))
        s.send(request_bytes)
        data, fds, _flags, _addr = socket.recv_fds(s, 64, 1)
    assert fds == []
    assert P.RING_GRANT.unpack(data)[:2] == (P.MsgKind.RING_GRANT, P.GrantStatus.BAD_REQUEST)


def test_a_silent_connection_is_closed_and_others_are_served(served: tuple[Path, Segment, RingHandout]) -> None:
    rd, _, handout = served
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as silent:
        silent.settimeout(10)
        silent.connect(str(rd / runtime.RINGS_SOCKET))
        os.close(fetch_ring(rd, LAYOUT.session_id, TOKEN, 5))  # served meanwhile
        assert silent.recv(64) == b""  # closed by the broker after its timeout, unanswered
    assert handout.fds() == handout.fds()[:1]  # only the listener is left


def test_a_silent_connection_is_closed_long_before_the_handshake_timeout(tmp_path: Path) -> None:
    """A peer sends its request right after connecting: one that sends nothing is closed after
    FIRST_BYTES_S, not held for the handshake timeout (60 s here)."""
    with serving(tmp_path, timeout_s=60) as (rd, _, _), socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as silent:
        silent.settimeout(30)
        silent.connect(str(rd / runtime.RINGS_SOCKET))
        assert silent.recv(64) == b""  # closed unanswered
    assert handout_module.FIRST_BYTES_S * 10 < 30


def test_a_uid_keeps_a_bounded_number_of_silent_connections(tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """Past MAX_PENDING_PER_UID silent connections of one uid, its oldest are closed; the rest wait, and a
    request is still served."""
    monkeypatch.setattr(handout_module, "FIRST_BYTES_S", 60.0)  # none expires during the test
    cap, extra = handout_module.MAX_PENDING_PER_UID, 4
    with serving(tmp_path, timeout_s=60) as (rd, _, handout), contextlib.ExitStack() as stack:
        silent = []
        for _ in range(cap + extra):
            s = stack.enter_context(socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET))
            s.settimeout(30)
            s.connect(str(rd / runtime.RINGS_SOCKET))
            silent.append(s)
        for s in silent[:extra]:  # the oldest go, once the newest are accepted
            assert s.recv(64) == b""
        assert len(handout.fds()) == 1 + cap
        os.close(fetch_ring(rd, LAYOUT.session_id, TOKEN, 30))


def answer_all(listener: socket.socket, unanswered: int, served: threading.Event) -> None:
    """Accept every connection: close the first ``unanswered`` unread, answer the next NO_SESSION."""
    while True:
        conn, _ = listener.accept()
        with conn:
            if unanswered:
                unanswered -= 1
                continue
            conn.recv(64)
            conn.send(P.RING_GRANT.pack(P.MsgKind.RING_GRANT, P.GrantStatus.NO_SESSION, 0))
            served.set()
            return


def test_a_full_backlog_makes_the_fetch_wait_for_room(tmp_path: Path) -> None:
    """While the handout's backlog is full, connect waits (in the kernel) for room instead of failing with
    EAGAIN; the answer then comes through."""
    path = tmp_path / runtime.RINGS_SOCKET
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as listener, contextlib.ExitStack() as stack:
        listener.bind(str(path))
        listener.listen(0)
        filled = 0  # connections that took a place in the backlog
        while True:
            s = stack.enter_context(socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET))
            s.setblocking(False)
            try:
                s.connect(str(path))
            except BlockingIOError:
                break
            filled += 1
        outcome: list[BaseException] = []

        def fetch() -> None:
            try:
                fetch_ring(tmp_path, LAYOUT.session_id, TOKEN, 30)
            except HandoutError as exc:
                outcome.append(exc)

        fetcher = threading.Thread(target=fetch)
        fetcher.start()
        fetcher.join(0.5)  # a fetch that fails on a full backlog has failed by now; one that waits, waits on
        served = threading.Event()
        server = threading.Thread(target=answer_all, args=(listener, filled, served), daemon=True)
        server.start()
        fetcher.join(60)
        server.join(10)  # it sets ``served`` just after its answer, which the fetch may have read before that
    assert served.is_set(), f"the fetch's connection was not answered: outcome {outcome}, {filled} filled the backlog"
    assert len(outcome) == 1 and "the session is gone or the token is wrong" in str(outcome[0]), outcome


def test_a_connection_closed_unanswered_is_asked_again(tmp_path: Path) -> None:
    path = tmp_path / runtime.RINGS_SOCKET
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as listener:
        listener.bind(str(path))
        listener.listen(8)
        served = threading.Event()
        server = threading.Thread(target=answer_all, args=(listener, 2, served), daemon=True)
        server.start()
        with pytest.raises(HandoutError, match="the session is gone or the token is wrong"):
            fetch_ring(tmp_path, LAYOUT.session_id, TOKEN, 30)
        server.join(30)  # it marks the answer served after sending it, which the fetch may see first
    assert served.is_set()


def test_no_broker_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(HandoutError, match=r"cannot ask the broker for session 5's ring at .*rings\.sock"):
        fetch_ring(tmp_path, 5, TOKEN, 1)


@pytest.mark.parametrize(("address", "peer"), [("localhost:1000:100:4242", (4242, 1000, 100)),
                                               ("localhost:0:0:1", (1, 0, 0)), ("", None), ("1.2.3.4:80", None),
                                               ("localhost:x:0:1", None)])
def test_peer_of_address_reads_libzmqs_ipc_form(address: str, peer: tuple[int, int, int] | None) -> None:
    got = peer_of_address(address)
    assert (None if got is None else (got.pid, got.uid, got.gid)) == peer
