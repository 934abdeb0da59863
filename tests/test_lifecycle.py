"""Start-up, shutdown, supervision and access: what an operator and a co-located user would observe."""

from __future__ import annotations

import grp
import os
import re
import signal
import stat
import subprocess
import sys
from pathlib import Path

import numpy as np
import psutil
import pytest

from shmbroker.client import Client, WorkerDied
from shmbroker.gpu_worker import model_source
from shmbroker.gpu_worker.cuda import available as cuda_available
from tests.conftest import CLI, REPO, arr, fifo_model, launch_broker, release_fifo_model, start_broker, write_config
from tests.models import direct

X = np.ones((1, 256), np.float32)


def _ring_path(c: Client) -> str:
    """The only path to a session's ring: its client's descriptor, through /proc."""
    return f"/proc/{os.getpid()}/fd/{c.segment.fd}"


@pytest.mark.parametrize("mode", ["process", "thread"])
def test_sigterm_removes_sockets_and_children(tmp_path: Path, mode: str) -> None:
    b = start_broker(tmp_path, mode)
    children = b.worker_pids()
    if mode == "process":
        assert children, "the broker should run one worker process per device"
    c = Client(b.runtime_dir)
    try:
        c.infer("tiny", X)
        assert b.segments() == {c.segment.name}  # the broker and its worker hold the ring
        assert b.stop() == 0
        assert sorted(p.name for p in b.runtime_dir.iterdir()) == []
        for pid in children:
            assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
        with pytest.raises(WorkerDied):  # the client was told its worker is gone
            c.infer("tiny", X)
    finally:
        c.close()
        b.stop()  # a no-op once stopped; a failed assertion above must not leave the broker running


def test_socket_modes_are_private(process_broker) -> None:
    with Client(process_broker.runtime_dir):
        for sock in process_broker.runtime_dir.glob("*.sock"):
            assert stat.S_IMODE(os.stat(sock).st_mode) == 0o600, sock.name


def _open_as_nobody(path: str) -> int:
    """Exit status of a child that drops to uid/gid 65534 and tries to open ``path`` read-write."""
    code = (
        "import os, sys\n"
        "os.setgroups([]); os.setgid(65534); os.setuid(65534)\n"
        "try:\n"
        f"    os.open({path!r}, os.O_RDWR)\n"
        "except PermissionError:\n"
        "    sys.exit(13)\n"
        "sys.exit(0)\n"
    )
    return subprocess.run([sys.executable, "-c", code], check=False).returncode


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to drop to uid 65534")
def test_other_uid_cannot_open_a_session_segment(process_broker) -> None:
    with Client(process_broker.runtime_dir) as c:
        assert _open_as_nobody(_ring_path(c)) == 13


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to chown to a group")
def test_configured_group_gives_0660(tmp_path: Path) -> None:
    group = grp.getgrgid(65534).gr_name if 65534 in {g.gr_gid for g in grp.getgrall()} else "daemon"
    b = start_broker(tmp_path, "process", extra=f'group = "{group}"')
    try:
        with Client(b.runtime_dir) as c:
            gid = grp.getgrnam(group).gr_gid
            socks = list(b.runtime_dir.glob("*.sock"))  # the broker's, the rings', the worker's, the replies
            assert len(socks) >= 5
            for sock in socks:
                sst = os.stat(sock)
                want = (0o600, 0) if sock.name == "workers.sock" else (0o660, gid)  # workers: the broker's only
                assert (stat.S_IMODE(sst.st_mode), sst.st_gid) == want, sock.name
            np.testing.assert_allclose(arr(c.infer("tiny", X)), direct("tiny", X), rtol=0, atol=1e-5)
    finally:
        assert b.stop() == 0


def test_a_worker_takes_its_gil_switch_interval_from_the_config(tmp_path: Path) -> None:
    b = start_broker(tmp_path, "process", extra="[worker]\ngil_switch_us = 700\n")
    try:
        with Client(b.runtime_dir) as c:
            np.testing.assert_allclose(arr(c.infer("tiny", X)), direct("tiny", X), rtol=0, atol=1e-5)
        assert "GIL switch interval 700 us (worker.gil_switch_us)" in b.log()
    finally:
        assert b.stop() == 0


def test_health_cli(process_broker, tmp_path: Path) -> None:
    env = dict(os.environ, SHMBROKER_RUNTIME_DIR=str(process_broker.runtime_dir))
    ok = subprocess.run([*CLI, "health", "--wait", "10"], env=env, cwd=REPO,
                        capture_output=True, text=True, check=False)
    assert ok.returncode == 0, ok.stderr
    assert "nsfw: ready" in ok.stdout and "tiny: ready" in ok.stdout
    env["SHMBROKER_RUNTIME_DIR"] = str(tmp_path / "nobody-here")
    bad = subprocess.run([*CLI, "health", "--wait", "0.5"], env=env, cwd=REPO,
                         capture_output=True, text=True, check=False)
    assert bad.returncode == 2 and "no broker answered on the runtime directory" in bad.stderr, bad.stderr
    assert "within --wait 0.5 s" in bad.stderr, bad.stderr


def test_the_broker_logs_each_step_of_a_workers_start(process_broker) -> None:
    """An operator reading the journal sees what a starting worker is doing (a first start can take minutes)."""
    log = process_broker.log()
    for step in ("loading its onnxruntime engine", "building its runner", "warming up its engine at 1 and"):
        assert re.search(rf"worker 0: model tiny \(\d of \d\): {step}", log), log


def test_health_wait_says_what_a_starting_worker_is_doing_until_it_is_ready(tmp_path: Path) -> None:
    fifo, models = fifo_model(tmp_path)
    b = launch_broker(tmp_path, models=models)
    env = dict(os.environ, SHMBROKER_RUNTIME_DIR=str(b.runtime_dir))
    try:
        health = subprocess.Popen([*CLI, "health", "--wait", "120"], env=env, cwd=REPO, text=True,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        assert health.stderr is not None
        step = " s at model slow (1 of 1): loading its onnxruntime engine)"
        # a progress line every few seconds; the first may come before the worker has said its first step
        seen = []
        for line in health.stderr:
            seen.append(line)
            assert line.startswith("shmbroker: health: waiting: models not ready: slow (worker 0 starting for "), seen
            if line.rstrip().endswith(step):
                break
        assert seen and seen[-1].rstrip().endswith(step), seen
        release_fifo_model(fifo)  # the load goes on
        out, err = health.communicate(timeout=120)
        assert health.returncode == 0, err
        assert out == "slow: ready (1/1 workers)\n", out
        assert "worker 0: model slow (1 of 1): warming up its engine at 1 and 4 rows" in b.log()
    finally:
        b.stop()


def test_a_worker_start_with_no_progress_for_the_timeout_stops_serve_naming_the_step(tmp_path: Path) -> None:
    """The FIFO is never written: its load makes no progress, and the broker gives up on it after
    broker.worker_start_timeout_ms (a worker never ready stops serve)."""
    _fifo, models = fifo_model(tmp_path)
    cfg = write_config(tmp_path / "broker.toml", "process", "worker_start_timeout_ms = 1000", models=models)
    last = _serve_fails(cfg, tmp_path / "run")
    assert last.startswith("shmbroker: worker 0 (device cpu) failed at start-up: not ready after "), last
    assert last.endswith(" s of them with no progress at 'model slow (1 of 1): loading its onnxruntime "
                         "engine' (raise broker.worker_start_timeout_ms)"), last


def test_dead_worker_is_restarted_and_clients_are_told(process_broker) -> None:
    b = process_broker
    with Client(b.runtime_dir) as c:
        np.testing.assert_allclose(arr(c.infer("tiny", X)), direct("tiny", X), rtol=0, atol=1e-5)
        (worker,) = b.worker_pids()
        slow = [c.submit("nsfw", np.zeros((1, 224, 224, 3), np.float32)) for _ in range(3)]
        os.kill(worker, signal.SIGKILL)
        for f in slow:  # in flight when the worker died: each either finished or failed WORKER_DIED
            exc = f.exception(30)
            assert exc is None or isinstance(exc, WorkerDied), exc
        c.wait_ready("tiny", timeout=60)
        np.testing.assert_allclose(arr(c.infer("tiny", X)), direct("tiny", X), rtol=0, atol=1e-5)
        assert b.worker_pids() != [worker]
        assert b.stats().workers[0].restarts == 1


def test_a_worker_crash_in_native_code_is_named_with_its_python_stack(process_broker) -> None:
    """A worker killed by SIGSEGV (as a crash in an engine's library would): its fault handler prints the Python
    stack of every thread to the broker's log, the broker names the signal, and a restart serves again."""
    b = process_broker
    with Client(b.runtime_dir) as c:
        c.infer("tiny", X)
        (worker,) = b.worker_pids()
        slow = [c.submit("nsfw", np.zeros((1, 224, 224, 3), np.float32)) for _ in range(3)]
        os.kill(worker, signal.SIGSEGV)
        assert any(isinstance(f.exception(30), WorkerDied) for f in slow)  # the client saw it go
        c.wait_ready("tiny", timeout=60)
        np.testing.assert_allclose(arr(c.infer("tiny", X)), direct("tiny", X), rtol=0, atol=1e-5)
    log = b.log_path.read_text(errors="replace")
    assert "Fatal Python error: Segmentation fault" in log, log[-3000:]
    assert "worker 0 down (the worker exited on signal SIGSEGV (11): a crash in native code" in log, log[-3000:]
    assert b.stats().workers[0].restarts == 1


def test_bad_config_is_refused_with_the_key(tmp_path: Path) -> None:
    cfg = tmp_path / "bad.toml"
    cfg.write_text('[models.tiny]\npath = "builtin:tiny"\nmax_batch = "many"\n')
    r = subprocess.run([*CLI, "serve", "--config", str(cfg)], cwd=REPO,
                       capture_output=True, text=True, check=False, timeout=60)
    assert r.returncode == 2
    assert "models.tiny.max_batch" in r.stderr and "int" in r.stderr


def _serve_fails(cfg: Path, runtime_dir: Path) -> str:
    """Run ``serve`` on ``cfg``, which must stop at start-up with exit 1; the last line of its stderr."""
    env = dict(os.environ, SHMBROKER_RUNTIME_DIR=str(runtime_dir))
    r = subprocess.run([*CLI, "serve", "--config", str(cfg)], env=env, cwd=REPO,
                       capture_output=True, text=True, check=False, timeout=120)
    assert r.returncode == 1, r.stderr[-2000:]
    return r.stderr.strip().splitlines()[-1]


def test_a_model_that_fails_at_start_up_stops_serve_with_the_reason(tmp_path: Path) -> None:
    """Not a restart loop: serve exits 1 naming the worker and the file, and leaves nothing behind."""
    models = '[models.broken]\npath = "no-such-model.onnx"\n'
    runtime_dir = tmp_path / "run"
    cfg = write_config(tmp_path / "broker.toml", "process", models=models)
    env = dict(os.environ, SHMBROKER_RUNTIME_DIR=str(runtime_dir))
    r = subprocess.run([*CLI, "serve", "--config", str(cfg)], env=env, cwd=REPO,
                       capture_output=True, text=True, check=False, timeout=120)
    assert r.returncode == 1, r.stderr[-2000:]
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("shmbroker: worker 0 (device cpu) failed at start-up: model load failed"), last
    assert "no-such-model.onnx" in last
    assert r.stderr.count("worker 0 (cpu) started") == 1  # started once, never restarted
    assert not runtime_dir.exists() or list(runtime_dir.iterdir()) == []


def test_a_worker_that_fails_after_start_up_is_restarted_with_backoff(tmp_path: Path) -> None:
    """Its model file gone after start: the restarts fail and back off, health names why, the broker stays up;
    once the file is back a restart serves again."""
    model = tmp_path / "tiny.onnx"
    source = model_source.resolve("builtin:tiny")
    model.write_bytes(source if isinstance(source, bytes) else Path(source).read_bytes())
    b = start_broker(tmp_path, "process", models=f'[models.tiny]\npath = "{model}"\n')
    try:
        with Client(b.runtime_dir) as c:
            c.infer("tiny", X)
        moved = model.rename(tmp_path / "away.onnx")
        for pid in b.worker_pids():
            os.kill(pid, signal.SIGKILL)
        reply = b.health(wait_s=0.0)
        for _ in range(100):  # each ask waits up to 0.5 s for the broker; the failed load comes within seconds
            if "model load failed" in reply.reason:
                break
            reply = b.health(wait_s=0.5)
        assert not reply.ready and "model load failed" in reply.reason and "tiny.onnx" in reply.reason, reply
        assert b.proc.poll() is None  # the broker stays up
        moved.rename(model)
        assert b.health(wait_s=60).ready
        with Client(b.runtime_dir) as c:
            np.testing.assert_allclose(arr(c.infer("tiny", X)), direct("tiny", X), rtol=0, atol=1e-5)
    finally:
        assert b.stop() == 0, b.log()


@pytest.mark.skipif(cuda_available(), reason="the premise: no CUDA device on this machine")
def test_a_gpu_that_is_not_there_stops_serve(tmp_path: Path) -> None:
    cfg = write_config(tmp_path / "broker.toml", "process", extra="", models='[worker]\ndevices = [0]\n'
                       '[models.tiny]\npath = "builtin:tiny"\n')
    last = _serve_fails(cfg, tmp_path / "run")
    assert last.startswith("shmbroker: worker 0 (device 0) failed at start-up: model load failed"), last
