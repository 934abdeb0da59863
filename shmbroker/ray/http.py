"""The KServe v2 HTTP protocol on a replica: Ray Serve's proxy hands it Starlette requests.

The bodies are the HTTP front-end's (frontend/kserve.py: JSON tensors and the binary tensor data extension), and
so are the routes, the ``{"error": ...}`` answers and their statuses (``kserve.status_of``: 400 bad input, 404
unknown model or path, 503 overloaded, worker died or not ready, 504 timeout). Paths are taken after the
application's route prefix. Every answer names the node that gave it (``X-Shmbroker-Node``, Ray's node id).
"""

from __future__ import annotations

import logging
import re
from typing import TYPE_CHECKING

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from shmbroker.broker.common import protocol as P
from shmbroker.client import ShmBrokerError
from shmbroker.frontend import kserve
from shmbroker.frontend.kserve import HEADER_LENGTH, HttpError, status_of

if TYPE_CHECKING:
    from shmbroker.ray.node import NodeBroker

log = logging.getLogger(__name__)
NODE_HEADER = "X-Shmbroker-Node"
VERSION = "0.1.0"
MODEL_PATH = re.compile(r"/v2/models/(?P<model>[^/]+)(?:/versions/(?P<version>[^/]+))?(?P<verb>/ready|/infer)?")


def _json(doc: object, status: int = 200) -> Response:
    return Response(msgspec.json.encode(doc), status, media_type="application/json")


async def respond(node: NodeBroker, request: Request) -> Response:
    """The answer to one HTTP request; every failure as the protocol's error JSON."""
    root = str(request.scope.get("root_path", ""))
    path = request.url.path.removeprefix(root.rstrip("/")) or "/"
    try:
        response = await _route(node, request, path)
    except HttpError as exc:
        response = _json({"error": exc.message}, exc.status)
    except Exception as exc:
        log.exception("%s %s failed", request.method, request.url.path)
        response = _json({"error": f"internal error: {exc!r}"}, 500)
    response.headers[NODE_HEADER] = node.node_id
    return response


async def _route(node: NodeBroker, request: Request, path: str) -> Response:
    get = request.method in ("GET", "HEAD")
    if path == "/v2" and get:
        return _json({"name": "shmbroker", "version": VERSION, "extensions": ["binary_tensor_data"]})
    if path == "/v2/health/live" and get:
        return Response(status_code=200)
    if path == "/v2/health/ready" and get:
        await _ready(node)
        return Response(status_code=200)
    m = MODEL_PATH.fullmatch(path)
    if m is None:
        raise HttpError(404, f"no route for {path}: expected /v2, /v2/health/{{live,ready}} or "
                             "/v2/models/{model}[/versions/1][/ready|/infer]")
    info = _model(node, m["model"], m["version"])
    verb = m["verb"] or ""
    if verb == "/infer":
        if request.method != "POST":
            raise HttpError(405, f"{path}: expected POST, got {request.method}")
        return await _infer(node, request, info)
    if not get:
        raise HttpError(405, f"{path}: expected GET, got {request.method}")
    if verb == "/ready":
        reply = await _ready(node)
        health = next((h for h in reply.models if h.name == info.name), None)
        if health is None or not health.ready:
            raise HttpError(503, f"model {info.name!r} not ready: {health.reason if health else 'unknown'}")
        return Response(status_code=200)
    return _json(kserve.model_metadata(info))


async def _ready(node: NodeBroker) -> P.HealthReply:
    why, reply = await node.health()
    if why or reply is None:
        raise HttpError(503, f"not ready: {why}")
    return reply


def _model(node: NodeBroker, name: str, version: str | None) -> P.ModelInfo:
    plan = node.client.models.get(name)
    if plan is None or version not in (None, "", "1"):
        what = f"model {name!r}" + (f" version {version!r}" if version else "")
        raise HttpError(404, f"{what}: not served; models are {sorted(node.client.models)} (version 1 each)")
    info: P.ModelInfo = plan.info
    return info


async def _infer(node: NodeBroker, request: Request, info: P.ModelInfo) -> Response:
    body = await request.body()
    header_length = request.headers.get(HEADER_LENGTH)
    content_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if kserve.is_image_body(content_type, header_length, info):
        req = kserve.parse_image_body(body, info)  # one photo as the body, as `shmbroker http` takes it
    else:
        req = kserve.parse_infer(body, header_length, info)
    try:
        out = await node.infer(info.name, req.payload(), req.timeout_s)
    except ShmBrokerError as exc:
        raise HttpError(status_of(exc), str(exc)) from None
    outputs = out if isinstance(out, dict) else {info.outputs[0].name: out}
    data, header_length = kserve.encode_response(info, req, outputs)
    if header_length is None:
        return Response(data, media_type="application/json")
    return Response(data, media_type="application/octet-stream", headers={HEADER_LENGTH: str(header_length)})
