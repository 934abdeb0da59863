"""Health probes: a one-row dummy inference per model, at an interval, through the real data path.

The prober is a thread of the broker that holds an ordinary client session (``client.Client``): its probe
takes a ring slot, is checked by a worker's intake, batched, run by the engine and answered with DONE like
any request. A probe that passes proves more than a live worker process does: the engine still answers.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from shmbroker.client import Client, ShmBrokerError

log = logging.getLogger(__name__)

RETRY_S = 0.5  # wait before a new session when the last one could not be made


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
        self._thread = threading.Thread(target=self._loop, name="shmb-prober", daemon=True)

    def start(self) -> None:
        self._thread.start()

    @property
    def started(self) -> bool:
        return self._thread.ident is not None

    def stop(self) -> None:
        self._stop.set()
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
        client: Client | None = None
        try:
            while not self._stop.is_set():
                if client is None:
                    try:
                        client = Client(self.runtime_dir, slots=2, max_items=1, connect_timeout=self.timeout_s,
                                        name="shmb-prober", spin_us=0)
                    except Exception as exc:  # noqa: BLE001 - any failure to open a session fails the probes
                        log.warning("the prober could not open a session: %s: %s", type(exc).__name__, exc)
                        for m in self.models:
                            self._record(m, f"the prober could not open a session: {exc}")
                        self._stop.wait(RETRY_S)
                        continue
                for m in self.models:
                    self._probe(client, m)
                self._stop.wait(self.interval_s)
        finally:
            if client is not None:
                client.close()

    def _probe(self, client: Client, model: str) -> None:
        plan = client.models.get(model)
        if plan is None:
            self._record(model, f"the broker's session does not list model {model!r}")
            return
        feeds = {s.name: np.zeros((1, *shape), dt)
                 for s, shape, dt in zip(plan.info.inputs, plan.in_item_shapes, plan.in_dtypes, strict=True)}
        try:
            client.infer(model, feeds, timeout=self.timeout_s)
        except ShmBrokerError as exc:
            log.warning("health probe of model %s failed: %s: %s", model, type(exc).__name__, exc)
            self._record(model, f"probe failed: {type(exc).__name__}: {exc}")
            return
        self._record(model, "")
