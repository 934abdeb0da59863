"""Health probes: a one-row dummy inference per model, at an interval, through the real data path.

The probes run in a child process of the broker, ``shmb-prober`` (broker/ops/prober_process.py), an ordinary
client of the rings: its probe takes a ring slot, is checked by a worker's intake, batched, run by the engine
and answered with DONE like any request. A probe that passes proves more than a live worker process does: the
engine still answers. ``Prober`` (a thread of the broker) starts that process, reads its results and keeps
each model's record; a prober process that exits fails every model's probe and is started again.
"""

from __future__ import annotations

import contextlib
import logging
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import msgspec

from shmbroker.broker.common import protocol as P

log = logging.getLogger(__name__)

RETRY_S = 0.5  # wait before starting a prober process again


@dataclass
class ProbeState:
    """One model's probe record; ``last_ok`` is a ``time.monotonic()`` stamp, 0.0 before the first pass."""

    last_ok: float = 0.0
    last_error: str = "no probe has run yet"
    ok: int = 0
    failed: int = 0


class Prober:
    """Probes every model once per ``interval_s`` (each with ``timeout_s``); a model has passed when its last
    successful probe is at most ``max_age_s`` old. Thread-safe readers: ``snapshot`` and ``passed``.
    """

    def __init__(self, runtime_dir: Path, models: list[str], interval_s: float, timeout_s: float,
                 max_age_s: float) -> None:
        self.runtime_dir = runtime_dir
        self.models = list(models)
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.max_age_s = max_age_s
        self._lock = threading.Lock()
        self._states = {m: ProbeState() for m in self.models}
        self._stop = threading.Event()
        self._child: subprocess.Popen[bytes] | None = None  # the prober process, owned by the thread
        self._thread = threading.Thread(target=self._loop, name="shmb-prober", daemon=True)

    def start(self) -> None:
        self._thread.start()

    @property
    def started(self) -> bool:
        return self._thread.ident is not None

    def stop(self) -> None:
        """End the prober process (SIGTERM: it closes its session) and the reading thread."""
        self._stop.set()
        with self._lock:
            child = self._child
        if child is not None:
            with contextlib.suppress(ProcessLookupError):
                child.terminate()
        if self.started:
            self._thread.join(timeout=self.timeout_s + 10)

    def snapshot(self) -> dict[str, ProbeState]:
        with self._lock:
            return {m: ProbeState(s.last_ok, s.last_error, s.ok, s.failed) for m, s in self._states.items()}

    def passed(self, model: str, now: float | None = None) -> tuple[bool, str]:
        """(passed, why not): whether ``model``'s last successful probe is recent enough."""
        t = time.monotonic() if now is None else now
        with self._lock:
            s = self._states[model]
            if s.last_ok and t - s.last_ok <= self.max_age_s:
                return True, ""
            return False, s.last_error or f"no probe passed in the last {self.max_age_s:g} s"

    def all_passed(self) -> bool:
        now = time.monotonic()
        return all(self.passed(m, now)[0] for m in self.models)

    def _record(self, model: str, error: str) -> None:
        with self._lock:
            s = self._states[model]
            if error:
                s.failed += 1
                s.last_error = error
            else:
                s.ok += 1
                s.last_ok = time.monotonic()
                s.last_error = ""

    def _loop(self) -> None:
        while not self._stop.is_set():
            child = self._spawn()
            if self._stop.is_set():  # stop() ran before the process was recorded
                child.terminate()
            self._read(child)
            code = child.wait()
            if self._stop.is_set():
                return
            for m in self.models:
                self._record(m, f"the prober process exited with code {code}")
            log.warning("the prober process exited with code %s; starting another", code)
            self._stop.wait(RETRY_S)

    def _spawn(self) -> subprocess.Popen[bytes]:
        cmd = [sys.executable, "-m", "shmbroker.broker.ops.prober_process", "--runtime-dir", str(self.runtime_dir),
               "--interval", str(self.interval_s), "--timeout", str(self.timeout_s),
               "--log-level", logging.getLevelName(logging.getLogger().getEffectiveLevel()), *self.models]
        child = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE)
        with self._lock:
            self._child = child
        return child

    def _read(self, child: subprocess.Popen[bytes]) -> None:
        """Record each result line until the process's stdout closes."""
        if child.stdout is None:
            return
        decoder = msgspec.json.Decoder(P.ProbeResult)
        for line in child.stdout:
            try:
                result = decoder.decode(line)
            except msgspec.DecodeError as exc:
                log.error("the prober process wrote a line that is no ProbeResult: %s", exc)
                continue
            if result.model in self._states:
                self._record(result.model, result.error)
