"""Resource caps (bench/RESULTS.md#reliability, item 7): sessions and ring bytes, per uid and in all.

A HELLO past a cap gets LIMIT naming the [sessions] key; the cap counts live sessions, so one frees its share
when it closes; what one session costs in descriptors stays within what systemd/shmbroker.service allows.
"""

from __future__ import annotations

import configparser
import contextlib
import os
import resource
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import pytest
import zmq

from shmbroker.broker.common import protocol as P
from shmbroker.broker.common.config import ConfigError, parse
from shmbroker.broker.common.runtime import CONTROL_SOCKET, endpoint
from shmbroker.broker.serving.sessions import FD_RESERVE, FDS_PER_SESSION, Caps
from shmbroker.client import Client, HandshakeError
from tests.conftest import REPO, RunningBroker, start_broker, wait_until


@contextlib.contextmanager
def control_dealer(b: RunningBroker) -> Iterator[zmq.Socket[bytes]]:
    """A raw DEALER on the broker's control socket, as a client that never finishes its handshakes."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        s = ctx.socket(zmq.DEALER)
        s.connect(endpoint(b.runtime_dir, CONTROL_SOCKET))
        yield s
    finally:
        ctx.destroy(linger=0)


def hellos(s: zmq.Socket[bytes], n: int, slots: int) -> list[Any]:
    """``n`` HELLOs for ``slots`` slots, one at a time; the broker's answers (SETUP or ERROR)."""
    replies = []
    for _ in range(n):
        s.send_multipart(P.encode(P.Hello(P.PROTOCOL_VERSION, os.getpid(), slots, 0, "flood")))
        assert s.poll(10_000), "the broker stopped answering"
        replies.append(P.decode(s.recv_multipart()))
    return replies


def _served(c: Client) -> None:
    assert float(np.asarray(c.infer("tiny", np.ones((1, 256), np.float32))).sum()) > 0


def test_sessions_per_uid_cap_names_the_key_and_frees_on_close(tmp_path: Path) -> None:
    b = start_broker(tmp_path, "process", sessions="default_slots = 2\nmax_sessions_per_uid = 2\nmax_sessions = 4")
    try:
        first, second = Client(b.runtime_dir), Client(b.runtime_dir)
        with pytest.raises(HandshakeError) as refused:
            Client(b.runtime_dir)
        assert refused.value.code == "LIMIT" and "sessions.max_sessions_per_uid" in str(refused.value)
        _served(second)  # the refusal harmed nobody
        first.close()
        wait_until(lambda: len(b.segments()) == 1, "the broker releases the closed session")
        with Client(b.runtime_dir) as third:  # the closed session's share is free again
            _served(third)
        second.close()
    finally:
        assert b.stop() == 0, b.log()


def test_ring_bytes_cap_per_uid_names_the_key(tmp_path: Path) -> None:
    b = start_broker(tmp_path, "process", sessions="default_slots = 2\nmax_ring_mib_per_uid = 16")
    try:
        with pytest.raises(HandshakeError) as refused:
            Client(b.runtime_dir, slots=64)  # 64 slots of about 2 MiB each: over 16 MiB
        assert refused.value.code == "LIMIT" and "sessions.max_ring_mib_per_uid" in str(refused.value)
        with Client(b.runtime_dir, slots=2) as c:
            _served(c)
    finally:
        assert b.stop() == 0, b.log()


def test_a_hello_flood_stops_at_the_cap_and_the_broker_keeps_serving(tmp_path: Path) -> None:
    """HELLOs that never finish the handshake hold rings until it times out: the cap bounds them."""
    b = start_broker(tmp_path, "process", sessions="default_slots = 2\nmax_sessions_per_uid = 8\nmax_sessions = 16")
    try:
        with control_dealer(b) as s:
            codes = [r.code if isinstance(r, P.ErrorReply) else type(r).__name__ for r in hellos(s, 40, 2)]
            assert codes.count("Setup") == 8 and codes.count("LIMIT") == 32, codes
            assert b.health().ready
            assert len(b.segments()) == 8  # the broker holds no ring beyond the cap
    finally:
        assert b.stop() == 0, b.log()


def test_a_large_ring_costs_the_broker_no_memory_at_hello(tmp_path: Path) -> None:
    """Creating a ring touches none of its pages on the broker's loop: a 2 GiB HELLO leaves the broker's
    memory as it was, and it keeps answering."""
    b = start_broker(tmp_path, "process", sessions="max_slots = 4096\nmax_ring_mib = 16384\n"
                                                    "max_ring_mib_per_uid = 16384\ndefault_max_items = 16")
    try:
        rss = psutil.Process(b.proc.pid).memory_info().rss
        with control_dealer(b) as s:
            (setup,) = hellos(s, 1, 1000)
            assert isinstance(setup, P.Setup) and setup.segment_bytes > 2 << 30, setup
            assert b.health().ready
            assert psutil.Process(b.proc.pid).memory_info().rss - rss < 64 << 20
    finally:
        assert b.stop() == 0, b.log()


def test_the_open_files_limit_caps_sessions_and_the_broker_keeps_serving(tmp_path: Path) -> None:
    """Caps above what RLIMIT_NOFILE allows (a unit without LimitNOFILE, say): sessions stop at what the limit
    leaves room for, and one uid at half of that (tests/test_isolation.py has the other uids), refused with
    LIMIT naming LimitNOFILE, and the broker keeps accepting and serving."""
    b = start_broker(tmp_path, "process", max_fds=FD_RESERVE + 12 * FDS_PER_SESSION,
                     sessions="default_slots = 1\nmax_sessions_per_uid = 1000\nmax_sessions = 1000")
    try:
        with control_dealer(b) as s:
            replies = hellos(s, 100, 1)
            granted = [r for r in replies if isinstance(r, P.Setup)]
            refused = [r for r in replies if isinstance(r, P.ErrorReply)]
            assert len(granted) == 6 and len(refused) == 94, replies[:1]
            assert {r.code for r in refused} == {"LIMIT"} and "LimitNOFILE" in refused[0].message, refused[0]
            assert b.health().ready  # a new connection is still accepted
            for setup in granted:
                s.send_multipart(P.encode(P.Bye(setup.session_id)))
            wait_until(lambda: not b.segments(), "the flood's sessions are closed")
        with Client(b.runtime_dir) as c:
            _served(c)
        assert "the open-files limit allows 12 sessions" in b.log()
    finally:
        assert b.stop() == 0, b.log()


def _fds(pids: list[int]) -> int:
    return sum(psutil.Process(p).num_fds() for p in pids)


def test_what_one_session_costs_in_descriptors_fits_the_units_limit(process_broker: RunningBroker) -> None:
    """Each process (the broker, each worker) spends at most FDS_PER_SESSION descriptors on a session, and the
    unit's LimitNOFILE covers the default max_sessions of them."""
    b = process_broker
    pids = [b.proc.pid, *b.worker_pids()]
    with Client(b.runtime_dir) as warm:  # lazily made sockets and threads exist after the first session
        _served(warm)
        before = _fds(pids)
        clients = [Client(b.runtime_dir, slots=2) for _ in range(10)]
        for c in clients:
            _served(c)
        per_session = (_fds(pids) - before) / 10 / len(pids)
        for c in clients:
            c.close()
    assert 0 < per_session <= FDS_PER_SESSION, per_session
    unit = configparser.ConfigParser(strict=False, interpolation=None)
    unit.read(REPO / "systemd" / "shmbroker.service")
    limit = int(unit["Service"]["LimitNOFILE"])
    default_sessions = parse({"models": {"m": {"path": "builtin:tiny"}}}).sessions.max_sessions
    assert limit >= FDS_PER_SESSION * default_sessions + 1024


def test_a_per_uid_cap_above_the_total_is_refused_naming_the_key() -> None:
    with pytest.raises(ConfigError, match=r"sessions\.max_sessions_per_uid"):
        parse({"sessions": {"max_sessions": 4, "max_sessions_per_uid": 8}, "models": {"m": {"path": "builtin:tiny"}}})


@contextlib.contextmanager
def _open_files_limit(soft: int) -> Iterator[None]:
    """This process's RLIMIT_NOFILE soft limit set to ``soft`` (RLIM_INFINITY: none) for the span of a ``with``."""
    before = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(soft, before[1]), before[1]))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, before)


@pytest.mark.parametrize(("sessions", "fds", "caps", "why"), [
    # the open-files limit bounds the sessions: the per-uid cap scales down with them (issue: it was 120 of 120)
    ("", 1024, (120, 30), "scaled to the 120 sessions the open-files limit allows: raise LimitNOFILE"),
    ("max_sessions = 1000\nmax_sessions_per_uid = 1000", FD_RESERVE + 12 * FDS_PER_SESSION, (12, 6),
     "1/2 of the 12 sessions in all, so that other uids find room: raise LimitNOFILE"),
    ("max_sessions = 8\nmax_sessions_per_uid = 8", 65536, (8, 4),
     "1/2 of the 8 sessions in all, so that other uids find room: raise sessions.max_sessions"),
    ("max_sessions = 8\nmax_sessions_per_uid = 2", 65536, (8, 2), "sessions.max_sessions_per_uid"),
    ("", 65536, (1024, 256), "sessions.max_sessions_per_uid"),
    ("max_sessions = 1\nmax_sessions_per_uid = 1", 65536, (1, 1), "sessions.max_sessions_per_uid"),  # unshared
    ("max_sessions = 4\nmax_sessions_per_uid = 1", FD_RESERVE, (1, 1), "scaled to the 1 sessions"),
], ids=["default_at_1024_fds", "equal_caps_fd_bound", "equal_caps", "below_half", "defaults", "one", "fd_floor"])
def test_the_per_uid_session_cap_leaves_room_for_other_uids(sessions: str, fds: int, caps: tuple[int, int],
                                                            why: str) -> None:
    """The caps in effect (the rule of docs/DEPLOY.md): what bounds the sessions scales the per-uid cap alike, and
    one uid never holds more than half of them (at least 1); the reason names the setting to raise."""
    cfg = parse({"sessions": tomllib.loads(sessions), "models": {"m": {"path": "builtin:tiny"}}})
    with _open_files_limit(fds):
        got = Caps.of(cfg)
    assert (got.sessions, got.sessions_per_uid) == caps
    assert why in got.sessions_per_uid_why, got


def test_the_per_uid_ring_cap_is_at_most_half_of_the_total() -> None:
    cfg = parse({"sessions": {"max_ring_mib": 1024, "max_ring_mib_per_uid": 1024},
                 "models": {"m": {"path": "builtin:tiny"}}})
    got = Caps.of(cfg)
    assert (got.ring_bytes >> 20, got.ring_bytes_per_uid >> 20) == (1024, 512)
    assert "1/2 of sessions.max_ring_mib" in got.ring_bytes_per_uid_why
