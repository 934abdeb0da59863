"""A small HTTP server thread for operators: /health/live, /health/ready[/MODEL] and /metrics.

stdlib ``http.server`` on ``monitoring.http_host`` (loopback by default): a few requests a second from a
probe and a scraper need no framework. Each request runs on its own short-lived thread.

- ``/health/live``: 200 while the serving loop turns (else 503).
- ``/health/ready``: 200 when every model is ready (see ``broker.ops.operations.Operations.readiness``), else 503 with
  ``{"ready": false, "models": {"NAME": "why not", ...}}`` naming the models that are not ready.
  ``?wait=SECONDS`` answers as soon as it is ready, or after that long (as ``shmbroker health --wait``).
- ``/health/ready/MODEL``: the same for one model; 404 for a model that is not configured.
- ``/metrics``: the Prometheus text format (``broker.ops.metrics``).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING, Protocol
from urllib.parse import parse_qs, urlsplit

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

if TYPE_CHECKING:
    from shmbroker.broker.ops.operations import Readiness

log = logging.getLogger(__name__)

MAX_WAIT_S = 300.0
WAIT_STEP_S = 0.1


class HealthSource(Protocol):
    def live(self) -> bool: ...

    def readiness(self) -> Readiness: ...


class HealthServer:
    """Serves until ``stop``; ``port`` is the bound port. Binding fails with OSError naming the address."""

    def __init__(self, host: str, port: int, source: HealthSource, registry: CollectorRegistry) -> None:
        self._closing = threading.Event()
        handler = type("Handler", (_Handler,), {"source": source, "registry": registry, "closing": self._closing})
        try:
            self._httpd = ThreadingHTTPServer((host, port), handler)
        except OSError as exc:
            raise OSError(exc.errno, f"cannot serve health on {host}:{port} (monitoring.http_port): "
                                     f"{exc.strerror}") from None
        self._httpd.daemon_threads = True
        self.port: int = self._httpd.server_address[1]
        self._thread = threading.Thread(target=self._httpd.serve_forever, kwargs={"poll_interval": 0.2},
                                        name="shmb-http", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._closing.set()  # waiting /health/ready?wait= requests answer now
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=5)


class _Handler(BaseHTTPRequestHandler):
    source: HealthSource
    registry: CollectorRegistry
    closing: threading.Event
    server_version = "shmbroker"

    def do_GET(self) -> None:
        url = urlsplit(self.path)
        parts = [p for p in url.path.split("/") if p]
        try:
            if parts == ["health", "live"]:
                live = self.source.live()
                self._json(HTTPStatus.OK if live else HTTPStatus.SERVICE_UNAVAILABLE, {"live": live})
            elif parts[:2] == ["health", "ready"] and len(parts) <= 3:
                self._ready(parts[2] if len(parts) == 3 else None, parse_qs(url.query))
            elif parts == ["metrics"]:
                self._send(HTTPStatus.OK, generate_latest(self.registry), CONTENT_TYPE_LATEST)
            else:
                self._json(HTTPStatus.NOT_FOUND, {"error": f"no such path {url.path!r}; try /health/live, "
                                                           "/health/ready, /health/ready/MODEL or /metrics"})
        except ValueError as exc:
            self._json(HTTPStatus.BAD_REQUEST, {"error": str(exc)})

    def _ready(self, model: str | None, query: dict[str, list[str]]) -> None:
        wait = float(query.get("wait", ["0"])[0])
        if not 0 <= wait <= MAX_WAIT_S:
            raise ValueError(f"wait must be 0 to {MAX_WAIT_S:g} seconds")
        end = time.monotonic() + wait
        while True:
            r = self.source.readiness()
            if model is not None and model not in r.models:
                self._json(HTTPStatus.NOT_FOUND, {"error": f"no model {model!r}; models are {sorted(r.models)}"})
                return
            ready = r.ready if model is None else not r.models[model]
            if ready or time.monotonic() >= end or self.closing.wait(WAIT_STEP_S):
                break
        if model is None:
            body: dict[str, object] = {"ready": ready, "models": r.not_ready()}
        else:
            body = {"model": model, "ready": ready, "reason": r.models[model]}
        self._json(HTTPStatus.OK if ready else HTTPStatus.SERVICE_UNAVAILABLE, body)

    def _json(self, status: HTTPStatus, body: object) -> None:
        self._send(status, json.dumps(body).encode() + b"\n", "application/json")

    def _send(self, status: HTTPStatus, data: bytes, content_type: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: object) -> None:
        log.debug("%s " + format, self.address_string(), *args)
