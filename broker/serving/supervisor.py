"""Starting, watching and restarting the workers: one per configured device, as processes or threads."""

from __future__ import annotations

import contextlib
import enum
import logging
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import msgspec

from shmbroker.broker.common import protocol as P
from shmbroker.broker.common.config import Config

log = logging.getLogger(__name__)

STOP_GRACE_S = 10.0
STEP_CHARS = 300  # a worker's step as the broker keeps, logs and reports it


class StartupFailed(RuntimeError):
    """A worker failed before it was ever ready: serve stops (a bad model path, no such GPU) instead of
    restarting it forever; the message names the worker, its device and the reason."""


class WorkerPhase(enum.Enum):
    STARTING = 1
    READY = 2
    DOWN = 3  # dead, waiting for its restart
    FAILED = 4  # dead after its models did not load; restarted with a growing backoff


class Launch(Protocol):
    """A running worker, process or thread; the supervisor sees only this."""

    def __init__(self, cfg: Config, worker_id: int, runtime_dir: Path, restarts: int) -> None: ...

    def alive(self) -> bool: ...

    def stop(self, kill: bool = False) -> None: ...

    def wait(self, timeout: float) -> bool: ...

    @property
    def pid(self) -> int: ...


# signals of a crash in native code: the worker's fault handler has printed its Python stack to the log
_CRASHES = frozenset({signal.SIGSEGV, signal.SIGABRT, signal.SIGBUS, signal.SIGILL, signal.SIGFPE})


def _exit_code(launch: Launch) -> str:
    """How the worker ended, for a message: " with code N", or " on signal SIGSEGV (11)" for a signal."""
    code = getattr(launch, "returncode", None)
    if code is None:
        return ""
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = "signal"
        crash = ": a crash in native code, its stack is in the log above" if -code in _CRASHES else ""
        return f" on signal {name} ({-code}){crash}"
    return f" with code {code}"


class ProcessLaunch:
    def __init__(self, cfg: Config, worker_id: int, runtime_dir: Path, restarts: int) -> None:
        cmd = [sys.executable, "-m", "shmbroker.gpu_worker.process", "--worker-id", str(worker_id),
               "--runtime-dir", str(runtime_dir), "--restarts", str(restarts)]
        self._p = subprocess.Popen(cmd, stdin=subprocess.PIPE)
        # the validated config travels as JSON on stdin: the worker sees exactly what the broker checked
        self._feed(cfg)

    def _feed(self, cfg: Config) -> None:
        stdin = self._p.stdin
        if stdin is None:
            raise RuntimeError("worker process has no stdin pipe")
        stdin.write(msgspec.json.encode(cfg))
        stdin.close()

    def alive(self) -> bool:
        return self._p.poll() is None

    def stop(self, kill: bool = False) -> None:
        with contextlib.suppress(ProcessLookupError):
            (self._p.kill if kill else self._p.terminate)()

    def wait(self, timeout: float) -> bool:
        try:
            self._p.wait(timeout)
            return True
        except subprocess.TimeoutExpired:
            return False

    @property
    def pid(self) -> int:
        return self._p.pid

    @property
    def returncode(self) -> int | None:
        return self._p.returncode


class ThreadLaunch:
    """In-process mode: the same Worker logic in a thread of the broker (tests, single-process embedding)."""

    def __init__(self, cfg: Config, worker_id: int, runtime_dir: Path, restarts: int) -> None:
        from shmbroker.gpu_worker.worker import Worker

        self._stop = threading.Event()
        worker = Worker(cfg, worker_id, runtime_dir, restarts)
        self._t = threading.Thread(target=worker.run, args=(self._stop,), name=f"worker-{worker_id}", daemon=True)
        self._t.start()

    def alive(self) -> bool:
        return self._t.is_alive()

    def stop(self, kill: bool = False) -> None:
        self._stop.set()

    def wait(self, timeout: float) -> bool:
        self._t.join(timeout)
        return not self._t.is_alive()

    @property
    def pid(self) -> int:
        import os

        return os.getpid()


@dataclass
class WorkerSlot:
    """What the broker knows of one worker (one device)."""

    worker_id: int
    device: str
    phase: WorkerPhase = WorkerPhase.STARTING
    launch: Launch | None = None
    identity: bytes = b""  # routing id on the workers socket
    endpoint: str = ""
    models: list[P.ModelInfo] = field(default_factory=list)
    restarts: int = 0
    restart_at: float = 0.0
    started_at: float = 0.0
    step: str = ""  # a starting worker's latest step (WORKER_PROGRESS), and when it began
    step_at: float = 0.0
    reason: str = ""
    ever_ready: bool = False  # a worker that fails before its first READY stops the broker (StartupFailed)


class Supervisor:
    """Keeps one worker per device running: a dead one is restarted after ``restart_backoff_ms``, once it has
    been ready; one that dies before its first READY raises StartupFailed."""

    def __init__(self, cfg: Config, runtime_dir: Path) -> None:
        self.cfg = cfg
        self.runtime_dir = runtime_dir
        self.workers = [WorkerSlot(i, str(d)) for i, d in enumerate(cfg.worker.devices)]
        self._launch_cls: type[Launch] = ThreadLaunch if cfg.broker.worker_mode == "thread" else ProcessLaunch

    def start_all(self) -> None:
        for w in self.workers:
            self._start(w)

    def _start(self, w: WorkerSlot) -> None:
        w.phase = WorkerPhase.STARTING
        w.identity = b""
        w.started_at = w.step_at = time.monotonic()
        w.step = ""
        w.launch = self._launch_cls(self.cfg, w.worker_id, self.runtime_dir, w.restarts)
        log.info("worker %d (%s) started, pid %d", w.worker_id, w.device, w.launch.pid)

    def check(self, now: float) -> list[WorkerSlot]:
        """Restart workers whose backoff is over; return those found dead since the last call.

        Raises StartupFailed for a worker that died before it was ever ready."""
        died = []
        start_timeout = self.cfg.broker.worker_start_timeout_ms / 1e3
        for w in self.workers:
            if w.phase in (WorkerPhase.DOWN, WorkerPhase.FAILED):
                if now >= w.restart_at:
                    w.restarts += 1
                    self._start(w)
                continue
            if w.launch is not None and not w.launch.alive():
                reason = w.reason or f"the worker exited{_exit_code(w.launch)}"
                if not w.ever_ready:
                    raise StartupFailed(f"worker {w.worker_id} (device {w.device}) failed at start-up: {reason}")
                died.append(w)
                self._mark_down(w, now, reason)
            elif w.phase is WorkerPhase.STARTING and now - w.step_at > start_timeout and w.launch is not None:
                at = f" at {w.step!r}" if w.step else ""
                w.reason = (f"not ready after {now - w.started_at:.0f} s, {start_timeout:.0f} s of them with no "
                            f"progress{at} (raise broker.worker_start_timeout_ms)")
                log.error("worker %d %s; killing it", w.worker_id, w.reason)
                w.launch.stop(kill=True)
        return died

    def progress(self, w: WorkerSlot, step: str, now: float) -> None:
        """A starting ``w`` began ``step``: its start deadline counts from ``now``."""
        if w.phase is WorkerPhase.STARTING:
            w.step, w.step_at = step[:STEP_CHARS], now

    def _mark_down(self, w: WorkerSlot, now: float, reason: str) -> None:
        failed = w.reason.startswith("model load")
        backoff = self.cfg.broker.restart_backoff_ms / 1e3
        if failed:  # a model that does not load will not load at once either: back off harder
            backoff = min(30.0, backoff * 2 ** min(w.restarts, 8))
        w.phase = WorkerPhase.FAILED if failed else WorkerPhase.DOWN
        w.reason = reason
        w.identity = b""
        w.restart_at = now + backoff
        log.warning("worker %d down (%s); restart in %.1f s", w.worker_id, reason, backoff)

    def ready(self, w: WorkerSlot) -> None:
        """``w`` said READY: from now on its deaths are restarted."""
        w.phase = WorkerPhase.READY
        w.reason = ""
        w.ever_ready = True

    def ready_workers(self) -> list[WorkerSlot]:
        return [w for w in self.workers if w.phase is WorkerPhase.READY]

    def by_identity(self, identity: bytes) -> WorkerSlot | None:
        return next((w for w in self.workers if w.identity == identity and identity), None)

    def stop_all(self) -> None:
        """SIGTERM every worker, wait, then SIGKILL what is left; no child outlives the broker."""
        launches = [w.launch for w in self.workers if w.launch is not None]
        for launch in launches:
            launch.stop()
        end = time.monotonic() + STOP_GRACE_S
        for launch in launches:
            if not launch.wait(max(0.0, end - time.monotonic())):
                log.warning("worker pid %d did not stop in %.0f s; killing it", launch.pid, STOP_GRACE_S)
                launch.stop(kill=True)
                launch.wait(5.0)
