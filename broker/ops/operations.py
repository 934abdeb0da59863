"""The broker's operational side, driven from its serving loop: systemd notifications, health probes,
readiness, and the HTTP server for /health and /metrics.

The serving loop calls ``tick`` once per turn (its heartbeat, the watchdog ping and READY) and ``stopping``
when it leaves. Everything the HTTP thread needs from the loop it gets over the broker's own control socket
(HEALTH, STATS), so no broker state is shared across threads; the prober's state has its own lock.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from shmbroker.broker.common import protocol as P
from shmbroker.broker.common.ask import ask_broker
from shmbroker.broker.common.config import Config
from shmbroker.broker.ops.http_health import HealthServer
from shmbroker.broker.ops.metrics import build_registry
from shmbroker.broker.ops.notify import Notifier
from shmbroker.broker.ops.probe import Prober

log = logging.getLogger(__name__)

LIVE_MAX_AGE_S = 10.0  # /health/live fails when the serving loop has not turned for this long
ASK_TIMEOUT_S = 2.0


@dataclass
class Readiness:
    """Per model: ready or the reason it is not. ``ready`` is true only when every model is."""

    models: dict[str, str] = field(default_factory=dict)  # model -> "" when ready, else why not

    @property
    def ready(self) -> bool:
        return bool(self.models) and not any(self.models.values())

    def not_ready(self) -> dict[str, str]:
        return {m: why for m, why in self.models.items() if why}


class Operations:
    """Owns the notifier, the prober and the HTTP server of one broker; see the module docstring."""

    def __init__(self, cfg: Config, runtime_dir: Path, notifier: Notifier | None = None) -> None:
        self.cfg = cfg
        self.runtime_dir = runtime_dir
        self.notifier = notifier or Notifier()
        self.heartbeat = time.monotonic()
        mon = cfg.monitoring
        self.prober: Prober | None = None
        if mon.http_port and mon.probe_interval_ms:
            self.prober = Prober(runtime_dir, list(cfg.models), mon.probe_interval_ms / 1e3,
                                 mon.probe_timeout_ms / 1e3, mon.ready_max_age_ms / 1e3)
        self._ready_sent = False
        self._status = ""
        self._server: HealthServer | None = None
        if mon.http_port:
            registry = build_registry(cfg, runtime_dir, self.prober)
            server = HealthServer(mon.http_host, mon.http_port, self, registry)
            server.start()
            self._server = server
            log.info("health and metrics on http://%s:%d/", mon.http_host, server.port)
        self.notifier.status("starting: loading models")

    def tick(self, now: float, health: Callable[[], P.HealthReply]) -> None:
        """One turn of the serving loop: heartbeat, WATCHDOG=1 when due, READY=1 and STATUS= on changes."""
        self.heartbeat = now
        self.notifier.ping(now)
        reply = health()
        if reply.ready and self.prober is not None and not self.prober.started:
            self.prober.start()  # probes need a worker that has the models: start with the first one ready
        probes_ok = self.prober is None or self.prober.all_passed()
        if reply.ready and probes_ok:
            status = f"ready: models {', '.join(self.cfg.models)} on {len(self.cfg.worker.devices)} worker(s)"
            if not self._ready_sent:
                self._ready_sent = True
                self._status = status
                self.notifier.ready(status)
                log.info("ready: every model answered its warm-up%s",
                         " and a health probe" if self.prober is not None else "")
                return
        elif not reply.ready:
            status = f"{'degraded' if self._ready_sent else 'starting'}: {reply.reason}"
        else:
            status = "waiting for the first health probe of every model"
        if status != self._status:
            self._status = status
            self.notifier.status(status)

    def live(self) -> bool:
        return time.monotonic() - self.heartbeat < LIVE_MAX_AGE_S

    def readiness(self) -> Readiness:
        """Each model: a worker serving it has passed warm-up (asked of the serving loop) and, when probes
        run, it passed a probe within ``monitoring.ready_max_age_ms``. Called from the HTTP thread."""
        reply = ask_broker(self.runtime_dir, P.Health(0), ASK_TIMEOUT_S)
        if not isinstance(reply, P.HealthReply):
            why = f"the broker's serving loop did not answer within {ASK_TIMEOUT_S:g} s"
            return Readiness(dict.fromkeys(self.cfg.models, why))
        out = Readiness()
        now = time.monotonic()
        for m in reply.models:
            if not m.ready:
                out.models[m.name] = m.reason or f"no worker serving {m.name} is ready"
            elif self.prober is not None:
                out.models[m.name] = self.prober.passed(m.name, now)[1]
            else:
                out.models[m.name] = ""
        return out

    def stopping(self) -> None:
        """The loop is leaving (SIGTERM, SIGINT): STOPPING=1, then stop the prober and the HTTP server."""
        self.notifier.stopping("stopping: shutting down workers and removing segments")
        if self.prober is not None:
            self.prober.stop()
        if self._server is not None:
            self._server.stop()
        self.notifier.close()
