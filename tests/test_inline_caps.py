"""The inline gateway's memory cap (`shmbroker inline --max-pending-mib`), with real processes: past the bytes it
may hold, a request is answered OVERLOADED at once and each request accepted is answered once; a frame larger
than the cap is never received, so it costs the gateway no memory; a bad value is refused naming the option."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import numpy as np
import pytest
import zmq
import zmq.utils.monitor

from shmbroker.broker.common.protocol import MsgKind
from tests.conftest import CLI, REPO
from tests.frontends import (
    broker_with_gateway,
    flood_a_stalled_worker,
    inline_dealer,
    inline_envelope,
    next_is_only,
    tiny_request,
)

MIB = 1 << 20
REQ = inline_envelope(MsgKind.INLINE_REQUEST)


def _peak_rss(pid: int) -> int:
    """The process's peak resident memory (VmHWM), in bytes."""
    status = Path(f"/proc/{pid}/status").read_text()
    m = re.search(r"^VmHWM:\s+(\d+) kB", status, re.MULTILINE)
    assert m is not None, status
    return int(m.group(1)) * 1024


def _gateway_pid(tmp: Path) -> int:
    """The pid of the gateway that holds the runtime directory's lock (it writes its pid there)."""
    return int((tmp / "run" / "inline.lock").read_text().strip())


def test_past_max_pending_mib_requests_are_overloaded_and_each_gets_one_reply(tmp_path: Path) -> None:
    """--max-pending-mib 1, the worker stopped, 100 requests of 16 rows (16 KiB) on one DEALER: as many as fit in
    1 MiB are held, the rest answered OVERLOADED at once naming the option; once the worker goes on, the held
    ones are answered OK, each once."""
    x = np.random.default_rng(6).standard_normal((16, 256), dtype=np.float32)
    with broker_with_gateway(tmp_path, "--max-pending-mib", "1") as (b, endpoints), inline_dealer(endpoints[0]) as sock:
        size = sum(len(frame) for frame in tiny_request(1, timeout_us=120_000_000, x=x))
        fit = MIB // size
        assert 16 < fit < 100  # past the gateway's 16 slots, so some wait for one, and far below --max-pending
        flood_a_stalled_worker(b, sock, 100, fit, x, "--max-pending-mib 1")


def test_a_frame_larger_than_max_pending_mib_is_never_received(tmp_path: Path) -> None:
    """--max-pending-mib 4: a caller that sends a 64 MiB frame is disconnected, and the gateway's peak memory grows
    by less than the frame; another caller is served meanwhile, and the first one once its DEALER reconnected."""
    with broker_with_gateway(tmp_path, "--max-pending-mib", "4") as (_b, endpoints), \
            inline_dealer(endpoints[0]) as good, inline_dealer(endpoints[0]) as hostile:
        assert next_is_only(good, 1)["status"] == "OK"
        pid = _gateway_pid(tmp_path)
        base = _peak_rss(pid)
        monitor = hostile.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        hostile.send_multipart([REQ, b'{"id": 2, "model": "tiny", "inputs": []}', bytes(64 * MIB)])
        assert monitor.poll(60_000), "the gateway did not drop the caller of a frame past --max-pending-mib"
        event = zmq.utils.monitor.recv_monitor_message(monitor)
        assert event["event"] == zmq.EVENT_DISCONNECTED, event
        assert next_is_only(good, 3)["status"] == "OK"
        grown = _peak_rss(pid) - base
        assert grown < 32 * MIB, f"the gateway's peak memory grew by {grown / MIB:.0f} MiB"
        hostile.disable_monitor()
        assert next_is_only(hostile, 4)["status"] == "OK"  # its DEALER reconnected: the caller is served again


@pytest.mark.parametrize("value", ["0", "-3", str((1 << 20) + 1)])
def test_a_bad_max_pending_mib_is_refused_naming_it(tmp_path: Path, value: str) -> None:
    env = dict(os.environ, SHMBROKER_RUNTIME_DIR=str(tmp_path / "run"))
    r = subprocess.run([*CLI, "inline", "--max-pending-mib", value], env=env, cwd=REPO,
                       capture_output=True, text=True, timeout=60, check=False)
    assert r.returncode == 2, r.stderr
    assert f"--max-pending-mib: expected 1 to {1 << 20}, got {value}" in r.stderr and "Traceback" not in r.stderr
