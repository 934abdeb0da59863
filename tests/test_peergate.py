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
    assert mon.poll(60_000), "no handshake event"
    event = int(zmq.utils.monitor.recv_monitor_message(mon)["event"])
    push.setsockopt(zmq.SNDTIMEO, 2000)  # the PUSH side attaches its pipe a little after the PULL's event
    with contextlib.suppress(zmq.Again):  # no admitted peer to send to
        push.send(b"answer")
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


def test_any_uid_domain_admits_this_uid(ctx: zmq.Context[zmq.Socket[bytes]], tmp_path: Path) -> None:
    gate = PeerGate(ctx)
    push = ctx.socket(zmq.PUSH)
    try:
        gate.allow("data", None)
        push.setsockopt(zmq.LINGER, 0)
        push.setsockopt(zmq.ZAP_DOMAIN, b"data")
        push.bind(f"ipc://{tmp_path / 'a.sock'}")
        assert _pull_outcome(ctx, push, f"ipc://{tmp_path / 'a.sock'}") == (zmq.EVENT_HANDSHAKE_SUCCEEDED, b"answer")
    finally:
        push.close(0)
        gate.close()


def test_connections_past_a_uids_burst_wait_for_their_turn(ctx: zmq.Context[zmq.Socket[bytes]],
                                                            tmp_path: Path) -> None:
    """burst 2 and one connection a day: the first two are admitted at once, the third waits (unanswered, in
    its handshake) and is never refused; a faster pace admits all."""
    address = f"ipc://{tmp_path / 'p.sock'}"
    for per_s, admitted in ((1 / 86400, 2), (1000.0, 3)):
        gate = PeerGate(ctx, burst=2, per_s=per_s)
        pull = ctx.socket(zmq.PULL)
        pushes, mons = [], []
        try:
            gate.allow("paced", None)
            pull.setsockopt(zmq.LINGER, 0)
            pull.setsockopt(zmq.ZAP_DOMAIN, b"paced")
            pull.bind(address)
            for _ in range(3):
                push = ctx.socket(zmq.PUSH)
                push.setsockopt(zmq.LINGER, 0)
                mons.append(push.get_monitor_socket(HANDSHAKE_EVENTS))
                push.connect(address)
                pushes.append(push)
            poller = zmq.Poller()
            for mon in mons:
                poller.register(mon, zmq.POLLIN)
            events: list[int] = []
            while len(events) < admitted:  # in whichever order the connections reached the gate
                ready = poller.poll(60_000)  # a generous bound for a loaded machine: the events are expected
                assert ready, f"no handshake event after {events}"
                events += [int(zmq.utils.monitor.recv_monitor_message(m)["event"]) for m, _ in ready]
            assert events == [zmq.EVENT_HANDSHAKE_SUCCEEDED] * admitted
            if admitted < 3:
                assert not poller.poll(1000), "the third connection was answered past its uid's pace"
        finally:
            for push in pushes:
                push.disable_monitor()
                push.close(0)
            for mon in mons:
                mon.close(0)
            pull.close(0)
            gate.close()
