"""A client without a broker fails at once, naming the runtime directory and how it was chosen; photos go as one
request while their bytes fit a slot."""

from __future__ import annotations

import os
import socket
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from shmbroker.broker.common import protocol as P
from shmbroker.broker.common import runtime
from shmbroker.broker.common.ring import RingLayout
from shmbroker.client import AsyncClient, Client, HandshakeError, NoBroker
from shmbroker.client.session import ModelPlan
from tests.conftest import RunningBroker

WAIT_S = 60.0  # the handshake's timeout in these tests: failing well inside it shows that nothing waited


def _fails_fast(make: Callable[..., object], *args: object) -> NoBroker:
    t0 = time.monotonic()
    with pytest.raises(NoBroker) as e:
        make(*args, connect_timeout=WAIT_S)
    assert time.monotonic() - t0 < WAIT_S / 4
    assert e.value.code == "NO_BROKER"
    return e.value


def test_no_socket_names_the_directory_given(tmp_path: Path) -> None:
    err = _fails_fast(Client, tmp_path)
    assert f"no broker serves the runtime directory {tmp_path} (given as Client(runtime_dir=...))" in str(err)
    assert "shmbroker serve" in str(err)


def test_the_resolved_directory_says_how_it_was_chosen(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(runtime.ENV_VAR, str(tmp_path / "missing"))
    err = _fails_fast(Client)
    assert f"{tmp_path / 'missing'} (from ${runtime.ENV_VAR})" in str(err)
    _fails_fast(AsyncClient)


def test_a_socket_left_by_a_dead_broker_counts_as_none(tmp_path: Path) -> None:
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(str(tmp_path / runtime.CONTROL_SOCKET))
    stale.close()  # the file stays, nobody listens: connections are refused
    assert (tmp_path / runtime.CONTROL_SOCKET).exists()
    _fails_fast(Client, tmp_path)


def test_a_live_broker_is_found(process_broker: RunningBroker) -> None:
    assert not runtime.broker_absent(process_broker.runtime_dir)
    with Client(process_broker.runtime_dir) as c:
        c.infer("tiny", np.ones((1, 256), np.float32))


@pytest.fixture
def fallback(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Resolution falls through to the per-user directory, made here in ``tmp_path`` (standing in for /tmp)."""
    monkeypatch.delenv(runtime.ENV_VAR, raising=False)
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    monkeypatch.setattr(runtime, "SYSTEM_DIR", tmp_path / "no-run-dir")
    monkeypatch.setattr(tempfile, "gettempdir", lambda: str(tmp_path))
    d = runtime.fallback_dir()
    d.mkdir()
    return d


def test_a_fallback_directory_others_may_write_is_refused(fallback: Path) -> None:
    fallback.chmod(0o777)
    with pytest.raises(HandshakeError) as e:
        Client(connect_timeout=WAIT_S)
    assert e.value.code == "UNSAFE_RUNTIME_DIR"
    assert f"{fallback} is owned by uid {os.getuid()} with mode 777" in str(e.value)
    fallback.chmod(0o700)  # private and this user's: used, and then there is simply no broker
    _fails_fast(Client)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give the directory to another uid")
def test_a_fallback_directory_another_user_made_first_is_refused(fallback: Path) -> None:
    fallback.chmod(0o700)
    os.chown(fallback, 65534, 65534)
    with pytest.raises(HandshakeError, match=f"{fallback} is owned by uid 65534 with mode 700") as e:
        Client(connect_timeout=WAIT_S)
    assert e.value.code == "UNSAFE_RUNTIME_DIR"


def _photo_plan(max_batch: int) -> ModelPlan:
    return ModelPlan.of(P.ModelInfo(0, "photos", max_batch, [P.TensorSpec("image", "uint8", [-1], "image", 4096)],
                                    [P.TensorSpec("scores", "float32", [-1, 2])], 1000))


def test_photos_go_as_one_request_while_their_bytes_fit_a_slot() -> None:
    plan = _photo_plan(8)
    layout = RingLayout(0, 4, in_capacity=4 * (16 + 4096), out_capacity=8 * 8)
    assert plan.image_parts([b"x" * 100] * 8, layout) is None  # 8 rows, past a max_items of 4: one request
    # 4 of the largest photos fill the input region: the fifth starts a part
    assert plan.image_parts([b"x" * 4096] * 6, layout) == [(0, 4), (4, 6)]
    assert plan.image_parts([b"x" * 4000, b"x" * 200, b"x" * 4096], RingLayout(0, 4, 2 * (16 + 4096), 64)) \
        == [(0, 2), (2, 3)]


def test_photo_parts_keep_their_outputs_within_the_output_region() -> None:
    plan = _photo_plan(8)
    layout = RingLayout(0, 4, in_capacity=4 * (16 + 4096), out_capacity=3 * 8)  # the scores of 3 rows
    assert plan.image_parts([b"x" * 10] * 7, layout) == [(0, 3), (3, 6), (6, 7)]
