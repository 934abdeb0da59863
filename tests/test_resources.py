"""Resource limits (issue 5, item 7): a /dev/shm too small for the configured rings is refused at start-up.

The end-to-end tests run the broker in a private mount namespace whose /dev/shm is a 1 MiB tmpfs
(``unshare --mount``, root only); the host's /dev/shm is not touched.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from broker import protocol as P
from broker.ask import ask_broker
from broker.config import parse
from broker.shm_space import check, free_bytes, ring_bytes
from tests.conftest import REPO, TEST_MODELS, write_config


def _can_mount_tmpfs() -> bool:
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        return False
    probe = subprocess.run(["unshare", "--mount", "sh", "-c", "mount -t tmpfs -o size=1m tmpfs /dev/shm"],
                           capture_output=True, check=False)
    return probe.returncode == 0


can_unshare = pytest.mark.skipif(not _can_mount_tmpfs(), reason="needs root, unshare(1) and mount rights for a "
                                 "private /dev/shm")
SMALL_SHM = "mount -t tmpfs -o size=1m tmpfs /dev/shm && exec \"$@\""
TINY = P.ModelInfo(0, "tiny", 16, [P.TensorSpec("x", "float32", [-1, 256])], [P.TensorSpec("y", "float32", [-1, 256])],
                   2000)


def serve_in_small_shm(tmp: Path, models: str = TEST_MODELS, sessions: str = "") -> subprocess.Popen[str]:
    """``shmbroker serve`` in its own mount namespace with a 1 MiB /dev/shm (it is that process itself)."""
    cfg = write_config(tmp / "broker.toml", "process", models=models)
    cfg.write_text(cfg.read_text().replace("[sessions]\n", f"[sessions]\n{sessions}\n"))
    env = dict(os.environ, SHMBROKER_RUNTIME_DIR=str(tmp / "run"), PYTHONPATH=str(REPO))
    return subprocess.Popen(["unshare", "--mount", "sh", "-c", SMALL_SHM, "sh", sys.executable, "-m", "broker.cli",
                             "serve", "--config", str(cfg)], env=env, cwd=REPO, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


CLIENT = """
import sys, numpy as np
from client import Client, HandshakeError
try:
    Client(sys.argv[1], slots=64)
except HandshakeError as exc:
    print(exc.code, exc)
with Client(sys.argv[1], slots=2) as c:
    print("served", float(np.asarray(c.infer("tiny", np.ones((1, 256), np.float32))).sum()))
"""


@can_unshare
def test_a_ring_that_does_not_fit_fails_at_hello_not_with_sigbus(tmp_path: Path) -> None:
    """With the start-up check off (reserve_sessions = 0), a session too large for /dev/shm gets NO_SHM at HELLO
    and the broker goes on serving sessions that fit."""
    models = '[models.tiny]\npath = "builtin:tiny"\nintra_op_threads = 1\n'
    p = serve_in_small_shm(tmp_path, models, "reserve_sessions = 0")
    try:
        reply = ask_broker(tmp_path / "run", P.Health(60_000), 65)
        assert isinstance(reply, P.HealthReply) and reply.ready, reply
        r = subprocess.run(["nsenter", "--mount", f"--target={p.pid}", sys.executable, "-c", CLIENT,
                            str(tmp_path / "run")], cwd=REPO, env=dict(os.environ, PYTHONPATH=str(REPO)),
                           capture_output=True, text=True, timeout=60, check=False)
        assert r.returncode == 0, r.stderr
        first, second = r.stdout.splitlines()
        assert first.startswith("NO_SHM") and "--shm-size" in first and "shmb-" not in first, first
        assert second.startswith("served")
    finally:
        p.terminate()
        assert p.wait(30) == 0, p.communicate()[1]


@can_unshare
def test_too_small_dev_shm_is_refused_at_startup(tmp_path: Path) -> None:
    p = serve_in_small_shm(tmp_path)
    _out, err = p.communicate(timeout=120)
    assert p.returncode == 1, err
    line = next(x for x in err.splitlines() if x.startswith("shmbroker: "))
    assert "/dev/shm has" in line and "bytes free" in line and "needs" in line
    assert "--shm-size=" in line and "dev-shm.mount" in line and "sessions.default_slots" in line
    assert list((tmp_path / "run").iterdir()) == []  # sockets, lock and instance file removed


def test_check_names_bytes_and_settings(tmp_path: Path) -> None:
    cfg = parse({"sessions": {"default_slots": 16, "default_max_items": 1, "reserve_sessions": 1},
                 "models": {"tiny": {"path": "builtin:tiny"}}})
    one = ring_bytes(cfg, [TINY])
    assert one == 4096 + 16 * 4096  # one row of 1 KiB in, 1 KiB out: one page per slot
    assert check(cfg, [TINY], str(tmp_path)) is None
    big = 4096 + 4096 * 4096  # 4096 slots
    n = free_bytes(str(tmp_path)) // big + 1
    huge = parse({"sessions": {"default_slots": 4096, "max_slots": 4096, "default_max_items": 1,
                               "reserve_sessions": n},
                  "models": {"tiny": {"path": "builtin:tiny"}}})
    msg = check(huge, [TINY], str(tmp_path))
    assert msg is not None
    assert f"needs {n * big} bytes" in msg and f"ring(s) of {big} bytes" in msg
    rows = parse({"sessions": {"default_slots": 16}, "models": {"tiny": {"path": "builtin:tiny"}}})
    assert ring_bytes(rows, [TINY]) > one  # by default a slot holds the largest max_batch: more than one row
    assert "sessions.reserve_sessions" in msg and "--shm-size" in msg
