"""broker.common.peergate: a ZeroMQ ipc socket admits only the uids allowed for its ZAP domain (real sockets)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq
import zmq.utils.monitor

from shmbroker.broker.common.peergate import PeerGate

HANDSHAKE_EVENTS = (zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_HANDSHAKE_FAILED_AUTH
                    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL)


@pytest.fixture
def ctx() -> Iterator[zmq.Context[zmq.Socket[bytes]]]:
    c: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    yield c
    c.destroy(linger=0)


Ctx = zmq.Context[zmq.Socket[bytes]]


def _pull_outcome(ctx: Ctx, push: zmq.Socket[bytes], address: str) -> tuple[int, bytes | None]:
    """Connect a PULL to ``push``, report its first handshake event and the message ``push`` then sends, if the
    PULL got it within 2 s."""
    pull = ctx.socket(zmq.PULL)
    pull.setsockopt(zmq.LINGER, 0)
    mon = pull.get_monitor_socket(HANDSHAKE_EVENTS)
    pull.connect(address)
    assert mon.poll(10_000), "no handshake event"
    event = int(zmq.utils.monitor.recv_monitor_message(mon)["event"])
    with contextlib.suppress(zmq.Again):  # no admitted peer to send to
        push.send(b"answer", zmq.NOBLOCK)
    got = pull.recv() if pull.poll(2000) else None
    pull.disable_monitor()
    mon.close(0)
    pull.close(0)
    return event, got


@pytest.mark.parametrize(("allowed", "admitted"), [({os.getuid()}, True), ({os.getuid() + 1}, False), (set(), False)])
def test_only_the_allowed_uid_connects_and_receives(ctx: zmq.Context[zmq.Socket[bytes]], tmp_path: Path,
                                                    allowed: set[int], admitted: bool) -> None:
    gate = PeerGate(ctx)
    push = ctx.socket(zmq.PUSH)
    try:
        gate.allow("reply-test", frozenset(allowed))
        push.setsockopt(zmq.LINGER, 0)
        push.setsockopt(zmq.ZAP_DOMAIN, b"reply-test")
        address = f"ipc://{tmp_path / 'r.sock'}"
        push.bind(address)
        event, got = _pull_outcome(ctx, push, address)
        if admitted:
            assert (event, got) == (zmq.EVENT_HANDSHAKE_SUCCEEDED, b"answer")
        else:
            assert event == zmq.EVENT_HANDSHAKE_FAILED_AUTH and got is None
    finally:
        push.close(0)
        gate.close()


def test_a_forgotten_domain_admits_nobody(ctx: zmq.Context[zmq.Socket[bytes]], tmp_path: Path) -> None:
    gate = PeerGate(ctx)
    push = ctx.socket(zmq.PUSH)
    try:
        gate.allow("d", frozenset({os.getuid()}))
        gate.forget("d")
        push.setsockopt(zmq.LINGER, 0)
        push.setsockopt(zmq.ZAP_DOMAIN, b"d")
        push.bind(f"ipc://{tmp_path / 'd.sock'}")
        assert _pull_outcome(ctx, push, f"ipc://{tmp_path / 'd.sock'}")[0] == zmq.EVENT_HANDSHAKE_FAILED_AUTH
    finally:
        push.close(0)
        gate.close()
