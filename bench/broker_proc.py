"""The benchmark's own broker: ``python -m shmbroker.broker.cli serve`` on a fresh runtime dir, stopped with SIGTERM.

Readiness is the broker's own HEALTH message with ``wait_ms`` (the broker answers once every model is
ready), asked again each second only so that a broker that died is noticed at once. After the stop, no
``/dev/shm/shmb-<instance>-*`` segment may remain.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import IO, Any

import psutil

from shmbroker.bench import procs
from shmbroker.bench.common import BenchError, Figures, Progress
from shmbroker.broker.common import protocol as P
from shmbroker.broker.common import ring, runtime
from shmbroker.broker.common.ask import ask_broker

SHM_DIR = Path("/dev/shm")
READY_TIMEOUT_S = 300.0
STOP_TIMEOUT_S = 30.0
RELEASE_WAIT_S = 5.0
PR_SET_PDEATHSIG = 1
_LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None


def _die_with_bench() -> None:
    """preexec_fn of the broker: SIGTERM it (a clean stop) should the bench process die without stopping it."""
    if _LIBC is not None:
        _LIBC.prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)


class BrokerProcess:
    """A broker subprocess; use as a context manager so that it is stopped even when a phase fails."""

    def __init__(self, config_path: Path, workdir: Path, progress: Progress) -> None:
        self.config_path = config_path
        self.runtime_dir = workdir / "run"
        self.log_path = workdir / "broker.log"
        self.progress = progress
        self.proc: subprocess.Popen[bytes] | None = None
        self.instance = ""
        self.startup_s: float | None = None  # None: never became ready
        self.exit_code: int | None = None
        self.killed = False
        self.leaked: list[str] = []
        self._log: IO[bytes] | None = None

    def start(self) -> None:
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        env[runtime.ENV_VAR] = str(self.runtime_dir)  # the workers and any helper resolve the same dir
        cmd = [sys.executable, "-m", "shmbroker.broker.cli", "--runtime-dir", str(self.runtime_dir), "serve",
               "--config", str(self.config_path)]
        self._log = open(self.log_path, "wb")  # noqa: SIM115 -- closed in stop()
        t0 = time.monotonic()
        # its own session: a Ctrl-C at the terminal reaches the bench, which then stops the broker with SIGTERM
        self.proc = subprocess.Popen(cmd, env=env, stdout=self._log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True,
                                     preexec_fn=_die_with_bench)  # noqa: PLW1509 -- no threads yet, no allocation
        self._wait_ready(t0)
        self.startup_s = time.monotonic() - t0
        self.instance = runtime.previous_instance(self.runtime_dir)

    def _wait_ready(self, t0: float) -> None:
        if self.proc is None:
            raise BenchError("the broker was not started")
        reason = "no answer yet"
        while time.monotonic() - t0 < READY_TIMEOUT_S:
            if self.proc.poll() is not None:
                raise BenchError(f"the broker exited with code {self.proc.returncode} before it was ready; "
                                 f"its log ends:\n{self.log_tail()}")
            reply = ask_broker(self.runtime_dir, P.Health(wait_ms=1000), 3.0)
            if isinstance(reply, P.HealthReply):
                if reply.ready:
                    return
                reason = reply.reason or ", ".join(
                    f"{m.name} {m.workers_ready}/{m.workers_total}" for m in reply.models)
                if "model load failed" in reason:  # the supervisor retries, but a model that cannot load stays so
                    raise BenchError(f"the broker cannot load its models: {reason}")
                self.progress.tick(f"waiting for the broker: {reason}")
        raise BenchError(f"the broker was not ready within {READY_TIMEOUT_S:.0f} s ({reason}); "
                         f"its log ends:\n{self.log_tail()}")

    def stats(self) -> P.StatsReply | None:
        reply = ask_broker(self.runtime_dir, P.StatsRequest(), 10.0)
        return reply if isinstance(reply, P.StatsReply) else None

    def stop(self) -> None:
        """Look for rings the broker still holds once every client has gone; then SIGTERM, wait, SIGKILL as a
        last resort."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.leaked = sorted(self._held_after_clients())
            self.proc.send_signal(signal.SIGTERM)
            self.killed = procs.wait_or_kill(self.proc, STOP_TIMEOUT_S)
        self.exit_code = self.proc.returncode
        if self._log is not None:
            self._log.close()
            self._log = None

    def _held_after_clients(self) -> set[str]:
        """Rings the broker or its workers hold after the bench's clients closed, once the broker has had
        ``RELEASE_WAIT_S`` to handle their BYEs (its loop does, not at once)."""
        if self.proc is None or not self.instance:
            return set()
        pids = [self.proc.pid, *(c.pid for c in psutil.Process(self.proc.pid).children(recursive=True))]
        end = time.monotonic() + RELEASE_WAIT_S
        while (held := set(ring.held_rings(pids, self.instance))) and time.monotonic() < end:
            time.sleep(0.05)
        return held

    def shutdown_figures(self) -> Figures:
        return {
            "startup_s": None if self.startup_s is None else round(self.startup_s, 2),
            "instance": self.instance,
            "exit_code": self.exit_code,
            "killed": self.killed,
            "shm_leaked": self.leaked,
            "shm_clean": not self.leaked and not self.killed and self.exit_code == 0,
        }

    def log_tail(self, chars: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except FileNotFoundError:
            return "(no log)"

    def renice_workers(self, nice: int) -> list[int]:
        """Set the nice value of every thread of every process under the broker (its workers) to ``nice``
        (Linux keeps one per thread); their pids. BenchError when the bench may not (a negative value needs
        root or CAP_SYS_NICE)."""
        if self.proc is None or self.proc.poll() is not None:
            raise BenchError("--worker-nice: the broker is not running")
        workers = psutil.Process(self.proc.pid).children(recursive=True)
        try:
            for w in workers:
                for t in w.threads():
                    os.setpriority(os.PRIO_PROCESS, t.id, nice)
        except PermissionError as exc:
            raise BenchError(f"--worker-nice {nice}: not permitted ({exc}); a negative value needs root or "
                             "CAP_SYS_NICE") from exc
        return [w.pid for w in workers]

    def __enter__(self) -> BrokerProcess:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def model_counters(reply: P.StatsReply | None) -> dict[str, dict[str, Any]]:
    """Per model, summed over workers: batches, items in batches, requests by status."""
    out: dict[str, dict[str, Any]] = {}
    if reply is None:
        return out
    for w in reply.workers:
        for m in w.models:
            c = out.setdefault(m.name, {"batches": 0, "items": 0, "requests": {}})
            c["batches"] += m.batches
            c["items"] += sum(int(size) * n for size, n in m.batch_items.items())
            for status, n in m.requests.items():
                c["requests"][status] = c["requests"].get(status, 0) + n
    return out


def counters_delta(before: dict[str, dict[str, Any]], after: dict[str, dict[str, Any]], model: str) -> Figures:
    """What the worker did for ``model`` between two stats snapshots: batches and the mean batch size."""
    a = after.get(model)
    if a is None:
        return {}
    b = before.get(model, {"batches": 0, "items": 0, "requests": {}})
    batches = a["batches"] - b["batches"]
    items = a["items"] - b["items"]
    requests = {k: v - b["requests"].get(k, 0) for k, v in a["requests"].items() if v - b["requests"].get(k, 0)}
    return {
        "server_batches": batches,
        "server_items": items,
        "server_mean_batch": round(items / batches, 2) if batches else None,
        "server_requests": requests,
    }
