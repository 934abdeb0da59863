"""One HTTP front-end process: the KServe v2 / Triton HTTP protocol on aiohttp and uvloop, answered from the rings.

The process holds one ring session (``client.AsyncClient``): an infer request's tensors go from the HTTP
body into a ring slot with one copy, the worker writes the outputs into the same slot, and the response is
built from them. Several such processes accept from one listening socket that frontend/main.py binds and
passes to them; the kernel hands each connection to one of them. A model of images takes KServe v2 BYTES
inputs, or one photo as the whole body (frontend/kserve.py). Errors are ``{"error": "..."}`` with 400
(bad input), 401 (no or a wrong API key, with ``--api-key-file``), 404 (unknown model or path), 408 (headers
or body too slow), 413 (body, or a photo, too large), 415 (a photo sent to a model of tensors), 503
(overloaded, not ready, worker died), 504 (timeout), 500 (anything else). frontend/connections.py bounds
what slow or many clients can hold in connections and time, and frontend/limits.py what their bodies can:
time, pace and memory.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import os
import resource
import signal
import socket
from collections.abc import Awaitable, Callable
from multiprocessing.connection import Connection
from pathlib import Path

import msgspec
import numpy as np
from aiohttp import web

from shmbroker.broker.common import proc
from shmbroker.broker.common import protocol as P
from shmbroker.broker.common.ask import ask_broker
from shmbroker.client import AsyncClient, ShmBrokerError
from shmbroker.frontend import kserve
from shmbroker.frontend.connections import ConnectionGuard, accept_batch
from shmbroker.frontend.kserve import HEADER_LENGTH, HttpError, status_of
from shmbroker.frontend.limits import BodyBudget, request_body
from shmbroker.frontend.settings import Settings

log = logging.getLogger(__name__)
VERSION = "0.1.0"
MAX_ITEMS_SETTING = "shmbroker http --max-items"  # what a BAD_SHAPE answer over the session's rows names
SLOTS_SETTING = "shmbroker http --slots"  # what a wait for a slot that timed out names
PID_HEADER = "X-Shmbroker-Frontend-Pid"  # which front-end process answered (tests check that several share a port)
OPEN_PATHS = frozenset({"/v2/health/live", "/v2/health/ready"})  # answered without the API key: probes carry none
# An idle keep-alive connection's life: run_app's default (AppRunner's own is an hour). aiohttp applies it to a new
# connection before its first request too, so it is kept at least as long as --header-timeout, which governs that.
KEEPALIVE_S = 75.0
FD_SLACK = 16  # descriptors that come and go beside the counted ones: the executor's questions to the broker
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _json(doc: object, status: int = 200) -> web.Response:
    return web.Response(body=msgspec.json.encode(doc), status=status, content_type="application/json")


def key_matches(authorization: str, key: str) -> bool:
    """Whether an ``Authorization`` header value is ``Bearer <key>``, compared in constant time."""
    scheme, _, token = authorization.partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(errors="surrogateescape"),
                                                              key.encode())


class Frontend:
    """The routes of one front-end process over its ring session (None until the broker answered)."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.client: AsyncClient | None = None
        self.guard = ConnectionGuard(settings)
        self.bodies = BodyBudget(settings.body_memory_mib << 20, settings.peer_body_memory_mib << 20)

    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.settings.max_body_mib << 20,
                              middlewares=[self.guard.track, self._errors, self._authorize])
        r = app.router
        r.add_get("/v2", self.server_metadata)
        r.add_get("/v2/health/live", self.live)
        r.add_get("/v2/health/ready", self.ready)
        for base in ("/v2/models/{model}", "/v2/models/{model}/versions/{version}"):
            r.add_get(base, self.metadata)
            r.add_get(base + "/ready", self.model_ready)
            r.add_post(base + "/infer", self.infer)
        app.on_response_prepare.append(self._stamp)
        return app

    @web.middleware
    async def _errors(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """Every failure as the protocol's error JSON, also aiohttp's own 404/405/413."""
        try:
            return await handler(request)
        except HttpError as exc:
            response = _json({"error": exc.message}, exc.status)
        except web.HTTPException as exc:
            response = _json({"error": exc.reason}, exc.status)
        except Exception as exc:
            log.exception("%s %s failed", request.method, request.path)
            response = _json({"error": f"internal error: {exc!r}"}, 500)
        if not request.content.is_eof():
            response.force_close()  # a body left unread (refused, too slow): say so, aiohttp closes after it
        return response

    @web.middleware
    async def _authorize(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """401 without ``Authorization: Bearer <key>`` when the process has a key, but on the health probes."""
        key = self.settings.api_key
        if not key or request.path in OPEN_PATHS or key_matches(request.headers.get("Authorization", ""), key):
            return await handler(request)
        response = _json({"error": "unauthorized: send the header 'Authorization: Bearer KEY', KEY being the "
                                   "key in the file of shmbroker http --api-key-file"}, 401)
        response.headers["WWW-Authenticate"] = 'Bearer realm="shmbroker"'
        return response

    async def _stamp(self, _request: web.Request, response: web.StreamResponse) -> None:
        response.headers[PID_HEADER] = str(os.getpid())

    def _client(self) -> AsyncClient:
        """The session's client; 503 while there is none: not made yet, or the broker gone (it rejoins)."""
        if self.client is None:
            raise HttpError(503, "not ready: no session with the broker yet")
        if not self.client.client.connected:
            raise HttpError(503, "not ready: the broker is gone (stopped or restarting); the session comes back "
                                 "with it")
        return self.client

    def _model(self, request: web.Request) -> P.ModelInfo:
        name = request.match_info["model"]
        version = request.match_info.get("version")
        plan = self._client().models.get(name)
        if plan is None or version not in (None, "", "1"):
            what = f"model {name!r}" + (f" version {version!r}" if version else "")
            raise HttpError(404, f"{what}: not served; models are {sorted(self._client().models)} (version 1 each)")
        info: P.ModelInfo = plan.info
        return info

    async def _health(self) -> P.HealthReply:
        loop = asyncio.get_running_loop()
        reply = await loop.run_in_executor(None, ask_broker, self.settings.runtime_dir, P.Health(0), 2.0)
        if not isinstance(reply, P.HealthReply):
            raise HttpError(503, f"not ready: the broker on {self.settings.runtime_dir} does not answer")
        return reply

    async def server_metadata(self, _request: web.Request) -> web.Response:
        return _json({"name": "shmbroker", "version": VERSION, "extensions": ["binary_tensor_data"]})

    async def live(self, _request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def ready(self, _request: web.Request) -> web.Response:
        self._client()
        reply = await self._health()
        if not reply.ready:
            raise HttpError(503, f"not ready: {reply.reason}")
        return web.Response(status=200)

    async def metadata(self, request: web.Request) -> web.Response:
        return _json(kserve.model_metadata(self._model(request)))

    async def model_ready(self, request: web.Request) -> web.Response:
        info = self._model(request)
        reply = await self._health()
        health = next((m for m in reply.models if m.name == info.name), None)
        if health is None or not health.ready:
            raise HttpError(503, f"model {info.name!r} not ready: {health.reason if health else 'unknown'}")
        return web.Response(status=200)

    async def infer(self, request: web.Request) -> web.Response:
        info = self._model(request)
        client = self._client()
        header_length = request.headers.get(HEADER_LENGTH)
        image_body = kserve.is_image_body(request.content_type, header_length, info)
        async with request_body(request, self.bodies, self.settings) as body:
            req = kserve.parse_image_body(body, info) if image_body else kserve.parse_infer(body, header_length, info)
            try:
                out = await client.infer(info.name, req.payload(), req.timeout_s)
            except ShmBrokerError as exc:
                raise HttpError(status_of(exc), str(exc)) from None
        outputs = out if isinstance(out, dict) else {info.outputs[0].name: out}
        return self._response(info, req, outputs)

    def _response(self, info: P.ModelInfo, req: kserve.InferRequest, outputs: dict[str, np.ndarray]) -> web.Response:
        data, header_length = kserve.encode_response(info, req, outputs)
        if header_length is None:
            return web.Response(body=data, content_type="application/json")
        return web.Response(body=data, content_type="application/octet-stream",
                            headers={HEADER_LENGTH: str(header_length)})

    async def connect(self, stop: asyncio.Event) -> None:
        """Open the ring session, retrying until the broker answers (it may start after the front-end)."""
        loop = asyncio.get_running_loop()
        s = self.settings
        last, tries = "", 0  # the reason last logged at WARNING: once, then on change, not once a second
        while not stop.is_set():
            try:
                self.client = await loop.run_in_executor(None, lambda: AsyncClient(
                    s.runtime_dir, slots=s.slots, max_items=s.max_items, connect_timeout=s.connect_timeout_s,
                    name=f"http-{os.getpid()}"))
                self.client.client.max_items_setting = MAX_ITEMS_SETTING
                self.client.client.slots_setting = SLOTS_SETTING
                if tries:
                    log.info("session with the broker on %s after %d failed tries", s.runtime_dir, tries)
                return
            except ShmBrokerError as exc:
                tries += 1
                why = f"{type(exc).__name__}: {exc}"
                if why != last:
                    log.warning("no session with the broker on %s yet (%s); retrying every second, logged again "
                                "when the reason changes", s.runtime_dir, why)
                    last = why
                else:
                    log.debug("still no session with the broker on %s (try %d)", s.runtime_dir, tries)
                # the handshake already waited connect_timeout_s; a short pause keeps a refusing broker calm
                try:
                    await asyncio.wait_for(stop.wait(), 1.0)
                except TimeoutError:
                    continue


class GuardedSite(web.BaseSite):
    """aiohttp's SockSite, but the front-end's ConnectionGuard accepts each connection and guards it."""

    def __init__(self, runner: web.BaseRunner, sock: socket.socket, guard: ConnectionGuard) -> None:
        super().__init__(runner)
        self._sock = sock
        self._guard = guard

    @property
    def name(self) -> str:
        if self._sock.family == socket.AF_UNIX:
            return f"unix:{self._sock.getsockname()}"
        host, port = self._sock.getsockname()[:2]
        return f"http://{host}:{port}"

    async def start(self) -> None:
        await super().start()
        server = self._runner.server
        if server is None:
            raise RuntimeError("GuardedSite: the runner was cleaned up before the site started")
        self._guard.listen(self._sock, server)

    async def stop(self) -> None:
        self._guard.stop_listening()
        await super().stop()


def fit_open_files(max_connections: int, clients: int) -> None:
    """Once the session is up: raise the open-files soft limit to this process's own descriptors, --max-connections
    and what one loop turn closes, when OWN_FDS was too few (a broker of many workers); a warning naming the
    option when the hard limit is lower. ``clients``: the client connections among the open descriptors."""
    own = len(os.listdir("/proc/self/fd")) - clients
    need = own + FD_SLACK + max_connections + accept_batch(max_connections)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= need:
        return
    if hard != resource.RLIM_INFINITY and hard < need:
        log.warning("this process holds %d descriptors of its own: with --max-connections %d it needs %d open files "
                    "and may open %d (ulimit -Hn; LimitNOFILE= in a unit); a flood of connections may be reset: "
                    "lower --max-connections, or raise the limit", own, max_connections, need, hard)
        return
    resource.setrlimit(resource.RLIMIT_NOFILE, (need, hard))


async def serve(settings: Settings, ready: Connection | None = None, sock: socket.socket | None = None) -> None:
    """Serve until SIGTERM or SIGINT on ``sock`` (the parent's listening socket), else on a port of its own;
    sends ("ready", pid) on ``ready`` once the session and the port are up."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    fe = Frontend(settings)
    runner = web.AppRunner(fe.app(), access_log=None, handle_signals=False,
                           keepalive_timeout=max(KEEPALIVE_S, settings.header_timeout_s))
    await runner.setup()
    # alone (``python -m shmbroker.frontend.server``) it binds without SO_REUSEPORT, so it too owns its port
    site = GuardedSite(runner, sock if sock is not None else socket.create_server((settings.host, settings.port)),
                       fe.guard)
    await site.start()
    await fe.connect(stop)
    if fe.client is not None:
        fit_open_files(settings.max_connections, fe.guard.held)
        log.info("front-end ready on %s, models %s", site.name, sorted(fe.client.models))
        if ready is not None:
            ready.send(("ready", os.getpid()))
        await stop.wait()
    await runner.cleanup()
    if fe.client is not None:
        await fe.client.close()


def run(settings: Settings, ready: Connection | None = None, log_level: str = "INFO",
        sock: socket.socket | None = None) -> None:
    """Process entry point (multiprocessing target): one front-end process on uvloop, serving ``sock``."""
    import uvloop

    proc.name_process("shmb-http")
    proc.setup_logging(log_level)
    proc.die_with_parent()
    uvloop.run(serve(settings, ready, sock))


def _main_args(argv: list[str] | None = None) -> Settings:
    import argparse

    from shmbroker.broker.common import runtime

    ap = argparse.ArgumentParser(description="one shmbroker HTTP front-end process (see `shmbroker http`)")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--runtime-dir", default="")
    args = ap.parse_args(argv)
    return Settings(args.host, args.port, Path(args.runtime_dir) if args.runtime_dir else runtime.resolve())


if __name__ == "__main__":
    run(_main_args())
